"""Weight sync between disjoint pools: the trained actor (FSDP2 on N ranks) -> a generation-only
rollout pool (M ranks, gen_tp x gen_dp), used by async rollout.

The planner's boxes, with source and destination ranks disjoint: training rank s owns chunk s of N
along its FSDP2 shard dim; generation rank d needs chunk d // (M / gen_tp) of gen_tp along the
parameter's TP dim (all of it when generation replicates it). A generation rank owns nothing of
the new weights, so what it lacks is its whole slice: each training rank cuts out exactly the
pieces `intersect(own[s], need[d])`, puts one object per destination into Ray's object store
(`publish`), and each generation rank fetches only its own objects and copies every piece straight
into its parameter buffers (`PoolReceiver.reshard`). Bytes received per generation rank = the bytes
of its generation slice: the minimum. The two pools share no torch.distributed group, so the
object store (shared memory on one node, Ray's transfer across nodes) carries the pieces.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hybridflow.hybrid_engine.executor import crop, held_box, local, train_shard_dim
from hybridflow.hybrid_engine.plan import Box, intersect, layer_of, shard_box, volume
from hybridflow.hybrid_engine.trace import TraceRecorder


def need_box(shape: tuple[int, ...], gen_dim: int | None, gen_tp: int, dst_world: int, dst: int) -> Box:
    """Generation rank `dst`'s slice of a parameter (rank d has TP index d // (M / gen_tp))."""
    k = dst_world // gen_tp
    return shard_box(tuple(shape), gen_dim, gen_tp if gen_dim is not None else 1, dst // k if gen_dim is not None else 0)


@torch.no_grad()
def publish(train_model: nn.Module, gen_dims: dict[str, int | None], rank: int, world: int, gen_tp: int, dst_world: int) -> list:
    """Training rank `rank`: one object-store ref per generation rank with exactly the pieces of
    this rank's shards that it needs: {name: [(box, tensor)]} (CPU tensors)."""
    import ray

    per_dst: list[dict[str, list]] = [{} for _ in range(dst_world)]
    for name, p in train_model.named_parameters():
        dim = train_shard_dim(p)
        own, shard = shard_box(tuple(p.shape), dim, world, rank), local(p.data)
        replicated = dim is None  # every training rank holds all of it (NO_SHARD)
        for d in range(dst_world):
            if replicated and d % world != rank:  # one source per destination, spread over the ranks
                continue
            box = intersect(own, need_box(p.shape, gen_dims[name], gen_tp, dst_world, d))
            if box:
                per_dst[d].setdefault(name, []).append((box, crop(shard, box, own).detach().to("cpu", copy=True).contiguous()))
    return [ray.put(pieces) for pieces in per_dst]


def fingerprint(t: torch.Tensor) -> str:
    """A digest of the exact bytes of `t` (bit-for-bit comparison across processes)."""
    return hashlib.sha1(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@torch.no_grad()
def trained_fingerprints(train_model: nn.Module, gen_dims: dict[str, int | None], gen_tp: int, dst_world: int) -> dict[str, str]:
    """Every rank runs it (full_tensor is a collective): {"name@box": digest} of every generation
    slice of the trained weights."""
    out = {}
    for name, p in train_model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        whole = tuple((0, n) for n in full.shape)
        for d in range(dst_world):
            box = need_box(full.shape, gen_dims[name], gen_tp, dst_world, d)
            out[f"{name}@{box}"] = fingerprint(crop(full, box, whole))
    return out


class PoolReceiver:
    """The weight source of a generation-only rollout rank: pieces staged by `stage(refs)` are
    copied into the generation model's buffers by `reshard()`."""

    def __init__(self, gen_model: nn.Module, gen_dims: dict[str, int | None], gen_tp: int, rank: int, world: int):
        self.gen = dict(gen_model.named_parameters())
        self.rank, self.world, self.gen_tp = rank, world, gen_tp
        self.need = {n: need_box(p.shape, gen_dims[n], gen_tp, world, rank) for n, p in self.gen.items()}
        self.trace = TraceRecorder(rank)
        self.acquired = True  # this pool only generates: its weights stay resident
        self._refs: list = []
        self._last: dict[str, list] = {}
        self.version = 0  # policy version of the weights held (number of syncs)

    def stage(self, refs_by_src: list[list]) -> None:
        """refs_by_src[s][d]: source rank s's object for destination rank d; keep ours."""
        self._refs = [refs[self.rank] for refs in refs_by_src]

    @torch.no_grad()
    def reshard(self, optimized: bool = True) -> dict:
        import ray

        start = time.perf_counter()
        received = 0
        layers: dict[str, None] = {}
        self._last = {}
        for pieces in ray.get(self._refs):
            for name, items in pieces.items():
                layers.setdefault(layer_of(name), None)
                buf = local(self.gen[name].data)
                for box, t in items:
                    with self.trace.span(f"copy {layer_of(name)}", "copy"):
                        crop(buf, box, self.need[name]).copy_(t)
                    received += volume(box) * t.element_size()
                    self._last.setdefault(name, []).append((box, t))
        covered = {n: sum(volume(b) for b, _ in self._last.get(n, [])) for n in self.gen}
        short = [n for n in self.gen if covered[n] != volume(self.need[n])]
        if short:
            raise RuntimeError(f"cross-pool weight sync: pieces do not cover the generation slices of {short[:3]}")
        self._refs = []
        self.version += 1
        return {"seconds": time.perf_counter() - start, "bytes_received": received, "peak_extra_bytes": 0,
                "layers": list(layers), "optimized": True, "version": self.version}

    @torch.no_grad()
    def max_abs_diff(self) -> float:
        """max |generation buffer - the published trained pieces| (0.0 = bit-exact)."""
        worst = 0.0
        for name, items in self._last.items():
            buf = local(self.gen[name].data)
            for box, t in items:
                got = crop(buf, box, self.need[name])
                if not torch.equal(got.cpu(), t):
                    worst = max(worst, float((got.cpu() - t).abs().max()))
        return worst

    def fingerprints(self) -> dict[str, str]:
        """Keyed by the slice each parameter holds by its own DTensor layout (`held_box`), not by
        the plan's boxes: compared with the trainer's fingerprints of those slices, a wrong box fails."""
        return {f"{n}@{held_box(p.data)}": fingerprint(local(p.data)) for n, p in self.gen.items()}

    def release(self) -> None:
        pass  # nothing to free: a generation-only pool keeps its weights between syncs
