"""Small tensor-box helpers shared by the weight sources and the rollout backends."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hybridflow.protocol import Box  # noqa: F401  (per dim [lo, hi) of the whole tensor; re-exported)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `t` (a plain tensor is its own piece)."""
    return t.to_local() if isinstance(t, DTensor) else t


def held_box(t: torch.Tensor) -> Box:
    """The box of the global tensor that this rank's piece of `t` covers, by `t`'s own layout
    (a DTensor's mesh coordinate and placements; a plain tensor covers all of itself)."""
    if not isinstance(t, DTensor):
        return tuple((0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple((o, o + n) for o, n in zip(offset, shape))


def crop(t: torch.Tensor, box: Box, origin: Box) -> torch.Tensor:
    """The view of `t` (which covers `origin` of the whole tensor) over `box`."""
    for d, ((lo, hi), (o, _)) in enumerate(zip(box, origin)):
        t = t.narrow(d, lo - o, hi - lo)
    return t


def held_slice(t: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of this rank's piece of `t` over `box` (of the whole tensor), by `t`'s own layout."""
    return crop(local(t), box, held_box(t))


def free_storage(p: torch.nn.Parameter) -> None:
    """Release this rank's memory of `p` (its shape stays; needs a private storage: `own_storage`)."""
    local(p.data).untyped_storage().resize_(0)


def restore_storage(p: torch.nn.Parameter) -> None:
    """Re-allocate what `free_storage` released (contents undefined until written)."""
    t = local(p.data)
    if t.untyped_storage().nbytes() == 0:
        t.untyped_storage().resize_(t.numel() * t.element_size())


def own_storage(p: torch.nn.Parameter) -> None:
    """Give a parameter a private, resizable storage (HF may load it as a view of a memory-mapped
    file), so its memory can be freed and re-allocated (`untyped_storage().resize_`)."""
    if isinstance(p, DTensor):  # its local tensor, as FSDP2 re-points its own: `p.data = ...` keeps a DTensor's old one
        p._local_tensor = p._local_tensor.clone()
    else:
        p.data = p.data.clone()
