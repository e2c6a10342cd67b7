"""The executor: training layout (FSDP2 shards) -> generation layout (TP slices), every step.

Per parameter (see plan.py for the layouts):
- aligned, shard dim 0: ONE all-gather inside the micro-DP group, straight into the generation
  buffer. The rank's own shard lands in its place inside that buffer; nothing else is allocated.
- aligned, shard dim 1 (row-parallel o_proj / down_proj): the same all-gather into a reusable
  staging buffer ([k, out, c]), then one strided copy into the buffer ([out, k*c]).
- not aligned (sizes that do not divide evenly): one all_to_all over the world in which every
  rank sends exactly the pieces of its shard that others need and receives exactly what it lacks.
The naive baseline (`optimized=False`) gathers every full parameter over all ranks, then slices.

Generation buffers are the generation model's parameter storages: `release()` frees them after
rollout (unless `keep_generation_buffers`) and `acquire()` re-allocates them before the next
reshard. A generation slice that IS this rank's training shard (the same box, dtype and device: at
gen_tp = N every TP-sharded weight, whose FSDP2 shard dim is its TP dim) is not copied at all: the
generation parameter is pointed at the training shard's storage (`borrowed`), so the optimizer's
in-place step updates it and the switch moves and copies nothing for it; every switch re-checks the
pointer (a `load_state_dict(assign=True)` may have replaced the shard) and nothing frees it.

Layer granularity coalesces each switch unit's aligned parameters into one all-gather per process
group (flat send/receive slices of a W-slot staging buffer) and keeps units i+1 .. i+W-1's gathers
in flight while unit i is copied into place: W = 2 by default, or what `resharding_buffer_percent`
allows. A unit is a layer, or consecutive layers that stage less than 1 MiB together, so small
layers do not pay a round trip each (`staging.switch_units`). On gloo (CPU) each such gather travels
as point-to-point messages instead, one per parameter and peer, from the training shard straight to
its place in the generation slice (`_launch_direct`; the same bytes): gloo's all-gather copies
everything into a flat buffer of its own and out again, which cost more than the wire. The training shards are never touched, so the
reverse switch (generation -> training) moves nothing.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hybridflow.config.schema import HybridEngineConfig
from hybridflow.hybrid_engine.delta import bits, crc
from hybridflow.utils.memory import PeakMemory, allocation_bytes
from hybridflow.hybrid_engine.plan import ParamPlan, ReshardPlan, fsdp_dim, intersect, volume
from hybridflow.hybrid_engine.staging import MIN_UNIT_BYTES, staging_numel, staging_plan, switch_units
from hybridflow.hybrid_engine.trace import TraceRecorder
from hybridflow.parallel.dims import ParallelDims
from hybridflow.parallel.dtensor import crop, free_storage, held_box, local, own_storage, restore_storage  # noqa: F401  (crop, held_box re-exported)
from hybridflow.parallel.expert_parallel import expert_modules, gather_experts, is_expert_param
from hybridflow.protocol import WeightPiece

logger = logging.getLogger("hybridflow")

# torch 2.13 renamed all_gather_into_tensor (same semantics); keep older releases working.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _piece(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `t`: `dtensor.local` without DTensor's dispatch (the switch asks for
    hundreds per step; the same storage either way)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _received(recv: torch.Tensor, own: torch.Tensor) -> int:
    """Bytes a gather brought in, counted from the tensors handed to it (not from the plan): its
    receive buffer minus the rank's own contribution, which was already there."""
    return (recv.numel() - own.numel()) * recv.element_size()


def train_shard_dim(p: torch.Tensor) -> int | None:
    """The dim FSDP2 shards `p` along, None when every rank holds all of it: a Shard placement over
    a mesh dim of size > 1 (NO_SHARD is HSDP with shard size 1)."""
    if not isinstance(p, DTensor):
        return None
    shard = [pl.dim for i, pl in enumerate(p.placements) if pl.is_shard() and p.device_mesh.size(i) > 1]
    return shard[0] if shard else None


def build_plan(train_model: nn.Module, gen_shard_dims: dict[str, int | None], dims: ParallelDims,
               full_shapes: dict[str, tuple[tuple[int, ...], int]] | None = None, itemsize: int | None = None) -> ReshardPlan:
    """The plan for this FSDP2 model in the layout `dims` (training and generation), with each
    parameter's training shard dim as FSDP2 placed it. itemsize: bytes per element on the wire (the
    generation dtype's; None = the training parameters' own).

    3D layouts (pp or tp > 1): `full_shapes` = {FQN: (shape, itemsize)} of the WHOLE model in module
    order (a pipeline stage holds only some of it); FSDP2 shards every TP slice over dp along
    `plan.fsdp_dim` (`parallel/layout.py` places it there)."""
    if not dims.trivial:
        shapes = {n: (shape, itemsize or size, fsdp_dim(shape, gen_shard_dims[n], dims), gen_shard_dims[n]) for n, (shape, size) in full_shapes.items()}
    else:
        shapes = {n: (tuple(p.shape), itemsize or p.element_size(), train_shard_dim(p), gen_shard_dims[n]) for n, p in train_model.named_parameters()}
    experts = frozenset(n for n in shapes if is_expert_param(n)) if dims.ep > 1 else frozenset()  # sharded by expert over ep
    return ReshardPlan.build(shapes, dist.get_world_size(), dims.gen_tp, layout=dims, experts=experts)


