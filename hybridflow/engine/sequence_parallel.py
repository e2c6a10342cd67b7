"""Token log-probs of a micro-batch with its packed sequence split over a Ulysses group
(`parallel/ulysses.py` has the layout, the attention and the collectives): each rank scores its own
T/sp positions, the [T] results are all-gathered (backward: the rank's slice x sp) and the
response positions picked, as `engine.model.response_logprobs` does for the unsplit packed row."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridflow.algorithms import entropy_from_logits, logprobs_from_logits
from hybridflow.engine.fused_logprobs import fused_head_problem, head_returns_logprobs
from hybridflow.parallel.ulysses import SeqShard, gather_seq, pack, sharded_forward


def response_logprobs(model: nn.Module, mb, group, temperature: float = 1.0, chunk: int | None = None,
                      with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(response token) [b, R], entropy [b, R] or None) fp32, what `engine.model.response_logprobs`
    returns for the packed micro-batch, computed with the sequence split over `group` (module doc).
    Every rank of the group must call it with the same micro-batch."""
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    resp = mb["responses"]  # [b, R]
    b, resp_len = resp.shape
    ids, pos, cu, row = pack(mb, sp)
    n = ids.shape[0] // sp
    lo, hi = rank * n, (rank + 1) * n
    targets = torch.roll(ids, -1)[lo:hi]  # [n]: position p predicts token p+1 (the last one's is never read)
    kwargs = {"input_ids": ids[lo:hi][None], "position_ids": pos[lo:hi][None], "use_cache": False, "ulysses": SeqShard(group, cu)}
    with sharded_forward():
        if chunk is not None and fused_head_problem(model) is None:
            with head_returns_logprobs(model, targets[None], temperature, chunk, with_entropy):
                local = model(**kwargs, logits_to_keep=0).logits[0]  # [n, 2]
        else:
            logits = model(**kwargs, logits_to_keep=0).logits[0].float()  # [n, V]
            logits = logits / temperature if temperature != 1.0 else logits
            local = torch.stack([logprobs_from_logits(logits, targets),
                                 entropy_from_logits(logits) if with_entropy else torch.zeros_like(targets, dtype=logits.dtype)], dim=-1)
            del logits
    full = gather_seq(local, group)  # [T, 2]
    wanted = row[:, -resp_len - 1 : -1].clamp(min=0)  # [b, R]: positions after a response's end read token 0's
    out = full[wanted]  # [b, R, 2]
    return out[..., 0], (out[..., 1] if with_entropy else None)

