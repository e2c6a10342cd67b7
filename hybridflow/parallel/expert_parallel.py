"""Expert parallelism (EP) for HF MoE blocks: experts sharded over an EP mesh dim, tokens dispatched
to the rank that owns their expert and combined back with `all_to_all_single`.

Layout (torchtitan's: EP borrows from the data-parallel ranks). A role's dp ranks form a mesh
(edp, ep) = (dp / ep, ep), ep innermost: an EP group is ep consecutive data-parallel ranks, each
seeing its own tokens. EP rank i holds experts [i * E/ep, (i+1) * E/ep) whole (HF's
`mlp.experts.gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]` cut to [E/ep, ...] before FSDP2);
FSDP2 then shards those local experts over edp (the ranks that hold the same experts), while every
other weight is FSDP2-sharded over all dp ranks as before (`parallel/layout.py`).

Forward of one MoE block on a rank (T tokens, k experts per token, H hidden):
  1. the (token, slot) assignments [T*k] are sorted by expert id, so the rows bound for each EP rank
     are contiguous, grouped by expert;
  2. the per-expert counts go out first (all_to_all of [ep, E/ep]), then the rows themselves
     (all_to_all_single of [T*k, H] with uneven splits): a rank receives, from every source, its rows
     for each of its local experts;
  3. each local expert runs HF's gated MLP on its rows;
  4. the outputs go back by the reverse all_to_all, are put back in (token, slot) order, weighted by
     the router's top-k weights on the source rank (so the router's gradient stays local) and summed
     over the k slots.
Both all-to-alls are autograd functions whose backward is the reverse all-to-all of the gradient.

Gradient scale: every rank's loss is its own tokens' share and FSDP2 averages the dense weights'
gradients over all dp ranks. An expert's gradient here already sums the contributions of the tokens
of its whole EP group (they were dispatched to it), and FSDP2 averages it over edp only, so the
expert weights' gradient is multiplied by edp / dp in the forward (`_ScaleGrad`): the result is
(1 / dp) x the sum over every rank's tokens, as for the dense weights (FSDP2 on a mesh of one rank
does not reduce, so the scale cannot live in a gradient divide factor).

Simplified: no capacity factor (no dropped tokens: every assignment is computed, as HF's blocks do);
each rank runs the same number of forwards (FSDP2 already requires it); the generation model keeps
HF's own (whole-expert) forward.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # HF v5's 3-D expert weights [E, ...]


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The `experts` child of every MoE block (a module with `gate` and `experts` children), in layer order."""
    return [m.experts for m in model.modules()
            if isinstance(getattr(m, "gate", None), nn.Module) and isinstance(getattr(m, "experts", None), nn.Module)]


