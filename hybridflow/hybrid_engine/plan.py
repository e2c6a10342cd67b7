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

3D training layouts (the executor moves them with one exchange per layer). The layout -- pp x tp x
dp, the generation TP size and grouping, the ranks per node -- is one object, `ParallelDims`
(`parallel/dims.py`, with its rules). Rank
r = (pp_i * dp + dp_i) * tp + tp_i: PP stage pp_i owns a contiguous block of decoder layers
(embeddings on the first stage, final norm and lm_head on the last), TP shards a parameter along
its generation TP dim (the same table), FSDP then shards that TP slice over dp (along the same dim
when it divides, as `fsdp_shard_placement_fn`). A layer of another stage is an empty box. Along a
sharded dim the rank holds slice j = tp_i * dp + dp_i of M = tp * dp; generation indices follow
HybridFlow's grouping, so the training box lies inside the generation box wherever they allow
(`ParallelDims.gen_rank`): gen_tp | M -> t = j // (M / gen_tp); M | gen_tp -> t = j * c + pp_i % c
with c = gen_tp / M (the generation slice then lies inside the training slice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from hybridflow.parallel.dims import ParallelDims, gen_coords  # noqa: F401  (gen_coords re-exported)


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


def sub_box(outer: Box, dim: int | None, parts: int, index: int) -> Box:
    """Chunk `index` of `parts` of `outer` along `dim` (torch.chunk of the slice `outer` describes)."""
    if dim is None:
        return outer
    lo, hi = outer[dim]
    a, b = chunk_interval(hi - lo, parts, index)
    return outer[:dim] + ((lo + a, lo + b),) + outer[dim + 1 :]


def fsdp_dim(shape: tuple[int, ...], gen_dim: int | None, layout: ParallelDims) -> int:
    """The dim FSDP2 shards a parameter's TP slice along over dp: its generation TP dim when the
    slice divides evenly there (`tensor_parallel.fsdp_shard_placement_fn`), else dim 0."""
    dim = gen_dim or 0
    size = math.ceil(shape[dim] / layout.tp) if gen_dim is not None and layout.tp > 1 else shape[dim]
    return 0 if dim and size % layout.dp else dim


def layer_stage(layer: str, num_layers: int, pp: int) -> int:
    """The PP stage owning `layer` (a `layer_of` name): embeddings first, norm/head last."""
    if layer.startswith("layers."):
        return int(layer.split(".")[1]) // max(1, num_layers // pp)
    return 0 if layer == "embed_tokens" else pp - 1


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


def _boxes(shape, train_dim, gen_dim, stage, layout, coords, gen, gen_tp, fsdp_only, expert=False):
    """(own, need, group, aligned) of one parameter: its training and generation boxes per rank.
    expert: a routed expert weight [E, ...] under expert parallelism: EP rank dp_i % ep holds experts
    [i * E/ep, (i+1) * E/ep), FSDP2 shards those over the dp / ep ranks holding the same ones (dim 0)."""
    n = layout.world
    full = shard_box(shape, None, 1, 0)
    empty = tuple((0, 0) for _ in shape)
    own = []
    for pp_i, dp_i, tp_i in coords:
        if pp_i != stage:
            own.append(empty)
            continue
        if expert:
            own.append(sub_box(shard_box(shape, 0, layout.ep, dp_i % layout.ep), 0, layout.dp // layout.ep, dp_i // layout.ep))
            continue
        box = sub_box(full, gen_dim, layout.tp, tp_i) if layout.tp > 1 else full
        own.append(sub_box(box, train_dim, layout.dp, dp_i))
    need = [full if gen_dim is None else shard_box(shape, gen_dim, gen_tp, gen[r][0]) for r in range(n)]
    if fsdp_only:  # the executor's micro-DP groups: k consecutive ranks
        k = n // gen_tp
        group = [list(range(n))] * n if gen_dim is None else [list(range((r // k) * k, (r // k) * k + k)) for r in range(n)]
        dim = train_dim
        aligned = train_dim is not None and (gen_dim is None or gen_dim == train_dim) and all(
            need[r][dim] == (own[group[r][0]][dim][0], own[group[r][-1]][dim][1])
            and all(own[a][dim][1] == own[b][dim][0] for a, b in zip(group[r], group[r][1:]))
            and len({own[s][dim][1] - own[s][dim][0] for s in group[r]}) == 1  # equal pieces: one all-gather
            for r in range(n)
        )
    else:  # 3D layouts (the general exchange): the ranks whose training boxes overlap the need
        holders: dict[Box, list[int]] = {}
        for s, box in enumerate(own):
            if volume(box):
                holders.setdefault(box, []).append(s)
        group = [sorted({r, *(s for box, ranks in holders.items() if intersect(need[r], box) for s in ranks)}) for r in range(n)]
        aligned = False
    return own, need, group, aligned


@dataclass
class ReshardPlan:
    world_size: int
    gen_tp: int
    procs_per_node: int
    params: list[ParamPlan] = field(default_factory=list)
    _routes: dict = field(default_factory=dict, repr=False)  # routes() memo, keyed by the shared box lists
    dims: ParallelDims | None = None  # the layout it was built for (training and generation)

    @property
    def k(self) -> int:
        return self.world_size // self.gen_tp

    @classmethod
    def build(cls, shapes: dict[str, tuple[tuple[int, ...], int, int | None, int | None]], world_size: int, gen_tp: int,
              procs_per_node: int | None = None, layout: ParallelDims | None = None, consecutive: bool | None = None,
              experts: frozenset[str] | set[str] = frozenset()) -> "ReshardPlan":
        """shapes: name -> (shape, itemsize, training (FSDP) shard dim or None (replicated), generation
        shard dim or None (replicated)), in module order. `layout`: the layout over `world_size` ranks
        (None: FSDP over all of them); gen_tp, procs_per_node and consecutive (generation TP groups of
        consecutive ranks, rank r has TP index r % gen_tp: vLLM's launcher, moved by the general
        exchange; else HybridFlow's grouping) are set on it, None keeping the layout's. The layout
        checks that they fit (ValueError). experts: the routed expert weights, sharded by expert over
        the layout's ep (`_boxes`; ignored at ep 1)."""
        dims = (layout or ParallelDims(dp=world_size)).with_gen(gen_tp, consecutive, procs_per_node)
        if dims.world != world_size:
            raise ValueError(f"training layout {dims.label} has {dims.world} ranks, not {world_size}")
        plan = cls(world_size, dims.gen_tp, dims.node_size, dims=dims)
        fsdp_only = dims.trivial and not dims.consecutive
        num_layers = len({layer_of(n) for n in shapes if layer_of(n).startswith("layers.")})
        if num_layers % dims.pp:
            raise ValueError(f"{num_layers} decoder layers do not split into pp={dims.pp} equal stages")
        coords = [dims.coords(r) for r in range(world_size)]
        gen = [dims.gen_rank(r) for r in range(world_size)]
        memo: dict[tuple, tuple] = {}  # every layer of one stage has the same boxes
        for name, (shape, itemsize, train_dim, gen_dim) in shapes.items():
            shape = tuple(shape) or (1,)
            layer = layer_of(name)
            key = (shape, train_dim, gen_dim, layer_stage(layer, num_layers, dims.pp), dims.ep > 1 and name in experts)
            if key not in memo:
                memo[key] = _boxes(shape, train_dim, gen_dim, key[3], dims, coords, gen, dims.gen_tp, fsdp_only, key[4])
            own, need, group, aligned = memo[key]
            plan.params.append(ParamPlan(name, shape, itemsize, train_dim, gen_dim, layer, own, need, group, aligned))
        return plan

    # ---- per-rank volumes ----
    def min_bytes(self, r: int, skip: frozenset[str] | set[str] = frozenset()) -> int:
        """What rank r lacks of its generation slices (parameters in `skip`, e.g. frozen ones
        already synced, move nothing)."""
        return sum(p.recv_bytes(r) for p in self.params if p.name not in skip)

    def naive_bytes(self, r: int) -> int:
        return sum(p.naive_recv_bytes(r) for p in self.params)

    def gen_buffer_bytes(self, r: int) -> int:
        return sum(p.gen_bytes(r) for p in self.params)

    def model_bytes(self) -> int:
        return sum(math.prod(p.shape) * p.itemsize for p in self.params)

    def node(self, r: int) -> int:
        return r // self.procs_per_node

    def _source(self, ranks: list[int], r: int) -> int:
        near = [s for s in ranks if self.node(s) == self.node(r)] or ranks
        return min(near, key=lambda s: abs(s - r))

    def exchange(self, p: ParamPlan) -> tuple[list[list[tuple[int, Box]]], list[list[tuple[int, Box]]]]:
        """(sends, recvs): per rank, (destination, box) it sends and (source, box) it receives so
        that every rank gets exactly what it lacks of its generation box, each piece once. Training
        boxes of two ranks are identical (replicas) or disjoint; a box is fetched from one holder,
        on the rank's own node when there is one (else the nearest), none when the rank holds it."""
        key = (id(p.own), id(p.need), "exchange")
        if key not in self._routes:
            holders: dict[Box, list[int]] = {}
            for s, box in enumerate(p.own):
                if volume(box):
                    holders.setdefault(box, []).append(s)
            sends: list[list[tuple[int, Box]]] = [[] for _ in range(self.world_size)]
            recvs: list[list[tuple[int, Box]]] = [[] for _ in range(self.world_size)]
            for r in range(self.world_size):
                for box, ranks in holders.items():
                    piece = None if r in ranks else intersect(p.need[r], box)
                    if piece:
                        src = self._source(ranks, r)
                        recvs[r].append((src, piece))
                        sends[src].append((r, piece))
            self._routes[key] = (sends, recvs)
        return self._routes[key]

    def routes(self, p: ParamPlan, naive: bool = False) -> list[list[tuple[int, int]]]:
        """Per rank, (source rank, bytes) of every piece it lacks (naive: of the whole tensor).

        Training boxes of two ranks are identical (replicas) or disjoint, so each distinct box is
        fetched once, from a holder on the rank's own node when there is one (else the nearest)."""
        key = (id(p.own), id(p.need), naive)
        if key not in self._routes and not naive:
            self._routes[key] = [[(src, volume(box) * p.itemsize) for src, box in recv] for recv in self.exchange(p)[1]]
        if key not in self._routes:
            full = shard_box(p.shape, None, 1, 0)
            holders: dict[Box, list[int]] = {}
            for s, box in enumerate(p.own):
                if volume(box):
                    holders.setdefault(box, []).append(s)
            out = []
            for r in range(self.world_size):
                recv = []
                for box, ranks in holders.items():
                    v = 0 if r in ranks else volume(intersect(full, box))
                    if v:
                        recv.append((self._source(ranks, r), v * p.itemsize))
                out.append(recv)
            self._routes[key] = out
        return self._routes[key]

    def cross_node_bytes(self, naive: bool = False, skip: frozenset[str] | set[str] = frozenset()) -> int:
        """Bytes that cross a node boundary in one switch (parameters in `skip` move nothing)."""
        per_boxes: dict[tuple, int] = {}  # layers of one stage share their box lists: count each once
        total = 0
        for p in self.params:
            if p.name in skip:
                continue
            key = (id(p.own), id(p.need))
            if key not in per_boxes:
                routes = self.routes(p, naive)
                per_boxes[key] = sum(b for r, recv in enumerate(routes) for s, b in recv if self.node(s) != self.node(r)) // p.itemsize
            total += per_boxes[key] * p.itemsize
        return total

    def summary(self, frozen: frozenset[str] | set[str] = frozenset()) -> dict:
        """Per-rank volumes; `frozen` parameters move once (the first switch), 0 bytes after."""
        n = self.world_size
        per_rank = [self.min_bytes(r, frozen) for r in range(n)]
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
            "frozen_params": sorted(frozen),
            "first_switch_bytes_per_rank": [self.min_bytes(r) for r in range(n)],  # frozen ones included
        }
