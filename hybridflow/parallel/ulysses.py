"""Ulysses sequence parallelism (DeepSpeed-Ulysses, verl's `ulysses_sequence_parallel_size`).

Layout: the sp consecutive ranks of an sp group train on the SAME rows (one data-parallel rank's
micro-batch); FSDP2 still shards the parameters over every rank (dp x sp), as verl does. A
micro-batch's valid tokens are packed into one row [T] (padding removed), padded to a multiple of
sp, and each sp rank runs the model on its contiguous slice [T/sp] with the slice's FULL-sequence
position ids. Everything outside attention is per token, so only attention needs the other slices:

    q [1, H, T/sp, D], k/v [1, KV, T/sp, D]   (this rank's tokens, every head; after RoPE)
      -- all-to-all (scatter heads, gather sequence) -->
    q [1, H/sp, T, D], k/v [1, KV/sp, T, D]   (every token, this rank's heads)
      -- causal attention within each packed sequence (cu_seqlens of the whole row) -->
    o [1, H/sp, T, D]
      -- all-to-all (scatter sequence, gather heads) --> o [1, H, T/sp, D]

so sp must divide the attention and the KV heads (head h of q uses KV head h // (H/KV): the r-th
block of H/sp query heads reads exactly the r-th block of KV/sp KV heads). The attention function is
registered in transformers' attention registry (`ALL_ATTENTION_FUNCTIONS`) under `ATTN_NAME` and
the model switched to it (`install`); a forward that is not sequence-parallel (no `ulysses` kwarg)
runs transformers' own sdpa path with its mask, so the same module still works unsharded.

Log-probs (`engine/sequence_parallel.py`): each rank computes (log p(next token), entropy) at its own T/sp positions (through the
chunked head when on), then they are all-gathered to [T] (`gather_seq`) and the response positions
picked as the unsharded packed pass does; every sp rank then holds the same [b, R] and computes the
same loss. The gather's backward keeps this rank's slice of the gradient times sp: summed over the
sp ranks the parameter gradient is sp x dL/dtheta, which FSDP2's average over dp x sp ranks turns
back into the mean over the dp data ranks (verl's `Gather(grad_scaler=True)`).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ATTN_NAME = "hybridflow_ulysses"  # the attention (and mask) registry entry `install` switches a model to
KEY = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"


@dataclass(frozen=True)
class SeqShard:
    """What the attention of one sequence-parallel forward needs (passed through the model's
    kwargs, so gradient checkpointing's recompute sees it too): the sp group and the packed row's
    sequence boundaries cu_seqlens [n+1] (int64, over the padded length T)."""

    group: object
    cu_seqlens: torch.Tensor


# ---------------------------------------------------------------- collectives with autograd
def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    sp = dist.get_world_size(group)
    ins = [c.contiguous() for c in x.chunk(sp, dim=scatter_dim)]
    outs = [torch.empty_like(ins[0]) for _ in range(sp)]
    dist.all_to_all(outs, ins, group=group)
    return torch.cat(outs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """x split into sp chunks along scatter_dim, chunk j sent to rank j, received chunks
    concatenated along gather_dim; the backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, g):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(g, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _GatherSeq(torch.autograd.Function):
    """[n, ...] per rank -> [sp * n, ...] (rank order); backward: this rank's slice x sp (module doc)."""

    @staticmethod
    def forward(ctx, x, group):
        sp, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.group, ctx.sp, ctx.rank, ctx.n = group, sp, rank, x.shape[0]
        outs = [torch.empty_like(x) for _ in range(sp)]
        dist.all_gather(outs, x.contiguous(), group=group)
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, g):
        return g[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n] * ctx.sp, None


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherSeq.apply(x, group)


# ---------------------------------------------------------------- the attention
_SHARDED_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("ulysses_forward", default=False)


def _mask(*args, **kwargs):
    """The mask registry entry: none inside a sequence-parallel forward (the attention masks by
    cu_seqlens), else transformers' sdpa mask."""
    if _SHARDED_FORWARD.get():
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature: q [1, H, T/sp, D], k/v [1, KV, T/sp, D] ->
    (out [1, T/sp, H, D], None). Without a `ulysses` kwarg: transformers' sdpa attention."""
    shard: SeqShard | None = kwargs.pop("ulysses", None)
    if shard is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
    group = shard.group
    q = all_to_all(query, group, scatter_dim=1, gather_dim=2)  # [1, H/sp, T, D]
    k = all_to_all(key, group, scatter_dim=1, gather_dim=2)  # [1, KV/sp, T, D]
    v = all_to_all(value, group, scatter_dim=1, gather_dim=2)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # GQA: each KV head serves `rep` consecutive query heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    p = dropout if module.training else 0.0
    bounds = shard.cu_seqlens.tolist()
    # causal attention inside each packed sequence: no [T, T] mask is ever built
    out = torch.cat([F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], dropout_p=p, is_causal=True, scale=scaling)
                     for s, e in zip(bounds[:-1], bounds[1:]) if e > s], dim=2)  # [1, H/sp, T, D]
    out = all_to_all(out, group, scatter_dim=2, gather_dim=1)  # [1, H, T/sp, D]
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_NAME, ulysses_attention)
    AttentionMaskInterface.register(ATTN_NAME, _mask)


def install(model: nn.Module) -> nn.Module:
    """Switch an HF model (and its sub-models) to the Ulysses attention (module doc)."""
    _register()
    try:
        model.set_attn_implementation(ATTN_NAME)
    except (ValueError, AttributeError):
        model.config._attn_implementation = ATTN_NAME
    if model.config._attn_implementation != ATTN_NAME:
        raise ValueError(f"{type(model).__name__} cannot switch its attention to {ATTN_NAME} (transformers' attention registry); "
                         f"{KEY} needs a model that follows it")
    return model


@contextlib.contextmanager
def sharded_forward():
    """Around a sequence-parallel model call: the mask registry entry builds no mask inside it."""
    token = _SHARDED_FORWARD.set(True)
    try:
        yield
    finally:
        _SHARDED_FORWARD.reset(token)


# ---------------------------------------------------------------- groups and the sequence split
def sp_group(sp: int):
    """This rank's sp group (ranks [k*sp, (k+1)*sp)): every rank creates every group (a collective)."""
    if sp <= 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, sp):
        g = dist.new_group(list(range(start, start + sp)))
        if start <= rank < start + sp:
            mine = g
    return mine


def pack(mb, sp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The micro-batch's valid tokens as one row, padded to a multiple of sp: (input_ids [T],
    position_ids [T] (full-sequence, restarting per row), cu_seqlens [n+1], row [b, P+R] = packed
    position of each valid token, -1 elsewhere). The padding is a sequence of its own."""
    mask = mb["attention_mask"].bool()  # [b, P+R]
    ids, pos = mb["input_ids"][mask], mb["position_ids"][mask]  # [T0]
    lengths = mask.sum(-1)  # [b]
    t0 = ids.shape[0]
    pad = -t0 % sp
    if pad:
        ids = torch.cat([ids, ids.new_zeros(pad)])
        pos = torch.cat([pos, torch.arange(pad, dtype=pos.dtype, device=pos.device)])
        lengths = torch.cat([lengths, lengths.new_tensor([pad])])
    cu = F.pad(lengths.cumsum(0), (1, 0)).cpu()  # [n+1]
    row = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
    row[mask] = torch.arange(t0, device=mask.device)
    return ids, pos, cu, row