class HybridEngine:
    # gloo point-to-point (`_launch_direct`): dim-0 pieces of at least this many elements travel as
    # messages of their own, straight into place; smaller ones and row-parallel ones share one.
    DIRECT_MIN_NUMEL = 1 << 14
    def __init__(self, train_model: nn.Module, gen_model: nn.Module | dict | None, gen_shard_dims: dict[str, int | None], gen_tp: int, cfg: HybridEngineConfig,
                 device: str, procs_per_node: int | None = None, layout: ParallelDims | None = None, full_shapes: dict | None = None,
                 consecutive: bool | None = None, dtype: torch.dtype | None = None, min_unit_bytes: int = MIN_UNIT_BYTES):
        """gen_model: the generation model, or its {name: parameter} (the backend's own storages: the
        switch writes there in place), or None: the engine keeps this rank's generation slices in
        buffers of its own and `pieces()` hands them to the backend. dtype: the generation weights'
        dtype (None = the training parameters'): bf16 generation from fp32 training shards casts each
        shard once before it is sent, so the switch moves half the bytes. layout: the `ParallelDims` of
        the group (None = FSDP over it), with gen_tp, procs_per_node and consecutive (generation TP
        groups of consecutive ranks, vLLM's launcher, instead of HybridFlow's strided grouping) set
        on it, None keeping the layout's; full_shapes: see `build_plan`; min_unit_bytes: smaller
        consecutive layers share a collective (`staging.switch_units`; 0: one unit per layer)."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.layout = (layout or ParallelDims(dp=self.world)).with_gen(gen_tp, consecutive, procs_per_node)
        self.cfg = cfg
        self.device = device
        self.train_model = train_model
        self.train = self._sharded_params()
        # Expert parallelism: the EP group the experts are spread over (None at ep 1), for whole-tensor gathers (`_full`).
        self.ep_group = next((m.ep_group for m in expert_modules(train_model) if hasattr(m, "ep_group")), None) if self.layout.ep > 1 else None
        dtypes = {p.dtype for p in self.train.values()}
        if len(dtypes) != 1:
            raise ValueError(f"the hybrid engine expects one parameter dtype, found {dtypes}")
        self.train_dtype = dtypes.pop()
        self.dtype = dtype or self.train_dtype  # every buffer and message of the switch is in this dtype
        self.plan = build_plan(train_model, gen_shard_dims, self.layout, full_shapes, torch.empty(0, dtype=self.dtype).element_size())
        if gen_model is None:  # staged: this rank's generation slice of every parameter
            self.gen = {p.name: nn.Parameter(torch.empty([hi - lo for lo, hi in p.need[self.rank]], dtype=self.dtype, device=device), requires_grad=False)
                        for p in self.plan.params}
        else:
            self.gen = dict(gen_model) if isinstance(gen_model, dict) else dict(gen_model.named_parameters())
            wrong = {n: p.dtype for n, p in self.gen.items() if p.dtype != self.dtype}
            if wrong:
                raise ValueError(f"generation parameters must be {self.dtype} (the switch's dtype), found {wrong}")
        self.staged = gen_model is None
        for p in self.gen.values():
            own_storage(p)
        # Generation slices that are this rank's training shard: borrowed, never copied (module doc).
        r = self.rank
        self.borrowed = frozenset() if self.dtype != self.train_dtype else frozenset(
            p.name for p in self.plan.params if p.own[r] == p.need[r] and volume(p.own[r]) and p.name in self.train)
        self._borrow()
        k = self.plan.k
        # gloo (CPU): each coalesced gather is sent as point-to-point messages straight into the
        # generation slices (`_launch_direct`); NCCL's all-gather writes into its output itself.
        self.p2p = dist.get_backend() == "gloo"
        self.world_group = dist.distributed_c10d._get_default_group()
        # Every rank creates every micro-DP group, in the same order (a torch.distributed rule).
        self.micro_group = None
        for t in range(gen_tp):
            ranks = list(range(t * k, t * k + k))
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.micro_group = group
        # Frozen training parameters never change: after the first switch their generation slices
        # stay allocated and are skipped (0 bytes), by the optimized path.
        self.frozen = frozenset(n for n, p in self.train.items() if not p.requires_grad)
        self.frozen_synced = False
        self.trace = TraceRecorder(self.rank)
        self.last_stats: dict = {}  # the last switch's measured stats (`pieces()`; WeightSource)
        self.acquired = True
        # The reusable staging buffer: `slots` slots of the largest unit's staging need (a unit: one
        # layer, or consecutive small ones merged, `staging.switch_units`), so layer granularity never
        # allocates. Units i+1 .. i+slots-1 gather into their slots while unit i is copied out of
        # its own: 2 by default, or what resharding_buffer_percent allows (the same on every rank;
        # staging.py, whose `note` says what was used).
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        per_layer = {}
        for p in self.plan.params:
            per_layer[p.layer] = per_layer.get(p.layer, 0) + self._staging_numel(p)
        self.units = switch_units(self.plan, cfg.granularity, min_unit_bytes)
        self.staging_plan = staging_plan(self.plan, cfg.resharding_buffer_percent, cfg.granularity, cfg.enable_resharding_opt, min_unit_bytes)
        self.slots = self.staging_plan.slots
        self.slot_numel = max([1, *(sum(per_layer[layer] for layer in unit) for unit in self.units)])
        self.layer_staging_bytes = (self.slots * self.slot_numel if cfg.granularity == "layer" else max(per_layer.values())) * itemsize
        self.gen_allocation_bytes = sum(allocation_bytes(p.gen_bytes(self.rank), device) for p in self.plan.params if p.name not in self.borrowed)
        # Only layer granularity uses it; full granularity allocates its temporaries per switch.
        size = self.slots * self.slot_numel if cfg.granularity == "layer" else 1
        self.staging = torch.empty(size, dtype=self.dtype, device=device)
        self.staging_bytes = size * itemsize if cfg.granularity == "layer" else 0
        # Delta sync (cfg.delta_sync, layer granularity): per coalesced gather, a mirror of what the
        # group holds ([size * c], the last sync's gathered shards; this rank's row is what it sent
        # last), the base every delta applies to; see `_launch_delta`.
        self.delta = bool(cfg.delta_sync) and cfg.granularity == "layer"
        self.mirrors: dict[tuple, torch.Tensor] = {}
        self.delta_units: dict[tuple, tuple[list[ParamPlan], bool]] = {}  # key -> (params, tp_sharded), for repairs
        self.delta_syncs = 0
        self.delta_full = False  # this switch sends every gather whole (the first, and every delta_full_every-th)
        self.delta_stats: dict = {}

    def _sharded_params(self) -> dict[str, nn.Parameter]:
        """The training parameters in their sharded form. FSDP2 leaves the unsharded ones registered
        after a forward without backward when it does not reshard after forward (SHARD_GRAD_OP,
        NO_SHARD): reshard every FSDP module first."""
        for m in self.train_model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        return dict(self.train_model.named_parameters())

    # ------------------------------------------------------------------ buffers
    def _borrow(self) -> None:
        """Point every borrowed generation parameter at this rank's training shard (a no-op when it
        already is: one pointer compare per parameter)."""
        for name in self.borrowed:
            train, g = _piece(self.train[name]), self.gen[name]
            gen = _piece(g)
            if gen.device != train.device or gen.shape != train.shape:
                raise ValueError(f"{name}: the generation slice {tuple(gen.shape)} on {gen.device} is not the training shard "
                                 f"{tuple(train.shape)} on {train.device} the plan says it is")
            if gen.data_ptr() == train.data_ptr() and gen.stride() == train.stride():
                continue
            if isinstance(g, DTensor):  # its local tensor, as FSDP2 re-points its own (`.data =` keeps a DTensor's old one)
                g._local_tensor = train
            else:
                g.data = train

    def gen_buffers(self) -> list[torch.Tensor]:
        """The generation slices this engine holds (not the borrowed ones: those are training shards)."""
        return [local(p.data) for name, p in self.gen.items() if name not in self.borrowed]

    def release(self) -> int:
        """After rollout: the generation weights are stale until the next reshard. Their buffers are
        freed unless `keep_generation_buffers` (then the next reshard writes into the same pages: no
        re-allocation, no page faults). Moves nothing: returns bytes moved (0)."""
        if not self.cfg.keep_generation_buffers:
            for name, p in self.gen.items():
                # frozen slices stay (they never change); borrowed ones are the training shards
                if name not in self.borrowed and (name not in self.frozen or not self.frozen_synced):
                    free_storage(p)
        self.acquired = False
        return 0

    def acquire(self) -> None:
        for name, p in self.gen.items():
            if name not in self.borrowed:
                restore_storage(p)
        self.acquired = True

    # ------------------------------------------------------------------ staging
    def _staging_numel(self, p: ParamPlan) -> int:
        return staging_numel(self.plan, p, self.rank, self.cfg.granularity)

    def _take(self, numel: int, pool: list[int]) -> torch.Tensor:
        """A staging slice: from the reusable buffer (layer mode) or a fresh tensor (full mode)."""
        if self.cfg.granularity == "layer":
            start = pool[0]
            pool[0] += numel
            return self.staging[start : start + numel]
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ one parameter
    def _aligned(self, p: ParamPlan, train: torch.Tensor, gen: torch.Tensor, pool: list[int], copies: list) -> int:
        group = self.micro_group if p.tp_sharded else None
        size = len(p.group[self.rank])
        if size == 1:
            copies.append((gen, train))
            return 0
        if p.train_dim == 0:
            recv = gen  # straight into the buffer
        else:  # row-parallel weight [out, c] per rank -> gen [out, size*c]
            out_rows, c = train.shape
            stage = self._take(size * train.numel(), pool)
            recv = stage.view(size * out_rows, c)
            copies.append((gen.view(out_rows, size, c), stage.view(size, out_rows, c).transpose(0, 1)))
        if train.dtype == self.dtype:
            send = train.contiguous()
        else:  # cast into this rank's own slot of the receive buffer: an in-place gather, no temporary
            send = recv.view(size, -1)[p.group[self.rank].index(self.rank)].view(train.shape).copy_(train)
        _all_gather(recv, send, group=group)
        return _received(recv, send)

    def _launch_layer(self, params: list[ParamPlan], base: int) -> tuple[list, int]:
        """Start the layer's collectives into the staging slot at `base`: one coalesced all-gather
        per process group for its aligned, moving parameters (their shards packed into one flat
        send slice, gathered asynchronously into a flat receive slice after it), and one coalesced
        all_to_all for the others (`_launch_exchange`). Returns (pending, next offset)."""
        r = self.rank
        by_group: dict[bool, list[ParamPlan]] = {}
        pending, offset = [], base
        for p in params:
            if p.moves and p.aligned and len(p.group[r]) > 1:
                by_group.setdefault(p.tp_sharded, []).append(p)
        for tp_sharded, ps in by_group.items():
            size, c = len(ps[0].group[r]), sum(volume(p.own[r]) for p in ps)
            send, recv = self.staging[offset : offset + c], self.staging[offset + c : offset + (1 + size) * c]
            offset += (1 + size) * c
            if self.p2p and not self.delta:
                pending.append(self._launch_direct(ps, size, c, send, recv, tp_sharded))
                continue
            self._pack(ps, send)
            if self.delta:
                pending.append(self._launch_delta(ps, tp_sharded, size, c, send))
                continue
            work = _all_gather(recv, send, group=self.micro_group if tp_sharded else None, async_op=True)
            pending.append(("gather", (ps, size, c, recv, send), work))
        pool = [offset]
        exchange = self._launch_exchange([p for p in params if p.moves and not p.aligned], pool)
        return pending + exchange, pool[0]

    def _launch_direct(self, ps: list[ParamPlan], size: int, c: int, send: torch.Tensor, recv: torch.Tensor, tp_sharded: bool) -> tuple:
        """gloo: the coalesced gather as point-to-point messages, the large dim-0 pieces straight
        into the generation slices. gloo's all-gather gathers into a flat buffer of its own
        (relayed around a ring) and copies every piece out of it; a send / recv pair moves a tensor
        between two processes' own memories with no copy on either side, but each message costs a
        round of gloo's bookkeeping. So per peer of the group: one message per large dim-0
        parameter (>= DIRECT_MIN_NUMEL elements per piece), from the training shard to its piece j
        (from group rank j), the contiguous rows j of the generation slice [size * rows, cols]; and
        ONE message for the rest (row-parallel weights, whose piece is a strided column block of
        [out, size * cols] and takes a copy anyway, biases, norms), packed into `send` [c] and
        received into `recv` [size * c] (slot j), copied into place once it arrived
        (`_finish_layer`). The rank's own pieces are copied now, while the others arrive. Messages
        between two ranks pair up in posting order: every rank posts, per peer in group order, its
        sends then its receives, each in plan order with the packed one last. A direct shard that
        is not contiguous, or not in the generation dtype, is cast / copied into `send` first.
        Returns the pending entry (bytes received: the receive tensors' sizes; staged copies; works)."""
        r = self.rank
        group = ps[0].group[r]  # the group's ranks in group-rank order (consecutive, or all)
        me, pg = group.index(r), (self.micro_group if tp_sharded else None) or self.world_group
        direct, packed, offset = [], [], 0  # (shard [own shape], its generation pieces: size x [own shape])
        for p in ps:
            train = _piece(self.train[p.name])
            d = p.train_dim
            pieces = _piece(self.gen[p.name]).unflatten(d, (size, train.shape[d])).unbind(d)
            if d == 0 and train.numel() >= self.DIRECT_MIN_NUMEL:
                if train.dtype != self.dtype or not train.is_contiguous():
                    train = send[offset : offset + train.numel()].view(train.shape).copy_(train)
                    offset += train.numel()
                direct.append((train, pieces))
            else:
                packed.append((train, pieces))
        cp = sum(t.numel() for t, _ in packed)
        flat = send[offset : offset + cp]
        if packed:
            torch.cat([t.reshape(-1) for t, _ in packed], out=flat)
        works, staged, received, slot = [], [], 0, 0
        for j in range(size):  # the process group's own send / recv (group ranks, tag 0): no per-call checks
            if j == me:
                continue
            works += [pg.send([t], j, 0) for t, _ in direct]
            if packed:
                works.append(pg.send([flat], j, 0))
            for _, pieces in direct:
                works.append(pg.recv([pieces[j]], j, 0))
                received += pieces[j].numel() * pieces[j].element_size()
            if packed:
                buf = recv[slot * cp : (slot + 1) * cp]
                slot += 1
                works.append(pg.recv([buf], j, 0))
                received += buf.numel() * buf.element_size()
                at = 0
                for t, pieces in packed:
                    staged.append((pieces[j], buf[at : at + t.numel()].view(t.shape)))
                    at += t.numel()
        for t, pieces in direct + packed:
            pieces[me].copy_(t)
        return ("p2p", (received, staged), works)

    def _pack(self, ps: list[ParamPlan], out: torch.Tensor) -> torch.Tensor:
        """This rank's shards of `ps`, flat and in order, into `out` (cast to its dtype): what one
        coalesced gather sends."""
        return torch.cat([_piece(self.train[p.name].data).reshape(-1) for p in ps], out=out)

    # ------------------------------------------------------------------ delta sync
    def _launch_delta(self, ps: list[ParamPlan], tp_sharded: bool, size: int, c: int, send: torch.Tensor) -> tuple:
        """One coalesced gather as a delta: this rank's packed shards `send` [c] against its row of
        the mirror (what it sent last), the changed elements as int32 index + value pairs. One small
        all-gather of (changed count, CRC-32 of `send`) per rank first, so every rank knows every
        payload's size and makes the same choice: the payloads (padded to the largest) when the
        largest costs less than the whole shards, else the whole shards, gathered straight into the
        mirror (also the first sync and every delta_full_every-th). `_finish_layer` applies them."""
        key = (tuple(p.name for p in ps), tp_sharded)  # the composition: frozen parameters drop out after the first switch
        group = self.micro_group if tp_sharded else None
        self.delta_units.setdefault(key, (ps, tp_sharded))
        mirror = self.mirrors.get(key)
        me = ps[0].group[self.rank].index(self.rank)
        s = send.element_size()
        st = self.delta_stats
        st["delta_elements"] += size * c
        st["delta_full_bytes"] += (size - 1) * c * s
        changed = None if mirror is None or self.delta_full else (bits(send) != bits(mirror.view(size, c)[me])).nonzero().flatten()
        meta = torch.tensor([-1 if changed is None else changed.numel(), crc(send)], dtype=torch.int64, device=self.device)
        metas = torch.empty(2 * size, dtype=torch.int64, device=self.device)
        _all_gather(metas, meta, group=group)
        metas = metas.view(size, 2)
        ks = metas[:, 0].tolist()
        if min(ks) < 0 or max(ks) * (4 + s) >= c * s:  # a rank has no base (or must send whole), or a delta costs more: whole
            if mirror is None:
                mirror = self.mirrors[key] = torch.empty(size * c, dtype=self.dtype, device=self.device)
            st["delta_changed"] += size * c
            st["delta_sent_bytes"] += (size - 1) * c * s
            return ("gather", (ps, size, c, mirror, send), _all_gather(mirror, send, group=group, async_op=True))
        k = max(ks)
        payload = torch.zeros(k * (4 + s), dtype=torch.uint8, device=self.device)
        payload[: 4 * changed.numel()] = changed.to(torch.int32).view(torch.uint8)
        payload[4 * k : 4 * k + s * changed.numel()] = send[changed].view(torch.uint8)
        received = torch.empty(size * payload.numel(), dtype=torch.uint8, device=self.device)
        st["delta_changed"] += sum(ks)
        st["delta_sent_bytes"] += (size - 1) * payload.numel()
        work = _all_gather(received, payload, group=group, async_op=True) if k else None
        return ("delta", (ps, size, c, mirror, send, received, ks, metas[:, 1].tolist(), k, key), work)

    def _apply_delta(self, item: tuple) -> tuple[torch.Tensor, int]:
        """Rebuild the group's shards on the mirror from the gathered payloads; a row whose CRC-32
        is not its sender's marks the unit for repair (`_repair`). Returns (mirror as [size, c],
        bytes received)."""
        ps, size, c, mirror, send, received, ks, crcs, k, key = item
        s, me = send.element_size(), ps[0].group[self.rank].index(self.rank)
        rows, flat = received.view(size, -1), mirror.view(size, c)
        for j in range(size):
            if j == me:
                flat[j].copy_(send)
                continue
            if ks[j]:  # .clone(): an aligned copy before the dtype view (a row may start at any byte)
                idx = rows[j, : 4 * ks[j]].clone().view(torch.int32).long()
                flat[j][idx] = rows[j, 4 * k : 4 * k + s * ks[j]].clone().view(self.dtype)
            if crc(flat[j]) != crcs[j]:
                self.delta_bad.add(key)
        return flat, (size - 1) * (k * (4 + s)) + (size - 1) * 16

    def _repair(self) -> int:
        """After the switch: every rank learns which units failed a checksum anywhere (one
        all-reduce), and those are gathered whole into the mirror and copied into place. Returns
        bytes received."""
        keys = sorted(self.delta_units)
        flags = torch.tensor([float(k in self.delta_bad) for k in keys], device=self.device)
        if keys:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        received, names = 0, []
        for key, bad in zip(keys, flags.tolist()):
            if not bad:
                continue
            ps, tp_sharded = self.delta_units[key]
            size, c = len(ps[0].group[self.rank]), sum(volume(p.own[self.rank]) for p in ps)
            send = self._pack(ps, torch.empty(c, dtype=self.dtype, device=self.device))
            mirror = self.mirrors[key]
            _all_gather(mirror, send, group=self.micro_group if tp_sharded else None)
            self._copy_out(ps, size, c, mirror.view(size, c))
            received += _received(mirror, send)
            names.append(ps[0].layer)
        self.delta_stats["delta_repairs"] = len(names)
        self.delta_stats["delta_repaired"] = names
        return received

    def _launch_exchange(self, ps: list[ParamPlan], pool: list[int]) -> list:
        """General case, ONE all_to_all for every parameter in `ps` (the same list on every rank):
        every rank sends exactly what others lack and receives what it lacks, each piece from one
        holder (`plan.exchange`: replicas across TP or PP groups send it once), packed in (rank,
        parameter) order into staging slices (`_take`). Returns the pending exchange ([] if none)."""
        if not ps:
            return []
        r, world = self.rank, self.world
        routes = [self.plan.exchange(p) for p in ps]
        send_to = [dict(sends[r]) for sends, _ in routes]
        recv_from = [dict(recvs[r]) for _, recvs in routes]
        send_sizes = [sum(volume(d.get(dst)) for d in send_to) for dst in range(world)]
        recv_sizes = [sum(volume(d.get(src)) for d in recv_from) for src in range(world)]
        send, recv = self._take(sum(send_sizes), pool), self._take(sum(recv_sizes), pool)
        pieces = [crop(self._train_local(p), d[dst], p.own[r]).reshape(-1) for dst in range(world) for p, d in zip(ps, send_to) if dst in d]
        if pieces:
            torch.cat(pieces, out=send)
        work = dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, async_op=True)
        layout = [(p, d[src]) for src in range(world) for p, d in zip(ps, recv_from) if src in d]
        return [("exchange", (ps, layout, recv), work)]

    def _exchange_copies(self, item: tuple, copies: list) -> int:
        """(destination, source) copies of a finished exchange: the received pieces at their boxes,
        the rank's own part next to them. Returns bytes received: the size of the receive buffer
        handed to all_to_all."""
        ps, layout, recv = item
        r, offset = self.rank, 0
        for p, box in layout:
            n = volume(box)
            copies.append((crop(local(self.gen[p.name].data), box, p.need[r]), recv[offset : offset + n].view([hi - lo for lo, hi in box])))
            offset += n
        for p in ps:
            mine = intersect(p.own[r], p.need[r])
            if mine and p.name not in self.borrowed:
                copies.append((crop(local(self.gen[p.name].data), mine, p.need[r]), crop(self._train_local(p), mine, p.own[r])))
        return recv.numel() * recv.element_size()

    def _finish_layer(self, pending: list) -> int:
        """Wait for the layer's collectives and copy every piece into its generation buffer: an
        all-gather's piece j of every parameter came from group rank j and lands at slot j of its
        shard dim; an exchange's pieces land at their boxes, next to the rank's own part."""
        received = 0
        for kind, item, work in pending:
            if work is not None and kind != "p2p":  # None: a delta whose every payload is empty (nothing changed in the unit)
                work.wait()
            if kind == "exchange":
                copies: list = []
                received += self._exchange_copies(item, copies)
                for dst, src in copies:
                    dst.copy_(src)
                continue
            if kind == "p2p":  # `_launch_direct`: every piece in place but the row-parallel ones staged
                for w in work:
                    w.wait()
                received += item[0]
                for dst, src in item[1]:
                    dst.copy_(src)
                continue
            if kind == "delta":
                flat, nbytes = self._apply_delta(item)
                received += nbytes
                self._copy_out(item[0], item[1], item[2], flat)
                continue
            ps, size, c, recv, send = item
            received += _received(recv, send)
            self._copy_out(ps, size, c, recv.view(size, c))
        return received

    def _copy_out(self, ps: list[ParamPlan], size: int, c: int, flat: torch.Tensor) -> None:
        """A coalesced gather's [size, c] rows into the generation buffers: piece j of every
        parameter came from group rank j and lands at slot j of its shard dim."""
        offset = 0
        for p in ps:
            shape = tuple(hi - lo for lo, hi in p.own[self.rank])
            n, d = math.prod(shape), p.train_dim
            gen = local(self.gen[p.name].data)
            gen.unflatten(d, (size, shape[d])).copy_(flat[:, offset : offset + n].unflatten(1, shape).movedim(0, d))
            offset += n

    def _train_local(self, p: ParamPlan) -> torch.Tensor | None:
        """This rank's training shard of `p` (None: a pipeline stage that does not hold it)."""
        t = self.train.get(p.name)
        return None if t is None else _piece(t.data)

    def _full(self, p: ParamPlan) -> torch.Tensor:
        """The whole trained tensor on every rank (a collective): DTensor's gather over the owning
        ranks' mesh, then, with pipeline stages, a broadcast from the owning stage's first rank."""
        t = self.train.get(p.name)
        if t is not None and t.dtype != self.dtype:
            t = t.detach().to(self.dtype)  # cast the shard, then gather: the wire carries the generation dtype
        full = None if t is None else (t.full_tensor() if isinstance(t, DTensor) else t.data)
        if self.ep_group is not None and is_expert_param(p.name):  # full_tensor() has this EP rank's experts: gather the others
            full = gather_experts(full, self.ep_group, self.layout.ep)
        if self.layout.pp == 1:
            return full
        src = next(r for r in range(self.world) if volume(p.own[r]))
        full = full.contiguous() if full is not None else torch.empty(p.shape, dtype=self.dtype, device=self.device)
        dist.broadcast(full, src)
        return full

    def _naive(self, p: ParamPlan, gen: torch.Tensor, copies: list, keep: list) -> int:
        full = self._full(p)
        keep.append(full)  # full granularity holds every gathered tensor until the copies
        copies.append((gen, crop(full, p.need[self.rank], tuple((0, n) for n in full.shape))))
        own = self._train_local(p)  # what this rank held before the gather (None: another stage's)
        return (full.numel() - own.numel()) * full.element_size() if own is not None else full.numel() * full.element_size()

    # ------------------------------------------------------------------ the switch
    @torch.no_grad()
    def reshard(self, optimized: bool = True) -> dict:
        """Training -> generation layout. Returns measured seconds, bytes received, peak extra memory.
        Bytes received are counted from the tensors handed to the collectives (receive buffers less
        the rank's own contribution; the naive path: the gathered tensors less the rank's shard), not
        from the plan, so comparing them with `plan.min_bytes` checks the plan against the wire."""
        start = time.perf_counter()
        self.train = self._sharded_params()
        self._borrow()
        received, in_flight = 0, 0
        skip = self.frozen if optimized and self.frozen_synced else frozenset()
        by_layer = self._by_layer(skip)
        layers = list(by_layer)
        with PeakMemory(self.device) as mem:  # includes (re-)allocating the generation buffers
            self.acquire()
            copies: list = []
            keep: list = []
            if optimized and self.cfg.granularity == "layer":
                self._start_delta()
                received, in_flight = self._reshard_layers(self._by_unit(skip), optimized)
                if self.delta:
                    received += self._repair()
                by_layer = {}
            for layer, params in by_layer.items():
                pool = [0]  # staging offset, reset per layer
                with self.trace.span(f"gather {layer}", "gather", optimized=optimized):
                    for p in params:
                        train, gen = self._train_local(p), local(self.gen[p.name].data)
                        if p.name in self.borrowed:  # gen IS train: nothing to write
                            if not optimized:
                                received += self._naive(p, gen, [], keep)  # the baseline still gathers it (a collective)
                            continue
                        if not optimized:
                            received += self._naive(p, gen, copies, keep)
                        elif not p.moves:  # e.g. gen_tp = N, or replicated training weights
                            copies.append((gen, crop(train, p.need[self.rank], p.own[self.rank])))
                        elif p.aligned:
                            received += self._aligned(p, train, gen, pool, copies)
                        else:  # full granularity: its own all_to_all, copied with the others at the end
                            ((_, item, work),) = self._launch_exchange([p], pool)
                            work.wait()
                            received += self._exchange_copies(item, copies)
                if self.cfg.granularity == "layer":
                    with self.trace.span(f"copy {layer}", "copy"):
                        for dst, src in copies:
                            dst.copy_(src)
                    copies.clear()
                    keep.clear()
            if copies:  # full granularity: every copy after every collective
                with self.trace.span("copy all", "copy"):
                    for dst, src in copies:
                        dst.copy_(src)
            copies.clear()
            keep.clear()
        self.frozen_synced = True
        delta = dict(self.delta_stats) if self.delta and optimized and self.cfg.granularity == "layer" else {}
        return {
            **delta,  # delta sync: delta_changed / delta_elements / delta_full_bytes / delta_sent_bytes / delta_repairs
            "seconds": time.perf_counter() - start,
            "layers": layers,
            "skipped_params": len(skip),
            "skipped_bytes": self.plan.min_bytes(self.rank) - self.plan.min_bytes(self.rank, skip),
            "bytes_received": received,
            "peak_extra_bytes": mem.extra_bytes,
            # Theory: the generation slices themselves, plus (optimized) the staging slots (layer
            # granularity) or one layer's temporaries (full), or (naive) the full tensors gathered at
            # once: one layer's, or the whole model's.
            "theory_extra_bytes": self.gen_allocation_bytes + (self.layer_staging_bytes if optimized else self._naive_transient_bytes())
            + sum(m.numel() * m.element_size() for m in self.mirrors.values()),  # delta sync's mirrors (kept)
            "optimized": optimized,
            # Layer granularity, optimized: the most layers whose collectives were in flight at once
            # (the staging slots, unless fewer layers move), in a staging buffer of staging_bytes.
            "layers_in_flight": in_flight,
            "staging_bytes": self.staging_bytes if optimized and self.cfg.granularity == "layer" else 0,
        }

    def pieces(self, optimized: bool = True) -> "Iterator[WeightPiece]":
        """The weight stream for this rank's rollout backend: runs the switch (`reshard`; its
        measured stats in `self.last_stats`), then yields one piece per parameter: its generation
        slice (the plan's box). In place (the backend's own storages) the pieces alias them; staged,
        the engine's own buffers are freed once the backend has taken every piece."""
        self.last_stats = self.reshard(optimized=optimized)
        for p in self.plan.params:
            yield WeightPiece(p.name, p.shape, p.need[self.rank], local(self.gen[p.name].data), p.name in self.frozen, p.name in self.borrowed)
        if self.staged:
            self.release()

    def _start_delta(self) -> None:
        """Per switch: whether this one sends every gather whole (the first, every
        delta_full_every-th; 0: only the first), and fresh statistics."""
        every = self.cfg.delta_full_every
        self.delta_full = self.delta_syncs == 0 or (every > 0 and self.delta_syncs % every == 0)
        self.delta_syncs += 1 if self.delta else 0
        self.delta_bad: set[tuple] = set()
        self.delta_stats = {"delta_changed": 0, "delta_elements": 0, "delta_full_bytes": 0, "delta_sent_bytes": 0, "delta_repairs": 0, "delta_repaired": []}

    def _reshard_layers(self, layers: list[tuple[str, list[ParamPlan]]], optimized: bool) -> tuple[int, int]:
        """Layer granularity, optimized: units i+1 .. i+W-1's coalesced collectives (all-gathers
        and the exchange) are in flight while unit i is copied into place (W = `self.slots`
        staging slots, unit j in slot j % W). Returns (bytes received, most units in flight)."""
        received, launched, most = 0, 0, 0
        pending: dict[int, list] = {}
        for i, (layer, params) in enumerate(layers):
            with self.trace.span(f"gather {layer}", "gather", optimized=optimized):
                while launched < min(len(layers), i + self.slots):  # every free slot takes the next layer
                    pending[launched] = self._launch_layer(layers[launched][1], (launched % self.slots) * self.slot_numel)[0]
                    launched += 1
                most = max(most, len(pending))
                copies = self._own_slice_copies(params)
            with self.trace.span(f"copy {layer}", "copy"):
                for dst, src in copies:
                    dst.copy_(src)
                received += self._finish_layer(pending.pop(i))
        return received, most

    def _by_layer(self, skip: frozenset) -> dict[str, list[ParamPlan]]:
        """The plan's parameters but `skip`, by layer in plan (= forward) order."""
        by_layer: dict[str, list[ParamPlan]] = {}
        for p in self.plan.params:
            if p.name not in skip:
                by_layer.setdefault(p.layer, []).append(p)
        return by_layer

    def _by_unit(self, skip: frozenset) -> list[tuple[str, list[ParamPlan]]]:
        """The plan's parameters but `skip`, by switch unit (`self.units`) in plan order, named by
        their first and last layer; units left empty are dropped."""
        by_layer = self._by_layer(skip)
        out = []
        for unit in self.units:
            params = [p for layer in unit for p in by_layer.get(layer, ())]
            if params:
                out.append((unit[0] if len(unit) == 1 else f"{unit[0]}..{unit[-1]}", params))
        return out

    def _own_slice_copies(self, params: list[ParamPlan]) -> list:
        """(destination, source) copies of the parameters with nothing to fetch (a size-1 group, or
        gen_tp = N): the rank's own slice; the others arrive through `_launch_layer`."""
        r = self.rank
        return [(_piece(self.gen[p.name].data), crop(self._train_local(p), p.need[r], p.own[r]))
                for p in params if p.name not in self.borrowed and (not p.moves or (p.aligned and len(p.group[r]) == 1))]

    def stream(self) -> "SwitchStream":
        """The optimized layer-granularity switch, driven by its consumer (see `SwitchStream`): the
        first `slots` layers' collectives start now, the rest as `ensure` completes layers."""
        if self.cfg.granularity != "layer":
            raise ValueError("a streamed switch needs actor_rollout_ref.hybrid_engine.granularity=layer")
        if self.delta:  # a repair comes after the last layer, when the forward has already used the layer
            raise ValueError("a streamed switch cannot run with actor_rollout_ref.hybrid_engine.delta_sync=true")
        return SwitchStream(self)

    def _naive_transient_bytes(self) -> int:
        """The full tensors gathered at once (one layer's, or the whole model's), plus, when the
        switch casts, the largest shard cast before its gather (freed after it)."""
        full = {}
        for p in self.plan.params:
            full[p.layer] = full.get(p.layer, 0) + math.prod(p.shape) * p.itemsize
        cast = max(volume(p.own[self.rank]) * p.itemsize for p in self.plan.params) if self.dtype != self.train_dtype else 0
        return (max(full.values()) if self.cfg.granularity == "layer" else sum(full.values())) + cast

    @torch.no_grad()
    def max_abs_diff(self) -> float:
        """The weight check: max |generation parameter - the same slice of the trained weights|
        (0.0 = bit-exact). Its oracle is independent of the plan that moved them: the trained
        tensor is gathered from the training module (DTensor's full_tensor), and the slice this
        rank must hold comes from the generation parameter's own DTensor layout (`held_box`), not
        from the plan's boxes, so a wrong plan box fails it."""
        if self.staged:
            raise ValueError("the weight check needs the generation model's own parameters (the engine writes there in place); "
                             "staged pieces are checked by the backend's log-prob agreement")
        worst = 0.0
        self.train = self._sharded_params()
        for p in self.plan.params:
            full = self._full(p)
            gen_param = self.gen[p.name].data
            expect = crop(full, held_box(gen_param), tuple((0, n) for n in full.shape))
            gen = local(gen_param)
            if gen.shape != expect.shape:  # keep going: every rank must run every full_tensor()
                worst = math.inf
            elif not torch.equal(gen, expect):
                worst = max(worst, float((gen - expect).abs().max()))
        return worst


