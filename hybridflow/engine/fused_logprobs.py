"""Token log-probs and entropy from the last hidden states, without the `[tokens, vocab]` logits.

The plain pass (`algorithms/losses.py`) projects every response position onto the vocabulary and
keeps the fp32 logits `[b, R, V]`, their log-softmax and (entropy) softmax and product alive at
once: ~3 x b x R x V x 4 bytes (16 x 1,024 tokens of a 49,152-token vocabulary: 9.7 GB). Here the
hidden states `[N, H]` go through the LM head `[V, H]` `chunk` tokens at a time; per chunk only
`[chunk, V]` logits exist, reduced at once to what is kept per token: log p(target), the entropy
and the log-sum-exp (saved for backward). Backward recomputes each chunk's logits from the saved
hidden states and weight (one more `[chunk, H] x [H, V]` matmul per chunk) and accumulates the
gradients of the hidden states and of the weight (fp32 accumulator, cast once at the end).

Per chunk, z = (h @ W^T).float() / T (the plain pass's own ops: `F.linear` in the weight's dtype,
then fp32, then the temperature), lse = logsumexp(z), p = exp(z - lse):
    log p(t) = z_t - lse                 d/dz = onehot(t) - p
    H        = lse - sum_k p_k z_k       d/dz = -p * (z - (lse - H))
so dL/dz = g_lp * onehot(t) - p * (g_lp + g_H * (z - lse + H)), and dL/dh = (dL/dz / T) @ W,
dL/dW = (dL/dz / T)^T @ h. Tied embeddings need nothing special: the weight is the embedding's
parameter and autograd adds this gradient to the lookup's.

Maintained kernels looked at first: torch 2.13's `F.linear_cross_entropy(..., options=...)` chunks
the same product but returns only the cross-entropy (no entropy, no temperature) and precomputes its
gradient inside forward (outside the autograd contract, by its own docs); Liger's fused linear
cross-entropy and SkyRL's are Triton (GPU only). So this is a small torch function that runs on
every device.

Under tensor parallelism a vocab-sharded LM head (`ColwiseParallel`, untied) is gathered whole
(`[V, H]`, differentiable: its gradient comes back as this rank's slice) instead of gathering the
`[N, V]` logits the plain pass all-gathers: fewer bytes whenever a micro-batch has more response
tokens than the model has hidden units.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger(__name__)

DEFAULT_CHUNK = 1024  # tokens per chunk: [1024, 49152] fp32 logits = 192 MiB


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float, suppress: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits [c, V] of hidden states h [c, H] under weight [V, H], divided by the temperature,
    with the plain pass's ops (F.linear in the weight's dtype, .float(), / T); the `suppress` columns
    (token ids [k], a VLM's vision tokens) -inf in the `rows` [c] (bool) that `_suppressed_rows` picks, as
    `models/vlm_inputs.py::suppress_logits` sets them."""
    z = F.linear(h, weight).float()
    z = z / temperature if temperature != 1.0 else z
    if suppress is not None:
        z[:, suppress] = z[:, suppress].masked_fill(rows[:, None], float("-inf"))  # [c, k]
    return z


def _suppressed_rows(targets: torch.Tensor, suppress: torch.Tensor | None) -> torch.Tensor | None:
    """[c] bool: the positions whose logits get the suppressed columns -inf: all but those whose target is itself suppressed
    (a tool's image token, mask 0: its log-prob stays finite; `suppress_logits`)."""
    return None if suppress is None else ~torch.isin(targets, suppress)


