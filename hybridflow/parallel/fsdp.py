"""FSDP2 (`fully_shard`) for HF models: one unit per decoder layer, then the root.

Decoder layers are found through the model's own `_no_split_modules` list (the classes HF says
must not be split across devices), so any HF causal LM works without a per-architecture table.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard


def make_mesh(device: str, world_size: int) -> DeviceMesh:
    return init_device_mesh(device, (world_size,), mesh_dim_names=("fsdp",))


SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def replicate_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The same ranks as a 2-D (world, 1) mesh ("replicate", "shard"): HSDP with shard size 1.

    `fully_shard` on it keeps the whole parameter on every rank and all-reduces gradients over
    "replicate", which is PyTorch's NO_SHARD (DDP-like) with FSDP2.
    """
    if mesh.ndim == 2 and mesh.mesh_dim_names == ("replicate", "shard") and mesh.size(1) == 1:
        return mesh
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, 1), mesh_dim_names=("replicate", "shard"))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers (no _no_split_modules); FSDP2 needs them to shard per layer")
    return layers


def apply_fsdp2(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True, offload: bool = False, sharding_strategy: str | None = None,
                mixed_precision: str | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard every decoder layer, then the root (embeddings, final norm, head) over `mesh`.

    sharding_strategy (PyTorch's meaning, with FSDP2): FULL_SHARD = `reshard_after_forward=True`
    (parameters re-gathered for backward); SHARD_GRAD_OP = `reshard_after_forward=False` (kept
    gathered between forward and backward); NO_SHARD = replication: `fully_shard` on a (world, 1)
    ("replicate", "shard") mesh, every rank holds whole parameters and gradients are all-reduced.
    None = FULL_SHARD / SHARD_GRAD_OP from `reshard_after_forward`.
    mixed_precision: None (parameters' own dtype) | "bf16" | "fp16" = compute dtype, fp32 gradient reduction.
    shard_placement_fn: param -> Shard(dim) (None = Shard(0)) for every `fully_shard` call, e.g.
    `tensor_parallel.fsdp_shard_placement_fn(model)` to shard training along the generation TP dims.
    expert_mesh: under expert parallelism, each MoE block's (already EP-cut) experts are their own
    unit over this mesh (the ranks holding the same experts), inside their layer's unit (torchtitan's).
    """
    if sharding_strategy is not None and sharding_strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"sharding_strategy must be one of {list(SHARDING_STRATEGIES)} or None, got {sharding_strategy!r}")
    if mixed_precision is not None and mixed_precision not in MIXED_PRECISION_DTYPES:
        raise ValueError(f"mixed_precision must be one of {list(MIXED_PRECISION_DTYPES)} or None, got {mixed_precision!r}")
    if sharding_strategy == "NO_SHARD":
        mesh, reshard_after_forward = replicate_mesh(mesh), False  # nothing to re-gather with shard size 1
    elif sharding_strategy is not None:
        reshard_after_forward = sharding_strategy == "FULL_SHARD"
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "shard_placement_fn": shard_placement_fn}
    if mixed_precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=MIXED_PRECISION_DTYPES[mixed_precision], reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if expert_mesh is not None:
        from hybridflow.parallel.expert_parallel import expert_modules

        for experts in expert_modules(model):
            fully_shard(experts, **dict(kwargs, mesh=expert_mesh, shard_placement_fn=None))
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def shard_numel(model: nn.Module) -> tuple[int, int]:
    """(elements this rank stores, elements of the whole model)."""
    local = total = 0
    for p in model.parameters():
        total += p.numel()
        local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return local, total
