"""The DataFlow API: an RL step is a graph of stages over one `Batch`, run by a scheduler.

A stage is bound to a worker-group method (runs on the SPMD workers of that group's pool), to a
driver function (runs on the driver), to an object with an `update` method, or (add_stage) to a
model the flow places on workers of its own (`model_stage.py`). Every stage
declares the keys it reads and the keys it writes:

    flow = DataFlow([
        Stage("gen", actor.generate_sequences, inputs=["input_ids", "attention_mask"], outputs=["responses", ...]),
        Stage("reward", reward_fn, inputs=["responses", "response_mask"], outputs=["token_level_scores"]),
        ...
    ])
    batch, metrics = flow.run(batch)

or, one stage per line:

    flow = DataFlow()
    flow.add_stage("rollout", actor.generate_sequences, input_keys=["input_ids"], output_keys=["responses"])
    flow.add_stage("reward", reward_fn, input_keys=["responses"], output_keys=["token_level_scores"], sync=True)
    results = flow.run(batch)   # the step's batch; results["key"], results.metrics

A stage function gets `batch.select(inputs)` (meta included) and returns a `Batch` (its declared
outputs are copied into the step's batch, its meta["metrics"] are reported), a metrics dict, or
None.

Scheduling (`run`):
- Dependencies come from the keys: a stage waits for the latest stage declared before it that
  writes one of its inputs (or, when none does, for a later one: stages may be added in any order);
  a key nobody writes must be in the input batch. `check(keys)` validates the whole graph before
  the first step: a missing producer names the stage and the key, a cycle lists its stages.
- A pool is a serial resource: stages bound to the same worker pool run one at a time, in
  declaration order (so `reshard` runs after `update_actor` without a data edge). Driver stages
  (the "driver" pool) run one at a time in the order their inputs become ready. Stages on
  different pools run concurrently as soon as their inputs are ready.
- `sync=True` makes a stage a barrier: it starts after every stage declared before it finished,
  and stages declared after it start once it finished. `sync=False` (the default) lets the
  scheduler overlap it with anything it does not depend on; its consumers wait for it.
- `batch_size` (rows, global: all workers together) calls the stage once per chunk of that many
  rows, in order, and concatenates the outputs (metrics averaged). With `grad_accum_steps=g`, the
  chunks form groups of g (the last may be shorter) and the stage is called with
  `optimizer_step=` (True on the last chunk of a group) and `loss_scale=1/len(group)`: an update
  (e.g. `actor.update_actor`, `critic.update_critic`) accumulates the group's gradients and takes
  one optimizer step, the group's mean.

Metrics: `timing_s/<stage>` per stage, `timing_s/dataflow` (the graph's wall time) and
`perf/pool_busy/<pool>` (the share of that wall time the pool was running a stage). The start and
end times of the last run are in `flow.timeline`.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from hybridflow.controller.decorator import mean_metrics
from hybridflow.protocol import Batch

StageFn = Callable[..., Optional[object]]
DRIVER = "driver"
POOL_ATTR = "pool_name"  # set on worker-group methods: the name of the pool they run on


@dataclass
class Stage:
    name: str
    fn: Any
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    enabled: bool = True
    pool: Optional[str] = None  # None: the worker group's pool for a group method, else "driver"
    sync: bool = False
    batch_size: Optional[int] = None
    grad_accum_steps: int = 1

    @property
    def pool_name(self) -> str:
        return self.pool or getattr(self.fn, POOL_ATTR, None) or getattr(getattr(self.fn, "update", None), POOL_ATTR, None) or DRIVER


@dataclass
class StageRecord:
    name: str
    pool: str
    start: float  # perf_counter seconds
    end: float


class FlowResult(Batch):
    """What `run` returns: the step's batch with `.metrics`. `results["loss"]` reads a batch key,
    else a metric; `batch, metrics = flow.run(b)` unpacks it."""

    metrics: dict[str, float]

    def __getitem__(self, key: str):
        if key not in self and key in self.metrics:
            return self.metrics[key]
        return super().__getitem__(key)

    def __iter__(self):
        return iter((self, self.metrics))


class DataFlow:
    def __init__(self, stages: list[Stage] | None = None, config: Any = None):
        self.stages = list(stages or [])
        self.config = config
        self.timeline: list[StageRecord] = []
        self.models: dict[Any, Any] = {}  # model module -> the PolicyGroup the flow placed for it

    def close(self) -> None:
        """Stop the worker groups the flow created for model modules."""
        for group in self.models.values():
            group.close()
        self.models = {}

    def __enter__(self) -> "DataFlow":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ editing
    def add_stage(self, name: str, module: Any, input_keys: list[str] = (), output_keys: list[str] = (), *, sync: bool = False,
                  batch_size: int | None = None, grad_accum_steps: int = 1, pool: str | None = None,
                  num_workers: int = 2, method: str | None = None) -> "DataFlow":
        """Append a stage. `module`: a worker-group method, a driver function, an object with an
        `update(batch)` method, or a model (a checkpoint path or `PreTrainedModel`: the flow places
        it on `num_workers` workers of its own, see `model_stage.py`; `method` overrides what the
        stage calls on it). `batch_size` / `grad_accum_steps`: see the module docstring."""
        from hybridflow.trainer import model_stage

        if any(s.name == name for s in self.stages):
            raise ValueError(f"a stage named {name!r} already exists; stages: {self.names()}")
        if model_stage.is_model(module):
            if self.config is None:
                raise ValueError(f"stage {name!r}: a model module needs the flow's config: DataFlow(config=cfg)")
            key = os.path.abspath(str(module)) if isinstance(module, (str, os.PathLike)) else id(module)
            if key not in self.models:
                self.models[key] = model_stage.PolicyGroup(self.config, module, num_workers)
            module = self.models[key].stage_fn(model_stage.stage_method(list(output_keys), method))
        if not callable(module) and not callable(getattr(module, "update", None)):
            raise TypeError(f"stage {name!r}: module must be a worker-group method, a function, or an object with an update() method; "
                            f"got {type(module).__name__}")
        if batch_size is not None and not (isinstance(batch_size, int) and batch_size > 0):
            raise ValueError(f"stage {name!r}: batch_size must be a positive integer, got {batch_size!r}")
        if not (isinstance(grad_accum_steps, int) and grad_accum_steps >= 1):
            raise ValueError(f"stage {name!r}: grad_accum_steps must be an integer >= 1, got {grad_accum_steps!r}")
        self.stages.append(Stage(name, module, list(input_keys), list(output_keys), pool=pool, sync=sync, batch_size=batch_size,
                                 grad_accum_steps=grad_accum_steps))
        return self

    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def _index(self, name: str) -> int:
        for i, s in enumerate(self.stages):
            if s.name == name:
                return i
        raise KeyError(f"no stage named {name!r}; stages: {self.names()}")

    def __getitem__(self, name: str) -> Stage:
        return self.stages[self._index(name)]

    def replace(self, name: str, fn: StageFn | None = None, **changes) -> "DataFlow":
        """Swap a stage's function (and optionally inputs/outputs/enabled/pool/...) in place."""
        i = self._index(name)
        if fn is not None:
            changes["fn"] = fn
        self.stages[i] = replace(self.stages[i], **changes)
        return self

    def insert_after(self, name: str, stage: Stage) -> "DataFlow":
        self.stages.insert(self._index(name) + 1, stage)
        return self

    def remove(self, name: str) -> "DataFlow":
        del self.stages[self._index(name)]
        return self

    # ------------------------------------------------------------------ the graph
    def dependencies(self, initial_keys) -> dict[str, set[str]]:
        """stage name -> the stages it waits for (data, pool order and sync barriers); raises
        KeyError for an input nobody produces and ValueError for a cycle."""
        active = [s for s in self.stages if s.enabled]
        initial = set(initial_keys)
        deps: dict[str, set[str]] = {s.name: set() for s in active}
        last_on_pool: dict[str, str] = {}
        source: dict[tuple[str, str], str] = {}  # (reader, key) -> the stage it reads the key from
        for i, s in enumerate(active):
            for key in s.inputs:
                earlier = [t for t in active[:i] if key in t.outputs]
                later = [t for t in active[i + 1 :] if key in t.outputs]
                if earlier:
                    deps[s.name].add(earlier[-1].name)
                    source[(s.name, key)] = earlier[-1].name
                elif key in initial:
                    continue
                elif later:
                    deps[s.name].add(later[0].name)
                    source[(s.name, key)] = later[0].name
                else:
                    raise KeyError(f"stage {s.name!r} reads {key!r}, which no stage produces and the input batch lacks "
                                   f"(batch keys: {sorted(initial)}); add a stage that outputs it or declare it as an output")
            pool = s.pool_name
            if pool != DRIVER and pool in last_on_pool:  # driver stages: one at a time, any order
                deps[s.name].add(last_on_pool[pool])
            last_on_pool[pool] = s.name
            if s.sync:  # barrier: after everything before, before everything after
                deps[s.name].update(t.name for t in active[:i])
                for t in active[i + 1 :]:
                    deps[t.name].add(s.name)
        for i, s in enumerate(active):  # a stage that overwrites a key runs after the earlier writer and readers
            for key in s.outputs:
                earlier = [t for t in active[:i] if key in t.outputs]
                if earlier:
                    deps[s.name].add(earlier[-1].name)
                deps[s.name].update(t.name for t in active[:i] if key in t.inputs and source.get((t.name, key)) != s.name)
        _check_acyclic(deps)
        return deps

    def check(self, initial_keys) -> None:
        """Validate the graph for a batch with `initial_keys` (run before the first step)."""
        self.dependencies(initial_keys)

    # ------------------------------------------------------------------ running
    def run(self, batch: Batch) -> FlowResult:
        """Run one step: the step's batch with `.metrics` (also unpacks as `batch, metrics`)."""
        deps = self.dependencies(batch.keys())
        active = {s.name: s for s in self.stages if s.enabled}
        metrics: dict[str, float] = {}
        self.timeline = []
        done: set[str] = set()
        running: dict[Future, Stage] = {}
        t0 = time.perf_counter()
        pool = ThreadPoolExecutor(max_workers=max(1, len(active)), thread_name_prefix="stage")
        try:
            while len(done) < len(active):
                started = set(done) | {s.name for s in running.values()}
                driver_busy = any(s.pool_name == DRIVER for s in running.values())
                for name, s in active.items():
                    if name not in started and deps[name] <= done and not (driver_busy and s.pool_name == DRIVER):
                        driver_busy |= s.pool_name == DRIVER
                        view = batch.select(s.inputs)
                        running[pool.submit(self._call, s, view)] = s
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in finished:
                    s = running.pop(fut)
                    result, start, end = fut.result()
                    self.timeline.append(StageRecord(s.name, s.pool_name, start, end))
                    metrics[f"timing_s/{s.name}"] = end - start
                    _merge(s, result, batch, metrics)
                    done.add(s.name)
        except BaseException:
            # Fail now: do not wait for stages still running on other pools (their threads end on
            # their own; a stuck one would otherwise hide this error).
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        wall = time.perf_counter() - t0
        metrics["timing_s/dataflow"] = wall
        busy: dict[str, float] = {}
        for r in self.timeline:
            busy[r.pool] = busy.get(r.pool, 0.0) + (r.end - r.start)
        for p, seconds in busy.items():
            metrics[f"perf/pool_busy/{p}"] = min(1.0, seconds / wall) if wall > 0 else 0.0
        out = FlowResult(batch.tensors, batch.non_tensors, batch.meta)
        out.metrics = metrics
        return out

    @staticmethod
    def _call(s: Stage, view: Batch):
        fn = s.fn if callable(s.fn) else s.fn.update
        start = time.perf_counter()
        if s.batch_size is None or (len(view) <= s.batch_size and s.grad_accum_steps == 1):  # one call
            result = fn(view)
        else:
            chunks = view.split(s.batch_size) if s.batch_size else [view]
            results = []
            g = s.grad_accum_steps
            for i, chunk in enumerate(chunks):
                if g > 1:  # groups of g chunks; the last group may be shorter
                    group_start = i - i % g
                    group_len = min(g, len(chunks) - group_start)
                    step = i == group_start + group_len - 1
                    results.append(fn(chunk, optimizer_step=step, loss_scale=1.0 / group_len))
                else:
                    results.append(fn(chunk))
            result = _combine(s, results)
        return result, start, time.perf_counter()


