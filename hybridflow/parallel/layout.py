"""3D training layout on the workers: the (pp, dp, tp) DeviceMesh and the model built on it.

The layout itself (sizes, rank coordinates, rules) is `parallel/dims.py::ParallelDims`; this module
adds what needs torch.distributed: the mesh, built lazily by `train_mesh` on every rank. Rank
r = (pp_i * dp + dp_i) * tp + tp_i (tp innermost), so a TP group is tp consecutive ranks and a
pipeline is the ranks that share (dp_i, tp_i).

Build order (torchtitan's): pipeline stage first (the stage keeps only its decoder layers,
`parallel/pipeline.py`), then the TP plan on the tp mesh (the generation plan's table: the same
`parallel/tensor_parallel.py` Colwise/Rowwise split; lm_head's logits come out whole, the
"gathered logits" path), then FSDP2 over the dp mesh (each TP slice sharded over dp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from hybridflow.config.schema import FSDPConfig
from hybridflow.parallel.dims import ParallelDims


@dataclass
class TrainMesh:
    """This rank's place in the training layout, and the process groups it trains with."""

    layout: ParallelDims
    pp_i: int
    dp_i: int
    tp_i: int
    mesh: DeviceMesh | None  # (pp, dp, tp); None for the plain FSDP layout (1-D mesh built by the worker)
    sp_group: object = None  # Ulysses: this rank's group of sp consecutive ranks (`parallel/ulysses.py`), None at sp 1

    @property
    def trivial(self) -> bool:
        return self.layout.trivial

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group()

    @property
    def dp_group(self):
        return None if self.mesh is None else self.mesh["dp"].get_group()


def train_mesh(layout: ParallelDims, device: str) -> TrainMesh:
    """This rank's `TrainMesh` in `layout`. Every rank calls this (building the mesh creates process groups)."""
    rank = dist.get_rank()
    if layout.world != dist.get_world_size():
        raise ValueError(f"training layout {layout.label} needs {layout.world} ranks, the group has {dist.get_world_size()}")
    pp_i, dp_i, tp_i = layout.coords(rank)
    mesh = None
    if layout.pp > 1 or layout.tp > 1:
        mesh = init_device_mesh(device, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
    from hybridflow.parallel.ulysses import sp_group

    return TrainMesh(layout, pp_i, dp_i, tp_i, mesh, sp_group(layout.sp))


def grad_norm_and_clip(params: list[nn.Parameter], max_norm: float, ranks_per_stage: int, expert_params: list[nn.Parameter] = (), ep: int = 1) -> float:
    """Global L2 gradient norm over the whole training layout (every TP x FSDP mesh and every
    pipeline stage: ONE all-reduce over the default group), then clip in place; returns the norm.

    Each rank adds the squares of its local gradient shards divided by how many ranks hold the
    same shard: within a stage (`ranks_per_stage` = tp x dp ranks) a DTensor on a mesh of M ranks
    is held by ranks_per_stage / M copies of that mesh, times the sizes of its Replicate dims; an
    expert weight under expert parallelism (`expert_params`, FSDP2 over dp / ep) by ep times fewer."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    experts = {id(p.grad) for p in expert_params} if expert_params else set()
    for g in grads:
        copies = ranks_per_stage
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            copies //= mesh.size() * (ep if id(g) in experts else 1)  # EP ranks hold other experts, not copies
            copies *= math.prod(mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
            g = g.to_local()
        total += g.float().pow(2).sum() / copies
    dist.all_reduce(total)
    norm = float(total.sqrt())
    if math.isfinite(norm) and norm > max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(coef)
    return norm


def build_train_model(model: nn.Module, dims: TrainMesh, device: str, fcfg: FSDPConfig, schedule: str = "1f1b", head=None, fused_head=None):
    """(the model as this rank trains it, its `Pipeline` or None): stage split, TP plan, then FSDP2
    over dp with `fcfg`'s settings; the plain FSDP layout is FSDP over all ranks. head: what the
    last pipeline stage returns instead of logits (`pipeline.Head`), needed when pp > 1;
    fused_head: (`pipeline.FusedHead`, chunk) computing the same from the hidden states, or None."""
    from hybridflow.parallel.fsdp import apply_fsdp2, make_mesh
    from hybridflow.parallel.pipeline import Pipeline, StageLM
    from hybridflow.parallel.tensor_parallel import apply_tensor_parallel, fsdp_shard_placement_fn

    layout = dims.layout
    if layout.pp > 1:
        if head is None:
            raise ValueError("a pipeline stage needs the head its last stage applies to the logits (build_train_model(head=...))")
        model = StageLM(model, dims.pp_i, layout.pp, head, fused_head)
    if layout.tp > 1:
        apply_tensor_parallel(model, dims.tp_mesh)
    # FSDP along the generation TP dim where the slice divides (`plan.fsdp_dim`): the switch to the
    # generation layout is then a micro-DP all-gather (FSDP layout) or moves the fewest bytes (3D).
    mesh = make_mesh(device, layout.dp) if dims.mesh is None else dims.dp_mesh
    expert_mesh = None
    if layout.ep > 1:  # experts cut to this EP rank's, FSDP2 over the ranks holding the same ones (parallel/expert_parallel.py)
        from hybridflow.parallel.expert_parallel import apply_expert_parallel

        ep_mesh = init_device_mesh(device, (layout.dp // layout.ep, layout.ep), mesh_dim_names=("edp", "ep"))
        _, ep_i = layout.ep_coords(dist.get_rank())
        ckpt_mesh = DeviceMesh(device, ep_mesh.mesh.transpose(0, 1).contiguous(), mesh_dim_names=("ep", "edp"))  # [E, ...] in checkpoints
        apply_expert_parallel(model, ep_mesh["ep"].get_group(), layout.ep, ep_i, layout.dp, ckpt_mesh)
        expert_mesh = ep_mesh["edp"]
    model = apply_fsdp2(model, mesh, fcfg.reshard_after_forward, fcfg.param_offload, shard_placement_fn=fsdp_shard_placement_fn(model, layout.dp),
                        sharding_strategy=fcfg.sharding_strategy, mixed_precision=fcfg.mixed_precision, expert_mesh=expert_mesh)
    pipe = Pipeline(model, dims.pp_i, layout.pp, dims.pp_group, device, schedule) if layout.pp > 1 else None
    return model, pipe
