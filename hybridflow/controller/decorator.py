"""`register(dispatch_mode=...)`: how a worker method is called by the single controller.

A worker class marks its public methods with ``@register(Dispatch.X)``. The worker group reads
the mark and turns one driver call into N per-rank calls (dispatch) and N results into one
(collect):

- ONE_TO_ALL: every rank gets the same arguments; the result is the list of per-rank results.
- DP_COMPUTE: every `Batch` argument is split into N equal chunks by data-parallel rank (padded
  to a multiple of N first, un-padded after); Batch results are concatenated back in rank order,
  dict results (metrics) are averaged over ranks.
- RANK_ZERO: every rank runs (SPMD methods use collectives), only rank 0's result is returned.

`register(Dispatch.DP_COMPUTE, layout="rollout")` splits by a data-parallel layout the worker
declares (`Worker.dispatch_layout`) instead of by rank: e.g. tensor-parallel generation, where
the gen_tp ranks of one replica get the same chunk and only one of them returns it.
"""

from __future__ import annotations

import enum
from typing import Any, Callable

from hybridflow.protocol import Batch

DISPATCH_ATTR = "_hybridflow_dispatch"
LAYOUT_ATTR = "_hybridflow_layout"
ROLE_ATTR = "_hybridflow_role"
CONCURRENCY_GROUP_ATTR = "_hybridflow_concurrency_group"  # a method's Ray concurrency group (None: the default one, one call at a time)


def concurrent(group: str):
    """Tag a worker method with the Ray concurrency group its calls run in; the worker class sizes its
    groups in `CONCURRENCY_GROUPS` (name -> calls at once), and the worker group starts the actor with them."""
    def deco(fn):
        setattr(fn, CONCURRENCY_GROUP_ATTR, group)
        return fn

    return deco

# Per rank: (data-parallel index, data-parallel size, whether its result is collected).
Layout = list[tuple[int, int, bool]]


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    DP_COMPUTE = "dp_compute"
    RANK_ZERO = "rank_zero"


def register(dispatch_mode: Dispatch = Dispatch.ONE_TO_ALL, layout: str | None = None) -> Callable:
    def mark(fn: Callable) -> Callable:
        setattr(fn, DISPATCH_ATTR, dispatch_mode)
        setattr(fn, LAYOUT_ATTR, layout)
        return fn

    return mark


def dispatch_args(mode: Dispatch, world_size: int, args: tuple, kwargs: dict, layout: Layout | None = None) -> tuple[list, list, int]:
    """Per-rank (args, kwargs) lists, and the number of padding rows added (DP_COMPUTE)."""
    if mode is not Dispatch.DP_COMPUTE:
        return [args] * world_size, [kwargs] * world_size, 0
    layout = layout or [(r, world_size, True) for r in range(world_size)]
    dp_size = layout[0][1]

    lengths = {len(v) for v in (*args, *kwargs.values()) if isinstance(v, Batch)}
    if len(lengths) > 1:
        raise ValueError(f"DP_COMPUTE: every Batch argument must have the same number of rows, got {sorted(lengths)}")
    pad = 0

    def split(value: Any) -> list:
        nonlocal pad
        if isinstance(value, Batch):
            padded, pad = value.pad_to_multiple(dp_size)
            return padded.chunk(dp_size)
        return [value] * dp_size

    split_args = [split(a) for a in args]
    split_kwargs = {k: split(v) for k, v in kwargs.items()}
    rank_args = [tuple(a[dp] for a in split_args) for dp, _, _ in layout]
    rank_kwargs = [{k: v[dp] for k, v in split_kwargs.items()} for dp, _, _ in layout]
    return rank_args, rank_kwargs, pad


def collect_results(mode: Dispatch, results: list, pad: int, layout: Layout | None = None) -> Any:
    if mode is Dispatch.ONE_TO_ALL:
        return results
    if mode is Dispatch.RANK_ZERO:
        return results[0]
    if layout is not None:  # one result per data-parallel index, in order
        results = [res for _, res in sorted(((dp, res) for (dp, _, keep), res in zip(layout, results) if keep), key=lambda x: x[0])]
    first = results[0]
    if isinstance(first, Batch):
        out = Batch.concat(results)
        rank_metrics = [r.meta.get("metrics") for r in results if r.meta.get("metrics")]
        if rank_metrics:
            out.meta["metrics"] = mean_metrics(rank_metrics)
        return out.unpad(pad) if pad else out
    if isinstance(first, dict):
        return mean_metrics(results)
    return results


def mean_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Average each numeric metric over the ranks that report it."""
    keys = {k for d in per_rank for k in d}
    out = {}
    for k in sorted(keys):
        vals = [float(d[k]) for d in per_rank if k in d]
        out[k] = sum(vals) / len(vals)
    return out
