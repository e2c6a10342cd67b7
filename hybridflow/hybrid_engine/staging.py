"""The layer-wise switch's staging: how many layers are in flight at once, and its memory.

Layer granularity (the optimized path) gathers each switch unit's moving parameters into one slot
of a reusable staging buffer, allocated once. A unit is one layer, or consecutive layers merged
while together they stage at most max(the largest layer's need, 1 MiB) (`switch_units`): small
layers (the norms, the only thing that moves at gen_tp = N) then share one collective instead of
paying a round trip each. A slot holds the largest unit's staging need on the rank (per process
group the rank's own shards packed to send plus the gathered receive; for the general exchange,
what it sends plus what it receives). While unit i is copied into place, units i+1 .. i+W-1 are in
flight, each in its own slot, so the buffer is W slots and W units ("layers" in the notes) are in
flight.

W comes from `actor_rollout_ref.hybrid_engine.resharding_buffer_percent` p (the parallel config's
key and the `RLTrainer` / `PPOTrainer` keyword land there):

- unset (None): W = 2, layer i+1 in flight while layer i is copied into place (the default);
- 0 < p <= 1: the staging budget of a rank is p x the bytes of its generation weights (its slices
  of every parameter, in the switch's dtype) and W = the slots that budget holds, the same on every
  rank (the smallest any rank's budget allows), at most the number of layers (more slots would
  never be used). W = 1 gathers a layer only once the previous one is in place.
- a budget smaller than one slot cannot be honoured: W = 1 (one slot, more than the budget);
  granularity `full` and the naive switch (`enable_resharding_opt: false`) have no staging buffer,
  so they do not use it. `StagingPlan.note` says so in one line, and the trainer logs it.

Both the engine (`executor.HybridEngine`) and `hybridflow plan` (`planning/cost.py`) take W and the
staging bytes from `staging_plan`, so the prediction is the engine's number.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.hybrid_engine.plan import ParamPlan, ReshardPlan, volume

KEY = "actor_rollout_ref.hybrid_engine.resharding_buffer_percent"
DEFAULT_SLOTS = 2  # unset: layer i+1 in flight while layer i is copied into place
MIN_UNIT_BYTES = 1 << 20  # smaller consecutive layers share one collective (`switch_units`)


def staging_numel(plan: ReshardPlan, p: ParamPlan, r: int, granularity: str = "layer") -> int:
    """Elements of staging rank `r` needs for parameter `p`: layer granularity packs its own shard
    to send and gathers the group's (1 + group size) x own; full granularity stages only a
    row-parallel weight's gather (dim 0 gathers land in the generation buffer); the general
    exchange stages what the rank sends plus what it receives."""
    if not p.moves:
        return 0
    if p.aligned:
        size = len(p.group[r])
        if size == 1:
            return 0
        if granularity == "layer":  # coalesced: packed send + gathered receive
            return (1 + size) * volume(p.own[r])
        return 0 if p.train_dim == 0 else volume(p.need[r])
    sends, recvs = plan.exchange(p)
    return sum(volume(b) for _, b in sends[r]) + sum(volume(b) for _, b in recvs[r])


def layer_staging(plan: ReshardPlan, r: int, granularity: str = "layer") -> dict[str, int]:
    """{layer: staging elements of rank r}, every layer of the plan in plan (= forward) order."""
    per_layer: dict[str, int] = {}
    for p in plan.params:
        per_layer[p.layer] = per_layer.get(p.layer, 0) + staging_numel(plan, p, r, granularity)
    return per_layer


def _layer_needs(plan: ReshardPlan, granularity: str) -> dict[str, list[int]]:
    """{layer: staging elements per rank}, in plan order. Parameters of the same shape and layout
    share their box lists (`ReshardPlan.build`), and layers of one stage their composition, so each
    distinct one is computed once (a 64-rank plan of 80 layers stays fast)."""
    n = plan.world_size
    per_param: dict[tuple, list[int]] = {}
    by_layer: dict[str, list[tuple]] = {}
    for p in plan.params:
        key = (id(p.own), id(p.need), id(p.group), p.aligned, p.train_dim)
        if key not in per_param:
            per_param[key] = [staging_numel(plan, p, r, granularity) for r in range(n)]
        by_layer.setdefault(p.layer, []).append(key)
    memo: dict[tuple, list[int]] = {}
    for keys in {tuple(ks) for ks in by_layer.values()}:
        memo[keys] = [sum(per_param[k][r] for k in keys) for r in range(n)]
    return {layer: memo[tuple(keys)] for layer, keys in by_layer.items()}


def switch_units(plan: ReshardPlan, granularity: str = "layer", min_unit_bytes: int = MIN_UNIT_BYTES) -> list[tuple[str, ...]]:
    """The layer-wise switch's units in plan (= forward) order: consecutive layers merged while
    their summed staging need (the largest rank's) stays within max(the largest layer's,
    min_unit_bytes), so small layers share one collective per process group instead of paying a
    round trip each (at gen_tp = N every TP-sharded weight is borrowed and only the norms move: the
    whole switch is then one all-gather). Deterministic: the same on every rank."""
    needs = _layer_needs(plan, granularity)
    itemsize = plan.params[0].itemsize if plan.params else 1
    cap = max([min_unit_bytes // itemsize, *(max(v) for v in needs.values())])
    units: list[list[str]] = []
    total = cap + 1
    for layer, need in needs.items():
        if total + max(need) > cap:
            units.append([])
            total = 0
        units[-1].append(layer)
        total += max(need)
    return [tuple(u) for u in units]


def largest_layer_numel(plan: ReshardPlan, granularity: str = "layer", min_unit_bytes: int = MIN_UNIT_BYTES) -> list[int]:
    """Per rank, the largest unit's staging elements (`switch_units`; at least 1: one slot)."""
    needs = _layer_needs(plan, granularity)
    best = [1] * plan.world_size
    for unit in switch_units(plan, granularity, min_unit_bytes):
        best = [max(b, sum(needs[layer][r] for layer in unit)) for r, b in enumerate(best)]
    return best


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class StagingPlan:
    percent: float | None  # as set (None: unset)
    slots: int  # W: layers in flight at once, the same on every rank (0: no staging buffer is used)
    slot_bytes: list[int]  # per rank: one slot (the largest layer's staging need, at least one element)
    budget_bytes: list[int] | None  # per rank: percent x the rank's generation weights (None: unset)
    honoured: bool  # False: the budget was set but not used as asked (see note)
    note: str  # one line: what is used (and instead of what); "" when unset

    def staging_bytes(self, r: int) -> int:
        """The staging buffer of rank r: W slots."""
        return self.slots * self.slot_bytes[r]


