"""Forward passes of an HF model on a micro-batch: response logits and micro-batches.

Sequence layout used everywhere (verl's): `input_ids` [B, P+R] = left-padded prompt (P tokens)
followed by the right-padded response (R tokens). The logits that predict response token j sit
at position P-1+j, so response logits are `logits[:, -R-1:-1]`.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
import torch.nn as nn

from hybridflow.algorithms import entropy_from_logits, logprobs_from_logits
from hybridflow.engine.fused_logprobs import fused_head_problem, head_returns_logprobs, warn_once
from hybridflow.models.exact import exact_row_logits
from hybridflow.models.routing import set_target as replay_routes
from hybridflow.models.vlm_inputs import forward_inputs, is_multi_modal, suppress_logits
from hybridflow.protocol import Batch


def _keeps_logits(model: nn.Module) -> bool:
    """Whether the model's forward takes `logits_to_keep` (HF causal LMs; not value heads)."""
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def masked_entropy(logits: torch.Tensor, suppress: Sequence[int]) -> torch.Tensor:
    """Entropy [...] of logits [..., V] whose `suppress` columns may be -inf (`suppress_logits`): `entropy_from_logits`, with
    those p * z terms 0 (their p is 0; 0 * -inf would be nan, in the value and in backward)."""
    if not suppress:
        return entropy_from_logits(logits)
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    finite = torch.where(torch.isneginf(logits), 0.0, logits)  # the suppressed logits (where `suppress_logits` set them)
    return torch.logsumexp(logits, dim=-1) - (p * finite).sum(dim=-1)


def response_logits(model: nn.Module, mb: Batch, temperature: float = 1.0, remove_padding: bool = False, exact: bool = False,
                    suppress: Sequence[int] = ()) -> torch.Tensor:
    """Logits [b, R, V] (or [b, R, 1] for a value head) at the positions that predict the response.
    A causal LM projects only those positions onto the vocabulary (`logits_to_keep`), as TRL does.

    remove_padding: the micro-batch's valid tokens run as one packed row [1, T] whose position ids
    restart at 0 per sequence (transformers then masks attention across sequences), and the logits
    are gathered back to [b, R, V]; positions after a response's end (masked out) get row 0's.
    exact: each row alone through `exact_row_logits` (its prompt without the left padding).
    suppress: token ids whose logits are -inf (a VLM's vision tokens, never sampled: `suppress_logits`), except at the
    positions whose response token is one of them (a tool's image tokens, mask 0)."""
    resp_len = mb["responses"].shape[1]
    keep = _keeps_logits(model)
    remove_padding = remove_padding and not is_multi_modal(mb)  # a VLM micro-batch runs padded (models/vlm_inputs.py)
    pos, mm = forward_inputs(mb)  # VLM: M-RoPE [3, b, L] and the rows' packed pixel inputs; text: [b, L], {}
    replay_routes(model, mb, packed=remove_padding and not exact)  # MoE routing replay: mb's routed_experts, if any (models/routing.py)
    if exact:
        prompt_mask = mb["attention_mask"][:, : -resp_len].bool()  # [b, P]
        return suppress_logits(torch.cat([exact_row_logits(model, ids[:-resp_len][m], resp, temperature)
                                          for ids, m, resp in zip(mb["input_ids"], prompt_mask, mb["responses"])]), suppress, mb["responses"])
    if remove_padding:
        mask = mb["attention_mask"].bool()  # [b, P+R]
        row = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        row[mask] = torch.arange(int(mask.sum()), device=mask.device)  # packed position of each valid token
        wanted = row[:, -resp_len - 1 : -1].clamp(min=0)  # [b, R]
        kwargs = {"logits_to_keep": wanted.reshape(-1)} if keep else {}
        out = model(input_ids=mb["input_ids"][mask][None], position_ids=mb["position_ids"][mask][None], use_cache=False, **kwargs)
        logits = (out.logits[0].view(*wanted.shape, -1) if keep else out.logits[0][wanted]).float()  # [b, R, V]
    else:
        kwargs = {"logits_to_keep": resp_len + 1} if keep else {}
        out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=pos, use_cache=False, **kwargs, **mm)
        logits = out.logits[:, -resp_len - 1 : -1, :].float()
    return suppress_logits(logits / temperature if temperature != 1.0 else logits, suppress, mb["responses"])


