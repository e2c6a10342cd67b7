"""FSDP2 (`fully_shard`) for HF models: one unit per decoder layer, then the root.

Decoder layers are found through the model's own `_no_split_modules` list (the classes HF says
must not be split across devices), so any HF causal LM works without a per-architecture table.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor


def make_mesh(device: str, world_size: int) -> DeviceMesh:
    return init_device_mesh(device, (world_size,), mesh_dim_names=("fsdp",))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers (no _no_split_modules); FSDP2 needs them to shard per layer")
    return layers


def apply_fsdp2(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True, offload: bool = False) -> nn.Module:
    """Shard every decoder layer, then the root (embeddings, final norm, head) over `mesh`."""
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (an all-gather for a sharded DTensor)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def iter_full_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) one parameter at a time: peak extra memory is one parameter."""
    for name, p in model.named_parameters():
        yield name, full_tensor(p.detach())


def shard_numel(model: nn.Module) -> tuple[int, int]:
    """(elements this rank stores, elements of the whole model)."""
    local = total = 0
    for p in model.parameters():
        total += p.numel()
        local += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
    return local, total
