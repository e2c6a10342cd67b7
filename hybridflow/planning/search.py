"""Which layouts are valid for a model and a device count, and which is best.

Training layouts pp x tp x dp = devices; generation TP sizes gen_tp. Each invalid combination
comes with its reason (heads not divisible, layers not divisible, gen_tp not compatible with the
training layout, does not fit the device memory). Valid ones rank by predicted switch seconds,
then by memory headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.parallel.dims import ParallelDims
from hybridflow.planning.arch import Arch
from hybridflow.planning.cost import GIB, Cluster, MemoryInputs, rows


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problems(arch: Arch, layout: ParallelDims, gpus_per_node: int | None = None) -> list[str]:
    out = []
    if gpus_per_node and layout.tp > gpus_per_node:
        out.append(f"training tp={layout.tp} spans nodes ({gpus_per_node} devices each): its all-reduces in every layer would cross them")
    for what, heads in (("attention heads", arch.heads), ("KV heads", arch.kv_heads)):
        if heads % layout.tp:
            out.append(f"training tp={layout.tp} does not divide the {heads} {what}")
    if layout.ep > 1 and (not arch.experts or arch.experts % layout.ep):
        out.append(f"ep={layout.ep} needs an MoE model whose experts it divides ({arch.experts or 'dense'})")
    if arch.layers % layout.pp:
        out.append(f"pp={layout.pp} does not divide the {arch.layers} decoder layers")
    for what, heads in (("attention heads", arch.heads), ("KV heads", arch.kv_heads)):
        if heads % layout.sp:
            out.append(f"sp={layout.sp} does not divide the {heads} {what} (Ulysses attends with whole heads per rank)")
    return out


def gen_tp_problems(arch: Arch, layout: ParallelDims, gen_tp: int) -> list[str]:
    out = []
    if layout.world % gen_tp:
        return [f"gen_tp={gen_tp} does not divide the {layout.world} devices"]
    for what, heads in (("attention heads", arch.heads), ("KV heads", arch.kv_heads)):
        if heads % gen_tp:
            out.append(f"gen_tp={gen_tp} does not divide the {heads} {what}")
    if not layout.fits_gen_tp(gen_tp):  # the layout's rule (parallel/dims.py)
        out.append(f"gen_tp={gen_tp} must divide tp*dp={layout.tp * layout.dp} of {layout.label} (or be tp*dp times a divisor of "
                   f"pp={layout.pp}): otherwise a generation slice is not made of whole training slices")
    return out


def train_layouts(devices: int) -> list[ParallelDims]:
    """Every pp x tp x dp, and Ulysses sp (> 1, dividing dp) on the FSDP layout (pp = tp = 1)."""
    return ([ParallelDims(pp, tp, devices // (pp * tp)) for pp in divisors(devices) for tp in divisors(devices // pp)]
            + [ParallelDims(dp=devices, sp=sp) for sp in divisors(devices)[1:]])


def ep_layouts(arch: Arch, devices: int) -> list[ParallelDims]:
    """An MoE model's expert-parallel layouts: FSDP over every device with ep (> 1) dividing the devices and the experts."""
    return [ParallelDims(dp=devices, ep=ep) for ep in divisors(devices)[1:] if arch.experts and arch.experts % ep == 0]


@dataclass
class Invalid:
    train_layout: str
    gen_tp: int | None
    reason: str


def search(arch: Arch, cluster: Cluster, m: MemoryInputs, switch_dtype: str = "bf16", layouts: list[ParallelDims] | None = None,
           gen_tps: list[int] | None = None) -> tuple[list[dict], list[Invalid]]:
    """(ranked optimized rows, each with its naive seconds; invalid combinations with reasons). An MoE
    model's rows rank by the switch plus the experts' training communication per step (`cost.expert_comm`),
    the FSDP / EP layouts first: TP and PP layouts move activations in every layer, which is not modelled."""
    ranked, invalid = [], []
    for layout in layouts or [*train_layouts(cluster.world), *ep_layouts(arch, cluster.world)]:
        bad = layout_problems(arch, layout, cluster.gpus_per_node)
        if bad:
            invalid.append(Invalid(layout.label, None, "; ".join(bad)))
            continue
        for gen_tp in gen_tps or divisors(layout.world):
            bad = gen_tp_problems(arch, layout, gen_tp)
            if bad:
                invalid.append(Invalid(layout.label, gen_tp, "; ".join(bad)))
                continue
            opt, naive = rows(arch, layout, gen_tp, cluster, m, switch_dtype)
            if not opt["fits"]:
                invalid.append(Invalid(layout.label, gen_tp, f"does not fit: peak {opt['memory_per_rank_bytes'] / GIB:.1f} GiB per rank "
                                                             f"> {cluster.memory_bytes / GIB:.1f} GiB"))
                continue
            opt["naive_seconds"] = naive["predicted_seconds"]
            opt["headroom_bytes"] = cluster.memory_bytes - opt["memory_per_rank_bytes"]
            ranked.append(opt)
    # sp moves no weight-switch bytes and its all-to-alls are not modelled: among equal switches the
    # smallest sp that fits ranks first, so sp shows up where activations need it (they shrink by sp)
    ranked.sort(key=lambda r: (not r["expert_comm_modelled"], r["predicted_seconds"] + r["expert_comm_seconds"], r["sp"], -r["headroom_bytes"]))
    return ranked, invalid