def is_expert_param(name: str) -> bool:
    """Whether FQN `name` is a routed expert weight (sharded by expert under EP); a shared expert is not."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in EXPERT_PARAMS


def expert_box(num_experts: int, ep: int, ep_i: int) -> tuple[int, int]:
    """[start, stop) of the experts EP rank ep_i owns."""
    n = num_experts // ep
    return ep_i * n, (ep_i + 1) * n


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows x [N, H] with uneven splits; backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by `scale` (module doc: gradient scale)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _ep_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's experts forward (hidden [T, H], top-k ids [T, k], top-k weights [T, k] -> [T, H]) with
    the experts spread over the EP group (module doc)."""
    ep, group, n_local = self.ep_size, self.ep_group, self.num_local_experts
    T, k = top_k_index.shape
    flat = top_k_index.reshape(-1)  # [T*k] expert id of each (token, slot)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, so by destination rank
    rows = hidden_states[order // k]  # [T*k, H]
    per_expert = torch.bincount(flat, minlength=self.num_experts_total).view(ep, n_local)  # [ep, E/ep]: rows I send per expert
    recv_per_expert = torch.empty_like(per_expert)  # [ep (source), E/ep]: rows I receive per local expert
    dist.all_to_all_single(recv_per_expert, per_expert, group=group)
    send_splits, recv_splits = per_expert.sum(1).tolist(), recv_per_expert.sum(1).tolist()
    x = _AllToAll.apply(rows, recv_splits, send_splits, group)  # [R, H], by source rank, then by local expert
    local_e = torch.repeat_interleave(torch.arange(n_local, device=x.device).repeat(ep), recv_per_expert.reshape(-1))  # [R]
    gate_up, down = self.gate_up_proj, self.down_proj  # [E/ep, 2I, H], [E/ep, H, I] (unsharded by FSDP2 here)
    if self.grad_scale != 1.0:
        gate_up, down = _ScaleGrad.apply(gate_up, self.grad_scale), _ScaleGrad.apply(down, self.grad_scale)
    y = x.new_zeros(x.shape)  # [R, H]
    for e in range(n_local):
        idx = (local_e == e).nonzero(as_tuple=True)[0]
        if idx.numel() == 0:
            continue
        h = self._apply_gate(nn.functional.linear(x[idx], gate_up[e]))  # [n, I]
        y = y.index_copy(0, idx, nn.functional.linear(h, down[e]))  # [n, H]
    back = _AllToAll.apply(y, send_splits, recv_splits, group)  # [T*k, H] in `order`
    out = torch.empty_like(back).index_copy(0, order, back)  # [T*k, H] in (token, slot) order
    out = out.view(T, k, -1) * top_k_weights.to(out.dtype)[..., None]  # [T, k, H]
    return out.sum(1).to(hidden_states.dtype)


def apply_expert_parallel(model: nn.Module, ep_group: Any, ep: int, ep_i: int, dp: int, ckpt_mesh: Any = None) -> list[nn.Module]:
    """Keep EP rank ep_i's experts [E/ep, ...] of every MoE block of `model` (unsharded, before FSDP2)
    and dispatch their forward over `ep_group` (ep ranks); dp: the data-parallel ranks (the gradient
    scale, module doc); ckpt_mesh: the (ep, edp) mesh the experts are saved on (`checkpoint_views`).
    Returns the experts modules (FSDP2 shards them over edp = dp / ep)."""
    mods = expert_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__} has no MoE blocks: expert parallelism needs a mixture-of-experts model")
    for m in mods:
        total = m.gate_up_proj.shape[0]
        if total % ep:
            raise ValueError(f"{total} experts do not split over ep={ep} ranks")
        lo, hi = expert_box(total, ep, ep_i)
        for name in EXPERT_PARAMS:
            p = getattr(m, name)
            setattr(m, name, nn.Parameter(p.data[lo:hi].clone(), requires_grad=p.requires_grad))
        m.num_experts_total, m.num_local_experts, m.ep_size, m.ep_group, m.ckpt_mesh = total, hi - lo, ep, ep_group, ckpt_mesh
        m.grad_scale = (dp // ep) / dp
        if not hasattr(m, "_apply_gate"):  # HF's decorator adds it; older classes: act(gate) * up
            m._apply_gate = types.MethodType(lambda self, gu: self.act_fn(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1], m)
        m.forward = types.MethodType(_ep_forward, m)
    return mods


def gather_experts(local: torch.Tensor, ep_group: Any, ep: int) -> torch.Tensor:
    """This EP rank's experts [E/ep, ...] -> every expert [E, ...], in EP-rank order (rank i holds
    experts expert_box(E, ep, i)). A collective over the EP group."""
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(ep)]
    dist.all_gather(parts, local, group=ep_group)
    return torch.cat(parts)


def full_expert_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """{FQN: the whole [E, ...] tensor} of every routed expert weight of an EP model (after FSDP2): the
    FSDP2 gather over edp, then the EP group's experts in order. A collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    out = {}
    for prefix, m in model.named_modules():
        if getattr(m, "ep_group", None) is None:
            continue
        for name in EXPERT_PARAMS:
            p = getattr(m, name)
            out[f"{prefix}.{name}"] = gather_experts(p.full_tensor() if isinstance(p, DTensor) else p.data, m.ep_group, m.ep_size)
    return out


def checkpoint_views(model: nn.Module, *state_dicts: dict) -> list[tuple[dict, str, Any]]:
    """Point the expert entries of DCP state dicts (the model's {FQN: tensor}, the optimizer's
    {"state": {FQN: {name: tensor}}}) at views of the same local shards as [E, ...] DTensors on the
    (ep, edp) mesh, so each rank's experts have their own place in the checkpoint (as [E/ep, ...]
    every EP rank would write the same offsets). In place; returns what to put back (`restore`) before
    `set_state_dict`, which expects the FSDP2 layout. dcp.load writes through the views into the shards."""
    from torch.distributed.tensor import DTensor, Shard

    shapes = {}
    for prefix, m in model.named_modules():
        if getattr(m, "ep_group", None) is not None:
            for name in EXPERT_PARAMS:
                shapes[f"{prefix}.{name}"] = (m.num_experts_total, *getattr(m, name).shape[1:]), m.ckpt_mesh
    swapped = []

    def view(container: dict, key: str, fqn: str) -> None:
        t = container[key]
        shape, mesh = shapes[fqn]
        if isinstance(t, DTensor) and t.dim() == len(shape) and tuple(t.shape[1:]) == shape[1:]:
            local = t.to_local()
            container[key] = DTensor.from_local(local, mesh, [Shard(0), Shard(0)], run_check=False, shape=torch.Size(shape),
                                                stride=torch.empty(shape, device="meta").stride())
            swapped.append((container, key, t))

    for sd in state_dicts:
        for fqn in shapes:
            if fqn in sd:
                view(sd, fqn, fqn)
            for key in list(sd.get("state", {}).get(fqn, {})) if isinstance(sd.get("state"), dict) else ():
                view(sd["state"][fqn], key, fqn)
    return swapped


def restore(swapped: list[tuple[dict, str, Any]]) -> None:
    for container, key, t in swapped:
        container[key] = t