def response_logprobs(model: nn.Module, mb: Batch, temperature: float = 1.0, remove_padding: bool = False, exact: bool = False,
                      chunk: int | None = None, with_entropy: bool = True, suppress: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(response token) [b, R], entropy [b, R] or None) fp32 of a causal LM, as
    logprobs_from_logits / entropy_from_logits of `response_logits` compute them.

    chunk: the last hidden states go through the LM head `chunk` tokens at a time and only
    [chunk, V] logits exist at once (`engine/fused_logprobs.py`, model.use_fused_kernels); None, or
    exact (its per-row pass must stay bitwise the sampler's), or a head the chunked pass cannot
    stand in for: the plain [b, R, V] logits. suppress: token ids left out of the softmax (their logits -inf), a VLM's
    vision tokens, which the rollout never samples (`TrainEngine` sets it from the model config)."""
    problem = None if chunk is None else ("the exact rollout mode scores each row with the sampler's own pass" if exact else fused_head_problem(model))
    if chunk is None or problem is not None:
        if problem is not None:
            warn_once(problem)
        logits = response_logits(model, mb, temperature, remove_padding, exact, suppress)  # [b, R, V]
        return logprobs_from_logits(logits, mb["responses"]), (masked_entropy(logits, suppress) if with_entropy else None)
    resp = mb["responses"]  # [b, R]
    b, resp_len = resp.shape
    remove_padding = remove_padding and not is_multi_modal(mb)  # a VLM micro-batch runs padded (models/vlm_inputs.py)
    pos, mm = forward_inputs(mb)  # VLM: M-RoPE [3, b, L] and the rows' packed pixel inputs; text: [b, L], {}
    replay_routes(model, mb, packed=remove_padding)  # MoE routing replay: mb's routed_experts, if any (models/routing.py)
    if remove_padding:  # the valid tokens as one packed row [1, T]; the head sees the wanted positions [1, b*R, H]
        mask = mb["attention_mask"].bool()  # [b, P+R]
        row = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        row[mask] = torch.arange(int(mask.sum()), device=mask.device)
        wanted = row[:, -resp_len - 1 : -1].clamp(min=0)  # [b, R]: positions after a response's end read row 0's
        with head_returns_logprobs(model, resp.reshape(1, -1), temperature, chunk, with_entropy, suppress):
            out = model(input_ids=mb["input_ids"][mask][None], position_ids=mb["position_ids"][mask][None], use_cache=False,
                        logits_to_keep=wanted.reshape(-1)).logits  # [1, b*R, 2]
        out = out.view(b, resp_len, 2)
    else:
        length = mb["input_ids"].shape[1]
        keep = torch.arange(length - resp_len - 1, length - 1, device=resp.device)  # [R]: the positions that predict the response
        with head_returns_logprobs(model, resp, temperature, chunk, with_entropy, suppress):
            out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=pos, use_cache=False,
                        logits_to_keep=keep, **mm).logits  # [b, R, 2]
    return out[..., 0], (out[..., 1] if with_entropy else None)


def trim_right_padding(batch: Batch, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """`keys` of right-padded rows [b, L] cut to [b, last + 1], `last` the last column any row
    attends to: the columns after it hold no token, and under causal attention cutting them changes
    no valid position's output (a batch whose last column holds tokens, e.g. left-padded, is not cut)."""
    last = int(batch["attention_mask"].any(0).nonzero().max())
    return {k: batch[k][..., : last + 1] for k in keys}  # the last dim: also M-RoPE position ids [b, 3, L]


def micro_batches(batch: Batch, size: int, max_tokens: int | None = None) -> list[Batch]:
    """Consecutive micro-batches of `size` sequences, or (max_tokens) as many consecutive sequences
    as fit `max_tokens` valid tokens (at least one each): the dynamic batch size."""
    if max_tokens is None:
        return batch.split(max(1, size))
    lengths = batch["attention_mask"].sum(-1).tolist()
    out, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and tokens + n > max_tokens:
            out.append(batch.index(slice(start, i)))
            start, tokens = i, 0
        tokens += n
    out.append(batch.index(slice(start, len(lengths))))
    return out