class SwitchStream:
    """A switch whose layers complete on demand, so it overlaps the generation's first forward
    (prefill): `ensure(layer)` waits for the layers up to `layer` (plan order = forward order:
    embed_tokens, layers.0 .. layers.L-1, norm, lm_head) and copies them into place, and each
    completed layer frees its staging slot for the layer W = `engine.slots` ahead, so layers
    i+1 .. i+W-1's gathers are in flight while layer i computes. `hooks(model)` calls `ensure` from
    forward pre-hooks on the generation model's modules; `finish()` completes whatever the forward
    did not reach and returns the switch's stats as `HybridEngine.reshard` does (bytes received,
    seconds from start to finish, layers in flight).
    Every rank must drive its stream through the same layers in the same order (the same forward)."""

    def __init__(self, engine: HybridEngine):
        e = self.engine = engine
        self.start = time.perf_counter()
        e.train = e._sharded_params()
        e._borrow()
        skip = e.frozen if e.frozen_synced else frozenset()
        self.layers = e._by_unit(skip)  # units: one layer, or small consecutive ones merged
        self.index = {p.layer: i for i, (_, params) in enumerate(self.layers) for p in params}
        self.skipped = len(skip)
        self.done, self.received, self.pending, self.most = 0, 0, {}, 0
        e.acquire()
        for i in range(min(e.slots, len(self.layers))):
            self._launch(i)

    def _launch(self, i: int) -> None:
        e = self.engine
        self.pending[i] = e._launch_layer(self.layers[i][1], (i % e.slots) * e.slot_numel)[0]
        self.most = max(self.most, len(self.pending))

    def ensure(self, layer: str) -> None:
        """Complete every layer up to `layer` (a layer not in the switch: nothing)."""
        self._complete(self.index.get(layer, -1))

    def _complete(self, target: int) -> None:
        """Complete units 0 .. target (already complete ones: nothing)."""
        e = self.engine
        while self.done <= target:
            i = self.done
            with e.trace.span(f"stream {self.layers[i][0]}", "copy"):
                for dst, src in e._own_slice_copies(self.layers[i][1]):
                    dst.copy_(src)
                self.received += e._finish_layer(self.pending.pop(i))
            self.done += 1
            if i + e.slots < len(self.layers):  # its slot (i % slots) is free again
                self._launch(i + e.slots)

    def hooks(self, model: nn.Module) -> list:
        """Forward pre-hooks on every module that directly holds a switched parameter: before it
        runs, its layer is complete. Returns the handles (remove them after the forward)."""
        layer_of_param = {p.name: p.layer for p in self.engine.plan.params}
        handles = []
        for mod_name, mod in model.named_modules():
            names = (f"{mod_name}.{n}" if mod_name else n for n, _ in mod.named_parameters(recurse=False))
            for layer in {layer_of_param[n] for n in names if n in layer_of_param}:
                handles.append(mod.register_forward_pre_hook(lambda _m, _a, layer=layer: self.ensure(layer)))
        return handles

    def finish(self) -> dict:
        self._complete(len(self.layers) - 1)
        e = self.engine
        e.frozen_synced = True
        layers = list(dict.fromkeys(p.layer for _, ps in self.layers for p in ps))
        return {"seconds": time.perf_counter() - self.start, "layers": layers, "skipped_params": self.skipped,
                "bytes_received": self.received, "optimized": True, "layers_in_flight": self.most, "staging_bytes": e.staging_bytes}