def staging_plan(plan: ReshardPlan, percent: float | None, granularity: str = "layer", optimized: bool = True,
                 min_unit_bytes: int = MIN_UNIT_BYTES) -> StagingPlan:
    """W and the staging bytes per rank for `plan` (its itemsize is the switch's dtype), as the
    module docstring states; deterministic, the same on every rank."""
    n = plan.world_size
    itemsize = plan.params[0].itemsize if plan.params else 1
    if granularity != "layer":  # full: temporaries per parameter, no staging buffer
        note = "" if percent is None else (
            f"{KEY}={percent} is not used: granularity=full gathers parameter by parameter into temporaries of its own "
            f"(no staging buffer); set actor_rollout_ref.hybrid_engine.granularity=layer for a staging budget")
        return StagingPlan(percent, 0, [0] * n, None, percent is None, note)
    slot = [numel * itemsize for numel in largest_layer_numel(plan, granularity, min_unit_bytes)]
    if percent is None:
        return StagingPlan(None, DEFAULT_SLOTS, slot, None, True, "")
    gen = [plan.gen_buffer_bytes(r) for r in range(n)]
    budget = [int(percent * g) for g in gen]
    fits = [b // s for b, s in zip(budget, slot)]
    r = min(range(n), key=lambda i: (fits[i], -slot[i]))  # the rank that limits W
    layers = len(switch_units(plan, granularity, min_unit_bytes))
    share = f"{percent:g} x {_mib(gen[r])} of generation weights"
    if fits[r] < 1:
        slots, honoured = 1, False
        note = (f"{KEY}={percent} allows {_mib(budget[r])} of staging per rank ({share}), less than one layer's "
                f"staging ({_mib(slot[r])}): staging 1 layer at a time ({_mib(slot[r])} per rank) instead")
    else:
        slots, honoured = min(fits[r], layers), True
        capped = f"; all {layers} switch unit(s) fit (small consecutive layers share one), so only {slots} slots are allocated" if fits[r] > layers else ""
        note = (f"{KEY}={percent}: {slots} layer(s) in flight, {_mib(slots * slot[r])} of staging per rank "
                f"(budget {_mib(budget[r])} = {share}; one layer's staging {_mib(slot[r])}){capped}")
    if not optimized:  # the buffer is sized as asked, but the naive switch never uses it
        honoured = False
        note = (f"{KEY}={percent} is not used: enable_resharding_opt=false runs the naive switch (every full parameter "
                f"gathered, then sliced), which has no staging buffer")
    return StagingPlan(percent, slots, slot, budget, honoured, note)
