"""The resharding planner: what every rank holds, needs, sends and receives, per parameter.

Layouts (N ranks, gen_tp dividing N, k = N // gen_tp):
- training: FSDP2 shards parameter p along dim d(p) -- the dim generation TP shards it along
  (`fsdp_shard_placement_fn`), dim 0 for parameters that generation replicates (and for a
  row-parallel weight whose dim 1 does not divide by N: FSDP2 cannot shard that unevenly). Rank r
  holds torch.chunk slice r of N along d (the last chunks may be short or empty).
- generation: rank r has TP index t = r // k and DP index r % k. A TP-sharded parameter needs
  torch.chunk slice t of gen_tp along its TP dim (what DTensor's Shard holds); a replicated one
  needs all of it.

Holdings and needs are boxes (an interval per dim), so a rank's need minus what it already holds
is exactly what it must receive: `min_bytes`. When the sizes divide evenly, slice t of gen_tp is the union of the
training slices of ranks t*k .. t*k+k-1 (the *micro-DP group*), so one all-gather inside that
group delivers it (`aligned`); the executor falls back to a general exchange otherwise. The naive
baseline (gather the full tensor, then slice) receives size - own on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

Interval = tuple[int, int]  # [start, stop) along one dim
Box = tuple[Interval, ...]  # one interval per dim


def chunk_interval(size: int, parts: int, index: int) -> Interval:
    """torch.chunk semantics (FSDP2 and DTensor Shard): chunks of ceil(size/parts), the last short."""
    c = math.ceil(size / parts) if size else 0
    start = min(index * c, size)
    return start, min(start + c, size)


def overlap(a: Interval, b: Interval) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x[0], y[0]), min(x[1], y[1])) for x, y in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def volume(box: Box | None) -> int:
    return math.prod(hi - lo for lo, hi in box) if box else 0


def shard_box(shape: tuple[int, ...], dim: int | None, parts: int, index: int) -> Box:
    """The box of chunk `index` of `parts` along `dim` (dim None: the whole tensor)."""
    return tuple(chunk_interval(n, parts, index) if d == dim else (0, n) for d, n in enumerate(shape))


def layer_of(name: str) -> str:
    """"model.layers.3.mlp.up_proj.weight" -> "layers.3"; "model.embed_tokens.weight" -> "embed_tokens"."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        return f"layers.{parts[i + 1]}"
    return parts[-2] if len(parts) >= 2 else parts[0]


@dataclass
class ParamPlan:
    name: str
    shape: tuple[int, ...]
    itemsize: int
    train_dim: int | None  # FSDP2's shard dim; None = every rank holds all of it (NO_SHARD)
    gen_dim: int | None  # generation TP shard dim; None = replicated
    layer: str
    own: list[Box]  # per rank, training
    need: list[Box]  # per rank, generation
    group: list[list[int]]  # per rank, the ranks whose training shards make up its need
    aligned: bool  # need == the group's shards concatenated along one dim, equal pieces

    @property
    def tp_sharded(self) -> bool:
        return self.gen_dim is not None

    def recv_bytes(self, r: int) -> int:
        return (volume(self.need[r]) - volume(intersect(self.need[r], self.own[r]))) * self.itemsize

    def naive_recv_bytes(self, r: int) -> int:
        return (math.prod(self.shape) - volume(self.own[r])) * self.itemsize

    def gen_bytes(self, r: int) -> int:
        return volume(self.need[r]) * self.itemsize

    @cached_property
    def moves(self) -> bool:
        """Whether any rank needs anything from another (False: local copies only)."""
        return any(self.recv_bytes(r) for r in range(len(self.need)))

    def transfers(self) -> list[tuple[int, int, Box]]:
        """(src, dst, box) for every piece that crosses ranks."""
        out = []
        for dst, n in enumerate(self.need):
            for src, o in enumerate(self.own):
                box = intersect(n, o) if src != dst else None
                if box:
                    out.append((src, dst, box))
        return out


@dataclass
class ReshardPlan:
    world_size: int
    gen_tp: int
    procs_per_node: int
    params: list[ParamPlan] = field(default_factory=list)

    @property
    def k(self) -> int:
        return self.world_size // self.gen_tp

    @classmethod
    def build(cls, shapes: dict[str, tuple[tuple[int, ...], int, int | None, int | None]], world_size: int, gen_tp: int, procs_per_node: int | None = None) -> "ReshardPlan":
        """shapes: name -> (shape, itemsize, training shard dim or None (replicated), generation
        shard dim or None (replicated)), in module order."""
        if gen_tp < 1 or world_size % gen_tp:
            raise ValueError(f"gen_tp={gen_tp} must divide the world size {world_size}")
        plan = cls(world_size, gen_tp, procs_per_node or world_size)
        k = world_size // gen_tp
        for name, (shape, itemsize, train_dim, gen_dim) in shapes.items():
            shape = tuple(shape) or (1,)
            own = [shard_box(shape, train_dim, world_size, r) for r in range(world_size)]
            if gen_dim is None:
                need = [shard_box(shape, None, 1, 0)] * world_size
                group = [list(range(world_size))] * world_size
            else:
                need = [shard_box(shape, gen_dim, gen_tp, r // k) for r in range(world_size)]
                group = [list(range((r // k) * k, (r // k) * k + k)) for r in range(world_size)]
            dim = train_dim
            aligned = train_dim is not None and (gen_dim is None or gen_dim == train_dim) and all(
                need[r][dim] == (own[group[r][0]][dim][0], own[group[r][-1]][dim][1])
                and all(own[a][dim][1] == own[b][dim][0] for a, b in zip(group[r], group[r][1:]))
                and len({own[s][dim][1] - own[s][dim][0] for s in group[r]}) == 1  # equal pieces: one all-gather
                for r in range(world_size)
            )
            plan.params.append(ParamPlan(name, shape, itemsize, train_dim, gen_dim, layer_of(name), own, need, group, aligned))
        return plan

    # ---- per-rank volumes ----
    def min_bytes(self, r: int) -> int:
        return sum(p.recv_bytes(r) for p in self.params)

    def naive_bytes(self, r: int) -> int:
        return sum(p.naive_recv_bytes(r) for p in self.params)

    def gen_buffer_bytes(self, r: int) -> int:
        return sum(p.gen_bytes(r) for p in self.params)

    def model_bytes(self) -> int:
        return sum(math.prod(p.shape) * p.itemsize for p in self.params)

    def node(self, r: int) -> int:
        return r // self.procs_per_node

    def cross_node_bytes(self) -> int:
        return sum(volume(box) * p.itemsize for p in self.params for s, d, box in p.transfers() if self.node(s) != self.node(d))

    def summary(self) -> dict:
        n = self.world_size
        per_rank = [self.min_bytes(r) for r in range(n)]
        naive = [self.naive_bytes(r) for r in range(n)]
        return {
            "world_size": n,
            "gen_tp": self.gen_tp,
            "gen_dp": self.k,
            "model_bytes": self.model_bytes(),
            "bytes_per_rank": per_rank,
            "total_bytes": sum(per_rank),
            "min_bytes_per_rank": per_rank,  # what each rank lacks of its generation slices
            "naive_bytes_per_rank": naive,
            "naive_total_bytes": sum(naive),
            "gen_buffer_bytes_per_rank": [self.gen_buffer_bytes(r) for r in range(n)],
            "cross_node_bytes": self.cross_node_bytes(),
            "aligned_params": sum(p.aligned for p in self.params),
            "unaligned_params": [p.name for p in self.params if not p.aligned],
        }
