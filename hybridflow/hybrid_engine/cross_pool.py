"""Weight sync between disjoint pools: the trained actor (FSDP2 on N ranks) -> a generation-only
rollout pool (M ranks, gen_tp x gen_dp), used by async rollout.

The planner's boxes, with source and destination ranks disjoint: training rank s owns chunk s of N
along its FSDP2 shard dim; generation rank d needs chunk d // (M / gen_tp) of gen_tp along the
parameter's TP dim (all of it when generation replicates it). A generation rank owns nothing of
the new weights, so what it lacks is its whole slice: each training rank cuts out exactly the
pieces `intersect(own[s], need[d])`, puts one object per destination into Ray's object store
(`publish`), and each generation rank fetches only its own objects and hands them to its rollout
backend as `WeightPiece`s (`PoolReceiver.pieces`), which copies them into its parameters. Bytes received per generation rank = the bytes
of its generation slice: the minimum. The two pools share no torch.distributed group, so the
object store (shared memory on one node, Ray's transfer across nodes) carries the pieces.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hybridflow.hybrid_engine.delta import DeltaSender, DeltaStats, apply, bits, encode, payload_bytes
from hybridflow.hybrid_engine.executor import train_shard_dim
from hybridflow.hybrid_engine.plan import Box, intersect, layer_of, shard_box, volume
from hybridflow.hybrid_engine.trace import TraceRecorder
from hybridflow.parallel.dtensor import crop, held_box, held_slice, local
from hybridflow.protocol import WeightPiece


def need_box(shape: tuple[int, ...], gen_dim: int | None, gen_tp: int, dst_world: int, dst: int) -> Box:
    """Generation rank `dst`'s slice of a parameter (rank d has TP index d // (M / gen_tp))."""
    k = dst_world // gen_tp
    return shard_box(tuple(shape), gen_dim, gen_tp if gen_dim is not None else 1, dst // k if gen_dim is not None else 0)


@torch.no_grad()
def publish(train_model: nn.Module, gen_dims: dict[str, int | None], rank: int, world: int, gen_tp: int, dst_world: int,
            dtype: torch.dtype | None = None, delta: DeltaSender | None = None) -> list:
    """Training rank `rank`: one object-store ref per generation rank with exactly the pieces of
    this rank's shards that it needs: {name: (whole shape, [(box, tensor)])} (CPU tensors, in the
    generation dtype `dtype`, None = the training one: bf16 generation ships half the bytes).
    With `delta` (delta.py): {"delta": {name: (shape, [(box, payload)])}, "full": {name: ref of the
    whole pieces}}, the whole pieces fetched only to repair."""
    import ray

    per_dst: list[dict[str, tuple]] = [{} for _ in range(dst_world)]
    for name, p in train_model.named_parameters():
        dim = train_shard_dim(p)
        own, shard = shard_box(tuple(p.shape), dim, world, rank), local(p.data)
        replicated = dim is None  # every training rank holds all of it (NO_SHARD)
        for d in range(dst_world):
            if replicated and d % world != rank:  # one source per destination, spread over the ranks
                continue
            box = intersect(own, need_box(p.shape, gen_dims[name], gen_tp, dst_world, d))
            if box:
                piece = crop(shard, box, own).detach().to("cpu", dtype=dtype or shard.dtype, copy=True).contiguous()
                per_dst[d].setdefault(name, (tuple(p.shape), []))[1].append((box, piece))
    if delta is None:
        return [ray.put(pieces) for pieces in per_dst]
    full = delta.next_sync()
    out = []
    for d, pieces in enumerate(per_dst):
        encoded = {}
        for name, (shape, items) in pieces.items():
            encoded[name] = (shape, [(box, encode(t, delta.last.get((d, name, box)), full)[0]) for box, t in items])
            delta.last.update({(d, name, box): t for box, t in items})
        out.append(ray.put({"delta": encoded, "full": {name: ray.put(whole) for name, whole in pieces.items()}}))
    return out


def whole_pieces(pieces) -> list[WeightPiece]:
    """The pieces of each parameter (one per training rank that held some of it) joined into one
    whole piece per parameter: for a backend that owns and repacks its weights (vLLM), whose loaders
    take a parameter once and whole. Holds the whole generation slice once (what the backend needs)."""
    parts: dict[str, list[WeightPiece]] = {}
    for piece in pieces:
        parts.setdefault(piece.name, []).append(piece)
    out = []
    for name, items in parts.items():
        shape, full = items[0].shape, tuple((0, n) for n in items[0].shape)
        if len(items) == 1 and items[0].box == full:
            out.append(items[0])
            continue
        whole = torch.empty(shape, dtype=items[0].tensor.dtype)
        for piece in items:
            crop(whole, piece.box, full).copy_(piece.tensor)
        out.append(WeightPiece(name, shape, full, whole, items[0].static))
    return out


def fingerprint(t: torch.Tensor) -> str:
    """A digest of the exact bytes of `t` (bit-for-bit comparison across processes)."""
    return hashlib.sha1(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@torch.no_grad()
def trained_fingerprints(train_model: nn.Module, gen_dims: dict[str, int | None], gen_tp: int, dst_world: int,
                         dtype: torch.dtype | None = None) -> dict[str, str]:
    """Every rank runs it (full_tensor is a collective): {"name@box": digest} of every generation
    slice of the trained weights (cast to the generation dtype `dtype`, as `publish` ships them)."""
    out = {}
    for name, p in train_model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        full = full if dtype is None else full.to(dtype)
        whole = tuple((0, n) for n in full.shape)
        for d in range(dst_world):
            box = need_box(full.shape, gen_dims[name], gen_tp, dst_world, d)
            out[f"{name}@{box}"] = fingerprint(crop(full, box, whole))
    return out


def generation_fingerprints(params: dict[str, nn.Parameter]) -> dict[str, str]:
    """{"name@box": digest} of a generation model's parameters, keyed by the slice each holds by
    its own DTensor layout (`held_box`), not by the plan's boxes: compared with the trainer's
    fingerprints of those slices (`trained_fingerprints`), a wrong box fails."""
    return {f"{n}@{held_box(p.data)}": fingerprint(local(p.data)) for n, p in params.items()}


@torch.no_grad()
def max_piece_diff(params: dict[str, nn.Parameter], pieces: list[WeightPiece]) -> float:
    """max |parameter slice - piece| over the pieces pushed last (0.0: every piece is in place)."""
    worst = 0.0
    for piece in pieces:
        got = held_slice(params[piece.name].data, piece.box).cpu()
        if not torch.equal(got, piece.tensor):
            worst = max(worst, float((got - piece.tensor).abs().max()))
    return worst


class PoolReceiver:
    """The weight source of a generation-only rollout rank: the pieces staged by `stage(refs)`,
    fetched and streamed by `pieces()` (each a `WeightPiece` for the rollout backend)."""

    def __init__(self, gen_shapes: dict[str, tuple[int, ...]], gen_dims: dict[str, int | None], gen_tp: int, rank: int, world: int):
        self.rank, self.world, self.gen_tp = rank, world, gen_tp
        self.need = {n: need_box(shape, gen_dims[n], gen_tp, world, rank) for n, shape in gen_shapes.items()}
        self.trace = TraceRecorder(rank)
        self._refs: list = []
        self.last_pieces: list[WeightPiece] = []
        self.last_stats: dict = {}
        self.version = 0  # policy version of the weights held (number of syncs)
        self.mirror: dict[tuple, torch.Tensor] = {}  # delta sync: (name, box) -> the slice held (what deltas apply to)

    def stage(self, refs_by_src: list[list]) -> None:
        """refs_by_src[s][d]: source rank s's object for destination rank d; keep ours."""
        self._refs = [refs[self.rank] for refs in refs_by_src]

    def pieces(self):
        """Fetch this rank's objects and yield their pieces; checks that they cover every
        generation slice once the stream is consumed (stats in `last_stats`)."""
        import ray

        start = time.perf_counter()
        received = 0
        layers: dict[str, None] = {}
        self.last_pieces = []
        delta = None
        for objs in ray.get(self._refs):
            if "delta" in objs:  # delta sync: rebuild each piece on the mirror, check it, repair from the whole one
                delta = delta or DeltaStats()
                stream = self._deltas(objs, delta)
            else:
                stream = ((name, shape, box, t) for name, (shape, items) in objs.items() for box, t in items)
            for name, shape, box, t in stream:
                layers.setdefault(layer_of(name), None)
                piece = WeightPiece(name, shape, box, t)
                with self.trace.span(f"copy {layer_of(name)}", "copy"):
                    yield piece
                received += t.numel() * t.element_size()  # the tensor that arrived, not its box
                self.last_pieces.append(piece)
        covered = {n: 0 for n in self.need}
        for piece in self.last_pieces:
            covered[piece.name] += volume(piece.box)
        short = [n for n in self.need if covered[n] != volume(self.need[n])]
        if short:
            raise RuntimeError(f"cross-pool weight sync: pieces do not cover the generation slices of {short[:3]}")
        self._refs = []
        self.version += 1
        self.last_stats = {"seconds": time.perf_counter() - start, "bytes_received": received, "peak_extra_bytes": 0,
                           "layers": list(layers), "optimized": True, "version": self.version}
        if delta is not None:
            self.last_stats.update(delta.as_dict(), bytes_received=delta.sent_bytes)

    def _deltas(self, objs: dict, stats: DeltaStats):
        """(name, shape, box, slice) of one source's delta object, each rebuilt on the mirror and
        CRC-checked; a piece that fails (or has no base) comes whole from the source's full object."""
        import ray

        wholes: dict[str, dict] = {}
        for name, (shape, items) in objs["delta"].items():
            for box, payload in items:
                base = self.mirror.get((name, box))
                new = apply(payload, base)
                stats.sent_bytes += payload_bytes(payload)
                if new is None:  # corrupted in transit, or nothing to apply it to: the whole piece
                    if name not in wholes:
                        wholes[name] = dict(ray.get(objs["full"][name])[1])
                    new = wholes[name][box].clone()
                    stats.sent_bytes += new.numel() * new.element_size()
                    stats.repairs += 1
                    stats.repaired.append(name)
                stats.elements += new.numel()
                stats.full_bytes += new.numel() * new.element_size()
                stats.changed += new.numel() if base is None else int((bits(new) != bits(base)).sum())
                self.mirror[(name, box)] = new
                yield name, shape, box, new