class ChunkedLogProbs(torch.autograd.Function):
    """(log p(targets) [N], entropy [N]) fp32 of hidden [N, H] under weight [V, H]; see the module doc."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, chunk: int,
                with_entropy: bool, suppress: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        ent = torch.zeros(n, dtype=torch.float32, device=hidden.device)  # [N] (zeros when not asked)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N], saved for backward
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _chunk_logits(hidden[s:e], weight, temperature, suppress, _suppressed_rows(targets[s:e], suppress))  # [c, V]
            lse_c = torch.logsumexp(z, dim=-1)  # [c]
            lse[s:e] = lse_c
            logp[s:e] = z.gather(-1, targets[s:e, None]).squeeze(-1) - lse_c
            if with_entropy:
                z.sub_(lse_c[:, None])  # z - lse = log p, in place: [c, V]
                p = z.exp()
                if suppress is not None:  # p = 0 there; 0 * -inf would be nan
                    z.masked_fill_(z.isneginf(), 0.0)
                ent[s:e] = -(p * z).sum(-1)  # H = -sum p log p
            del z
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.suppress = temperature, chunk, with_entropy, suppress
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        use_ent = ctx.with_entropy and g_ent is not None
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        # [V, H]: one chunk's product directly in the weight's dtype (a bf16 matmul accumulates in fp32 and rounds once, as
        # the cast of an fp32 accumulator would; on a CPU with AMX it runs ~10x faster than upcasting both operands);
        # several chunks sum into an fp32 accumulator.
        single = 0 < n <= chunk
        grad_w = None if single or not need_w else torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]  # [c, H]
            rows = _suppressed_rows(targets[s:e], ctx.suppress)  # [c] or None
            z = _chunk_logits(h, weight, T, ctx.suppress, rows)  # [c, V], recomputed
            lse_c = lse[s:e, None]  # [c, 1]
            p = (z - lse_c).exp_()  # [c, V]
            gl = g_lp[s:e, None] if g_lp is not None else torch.zeros_like(lse_c)  # [c, 1]
            if use_ent:
                # dz = -p * (g_lp + g_H * (z - lse + H)), then + g_lp at the target
                z.sub_(lse_c - ent[s:e, None]).mul_(g_ent[s:e, None]).add_(gl)  # [c, V]
                dz = p.mul_(z).neg_()
            else:
                dz = p.mul_(gl).neg_()  # [c, V]
            del z
            if ctx.suppress is not None:  # constants (-inf) in forward: no gradient (p * inf above is nan there)
                dz[:, ctx.suppress] = dz[:, ctx.suppress].masked_fill(rows[:, None], 0.0)
            dz.scatter_add_(-1, targets[s:e, None], gl)
            if T != 1.0:
                dz.div_(T)
            dz = dz.to(weight.dtype)
            if need_h:
                grad_h[s:e] = dz @ weight  # [c, H]
            if need_w and single:
                grad_w = dz.t() @ h  # [V, H]
            elif need_w:
                grad_w.addmm_(dz.t().float() if dz.dtype != torch.float32 else dz.t(), h.float() if h.dtype != torch.float32 else h)  # [V, H]
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                     chunk: int = DEFAULT_CHUNK, with_entropy: bool = True, suppress: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets), entropy) fp32 [...] of hidden [..., H] under the LM head weight [V, H] and
    targets [...]; entropy is zeros unless with_entropy. At most [chunk, V] logits at once.
    suppress: token ids left out of the softmax (logits -inf; a VLM's vision tokens)."""
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    ids = torch.tensor(list(suppress), dtype=torch.long, device=hidden.device) if suppress else None  # [k]
    lp, ent = ChunkedLogProbs.apply(h, weight, targets.reshape(-1).long(), float(temperature), max(1, int(chunk)), with_entropy, ids)
    return lp.view(lead), ent.view(lead)


def _whole_weight(weight: torch.Tensor) -> torch.Tensor:
    """The full [V, H] head weight as a plain tensor: a DTensor (vocab-sharded under TP) is gathered
    (differentiable: its gradient returns as this rank's slice)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(weight, DTensor):
        return weight.redistribute(placements=[Replicate()] * weight.device_mesh.ndim).to_local()
    return weight


def token_head(hidden: torch.Tensor, head: nn.Linear, targets: torch.Tensor, temperature: float, chunk: int,
               with_entropy: bool = True, suppress: Sequence[int] = ()) -> torch.Tensor:
    """(log-prob, entropy) [b, T, 2] of targets [b, T] from the last hidden states [b, T, H] (after the
    final norm) and the LM head `head`: what the plain pass's `token_head(logits, targets)` returns."""
    from torch.distributed.tensor import DTensor

    if isinstance(hidden, DTensor):  # a TP input hook made it a replicated DTensor
        hidden = hidden.to_local()
    lp, ent = chunked_logprobs(hidden, _whole_weight(head.weight), targets, temperature, chunk, with_entropy, suppress)
    return torch.stack([lp, ent], dim=-1)


_warned: set[str] = set()


def fused_head_problem(model: nn.Module) -> str | None:
    """Why the chunked pass cannot stand in for `model`'s LM head (None: it can): it needs an HF
    causal LM whose logits are exactly lm_head(hidden) (a bias-free Linear, no logit soft-capping)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return f"{type(model).__name__} has no Linear LM head"
    if head.bias is not None:
        return "the LM head has a bias"
    cfg = getattr(model, "config", None)
    if getattr(cfg, "final_logit_softcapping", None):
        return "the model soft-caps its logits"
    return None


def warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("chunked log-probs off: %s; the plain [tokens, vocab] logits pass runs instead", reason)


@contextlib.contextmanager
def head_returns_logprobs(model: nn.Module, targets: torch.Tensor, temperature: float, chunk: int, with_entropy: bool,
                          suppress: Sequence[int] = ()) -> Iterator[None]:
    """Within the block, `model`'s LM head returns (log-prob, entropy) [b, K, 2] of `targets` [b, K]
    for the hidden states [b, K, H] it is given, instead of logits [b, K, V]. The head is replaced
    inside the model's own forward, where FSDP2 has gathered its weight (and reduce-scatters its
    gradient in backward); a TP head's hooks still wrap the call (DTensor in, DTensor out)."""
    from torch.distributed.tensor import DTensor, Replicate

    head = model.get_output_embeddings()

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # hidden [b, K, H]
        mesh = hidden.device_mesh if isinstance(hidden, DTensor) else None
        out = token_head(hidden, head, targets, temperature, chunk, with_entropy, suppress)  # [b, K, 2]
        return DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False) if mesh is not None else out

    saved = head.__dict__.get("forward")  # an instance-level forward someone else set (None: the class's)
    head.forward = forward
    try:
        yield
    finally:
        if saved is None:
            del head.forward
        else:
            head.forward = saved
