"""The DataFlow API: an RL step is an ordered list of stages over one `Batch`.

A stage is bound either to a worker-group method (runs on the SPMD workers) or to a plain
driver function. It reads named keys of the batch and writes named keys back:

    flow = DataFlow([
        Stage("gen", actor.generate_sequences, inputs=["input_ids", "attention_mask"], outputs=["responses", ...]),
        Stage("reward", reward_fn, inputs=["responses", "response_mask"], outputs=["token_level_scores"]),
        ...
    ])
    batch, metrics = flow.run(batch)

A stage function gets `batch.select(inputs)` (meta included) and returns a `Batch` (its declared
outputs are copied into the step's batch, its meta["metrics"] are reported), a metrics dict, or
None. Each stage is timed as `timing_s/<name>`. Replace one with `flow.replace("reward", fn)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from hybridflow.protocol import Batch

StageFn = Callable[[Batch], Optional[object]]


@dataclass
class Stage:
    name: str
    fn: StageFn
    inputs: list[str] = field(default_factory=list)  # [] = the whole batch
    outputs: list[str] = field(default_factory=list)
    enabled: bool = True


class DataFlow:
    def __init__(self, stages: list[Stage]):
        self.stages = list(stages)

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
        """Swap a stage's function (and optionally inputs/outputs/enabled) in place."""
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

    def run(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        metrics: dict[str, float] = {}
        for stage in self.stages:
            if not stage.enabled:
                continue
            missing = [k for k in stage.inputs if k not in batch]
            if missing:
                raise KeyError(f"stage {stage.name!r} needs {missing}, which no earlier stage produced (batch has {batch.keys()})")
            start = time.perf_counter()
            result = stage.fn(batch.select(stage.inputs) if stage.inputs else batch)
            metrics[f"timing_s/{stage.name}"] = time.perf_counter() - start
            if stage.outputs and not isinstance(result, Batch):
                raise TypeError(f"stage {stage.name!r} declares outputs {stage.outputs} but returned {type(result).__name__}, not a Batch")
            if isinstance(result, Batch):
                absent = [k for k in stage.outputs if k not in result]
                if absent:
                    raise KeyError(f"stage {stage.name!r} declared outputs {absent} but did not return them")
                for k in stage.outputs:
                    batch[k] = result[k]
                metrics.update(result.meta.get("metrics", {}))
                batch.meta.update({k: v for k, v in result.meta.items() if k != "metrics"})
            elif isinstance(result, dict):
                metrics.update(result)
        return batch, metrics