def _combine(s: Stage, results: list) -> Any:
    """Per-chunk results -> one: Batches concatenated (metrics averaged), dicts averaged."""
    if all(isinstance(r, Batch) for r in results):
        out = Batch.concat([r.select(s.outputs) if s.outputs else r for r in results])
        rank_metrics = [r.meta.get("metrics") for r in results if r.meta.get("metrics")]
        out.meta = {k: v for k, v in results[-1].meta.items() if k != "metrics"}
        if rank_metrics:
            out.meta["metrics"] = mean_metrics(rank_metrics)
        return out
    dicts = [r for r in results if isinstance(r, dict)]
    return mean_metrics(dicts) if dicts else None


def _merge(s: Stage, result: Any, batch: Batch, metrics: dict[str, float]) -> None:
    if s.outputs and not isinstance(result, Batch):
        raise TypeError(f"stage {s.name!r} declares outputs {s.outputs} but returned {type(result).__name__}, not a Batch")
    if isinstance(result, Batch):
        absent = [k for k in s.outputs if k not in result]
        if absent:
            raise KeyError(f"stage {s.name!r} declared outputs {absent} but did not return them")
        for k in s.outputs:
            batch[k] = result[k]
        metrics.update(result.meta.get("metrics", {}))
        batch.meta.update({k: v for k, v in result.meta.items() if k != "metrics"})
    elif isinstance(result, dict):
        metrics.update(result)


def _check_acyclic(deps: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    path: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        path.append(n)
        for m in sorted(deps[n]):
            if state.get(m) == 1:
                cycle = path[path.index(m) :] + [m]
                raise ValueError(f"the dataflow has a cycle: {' -> '.join(reversed(cycle))}; a stage cannot wait for its own outputs")
            if m not in state:
                visit(m)
        path.pop()
        state[n] = 2

    for n in deps:
        if n not in state:
            visit(n)

