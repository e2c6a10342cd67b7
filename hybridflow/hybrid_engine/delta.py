"""Delta weight sync for the cross-pool sync (async rollout): send what changed since the last sync.

Between two syncs an update moves every fp32 weight a little, but in bf16 most of those moves round
away: the generation slice a sender publishes (cast to the generation dtype) is mostly the same
bits as last time. Per piece (one parameter's slice for one generation rank) the sender compares
the new bits with the piece it sent last and ships the cheaper of:

    ("sparse", index int32 [k], value [k], crc)   the k changed elements
    ("full", tensor, crc)                          the whole piece (most of it changed, or no base)

every `full_every` syncs all of them full (a safeguard). `crc` is CRC-32 of the *new* piece's
bytes, computed from the trainer's tensor, not from the delta. The receiver keeps a mirror of the
slices it holds, applies the delta to it and checks the CRC of the result: a mismatch (a corrupted
delta, a receiver that missed a sync: a restarted replica) is repaired from the whole piece, which
every sync also puts in the object store and which moves only when fetched (`repairs` counts them).
The backend then takes the mirror's slices like any full sync's pieces.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def crc(t: torch.Tensor) -> int:
    """CRC-32 of the exact bytes of `t` (contiguous; a device tensor is copied to the host first)."""
    return zlib.crc32(t.view(torch.uint8).cpu().numpy())


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bit patterns, flat: equality of these is bit-for-bit equality (0.0 vs -0.0, NaNs)."""
    return t.reshape(-1).view(INT_VIEW[t.element_size()])


def encode(new: torch.Tensor, last: torch.Tensor | None, force_full: bool) -> tuple[tuple, int]:
    """(payload, changed elements) of a piece; the payload is the cheaper of sparse and full."""
    checksum = crc(new)
    if last is None or force_full or last.shape != new.shape:
        return ("full", new, checksum), new.numel()
    changed = (bits(new) != bits(last)).nonzero().flatten()
    k = changed.numel()
    if k * (4 + new.element_size()) >= new.numel() * new.element_size():
        return ("full", new, checksum), k
    return ("sparse", changed.to(torch.int32), new.reshape(-1)[changed].clone(), checksum), k


def payload_bytes(payload: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in payload[1:3] if isinstance(t, torch.Tensor))


def apply(payload: tuple, base: torch.Tensor | None) -> torch.Tensor | None:
    """The piece a payload rebuilds on `base` (the receiver's mirror), or None when its CRC does not
    match (or a sparse payload has no base): then the whole piece is fetched instead."""
    kind, checksum = payload[0], payload[-1]
    if kind == "full":
        out = payload[1].clone()
    elif base is None:
        return None
    else:
        out = base.clone()
        out.view(-1)[payload[1].long()] = payload[2]
    return out if crc(out) == checksum else None


@dataclass
class DeltaSender:
    """A training rank's memory of what it sent: (destination, name, box) -> the piece."""

    full_every: int = 10
    syncs: int = 0
    last: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def next_sync(self) -> bool:
        """Start a sync; True when it is a periodic full one (the first is full: nothing was sent)."""
        full = self.full_every > 0 and self.syncs % self.full_every == 0
        self.syncs += 1
        return full


@dataclass
class DeltaStats:
    """One receiver's sync: elements changed, bytes a full sync would have sent, bytes this one
    fetched (deltas and repairs), repaired pieces."""

    changed: int = 0
    elements: int = 0
    full_bytes: int = 0
    sent_bytes: int = 0
    repairs: int = 0
    repaired: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"delta_changed": self.changed, "delta_elements": self.elements, "delta_full_bytes": self.full_bytes,
                "delta_sent_bytes": self.sent_bytes, "delta_repairs": self.repairs, "delta_repaired": self.repaired[:8]}
