"""Async rollout (trainer.async_rollout, the rollout role on a pool of its own).

Generation of batch k+1 runs on the rollout pool while the trainer updates on batch k; after the
update the flow's "sync_weights" stage waits for that generation to finish, then moves the trained
weights to the rollout pool (`WeightSync.sync_rollout`). One-step off-policy: the PPO ratio's old
log-probs are the rollout policy's (`rollout_log_probs`), and `rollout/staleness` = policy versions
between generation and update (0 on the first step, then 1).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from hybridflow.protocol import Batch
from hybridflow.protocol import SamplingParams
from hybridflow.trainer.keys import GEN_OUTPUTS, PROMPT_KEYS
from hybridflow.trainer.weight_sync import WeightSync


class AsyncRollout:
    def __init__(self, rollout: Any, weight_sync: WeightSync, prompts: Callable[[], Batch], sampling: Callable[[int], SamplingParams]):
        """rollout: the rollout pool's view; prompts(): the next step's prompt batch (takes it from
        the loader); sampling(step): the sampling parameters of that step."""
        self.rollout, self.weight_sync, self.prompts, self.sampling = rollout, weight_sync, prompts, sampling
        self.pending: _InFlight | None = None  # the next batch's generation, in flight
        self.version = 0  # policy version (updates applied) of the weights the rollout pool holds

    def submit(self, step: int) -> None:
        """Start generating the prompts of `step` on the rollout pool."""
        prompts = self.prompts()
        self.pending = _InFlight(prompts, self.rollout.submit("generate_sequences", prompts.select(PROMPT_KEYS), self.sampling(step)), self.version)

    def take(self, step: int, before_next: Callable[[], None] | None) -> tuple[Batch, dict[str, float]]:
        """The generated batch of `step` (on the first step, or after a resume, generated now) and
        its metrics; then, unless `before_next` is None (the last step), call it and start
        generating step + 1's batch with the weights the rollout pool holds (one update behind)."""
        if self.pending is None:
            self.submit(step)
        wait_start = time.perf_counter()
        batch, version = self.pending.result()
        metrics = {"timing_s/gen_wait": time.perf_counter() - wait_start,
                   "rollout/staleness": float(step - 1 - version)}  # updates since the sampling policy
        self.pending = None
        if before_next is not None:
            before_next()
            self.submit(step + 1)
        return batch, metrics

    def sync_weights(self, step: int) -> dict[str, float]:
        """The trained weights (after `step` updates) -> the rollout pool, once it has finished the
        batch it is generating with the previous weights."""
        if self.pending is not None:
            self.pending.result()
        m = self.weight_sync.sync_rollout()
        self.version = step
        return m


class _InFlight:
    """One batch's generation in flight on the rollout pool, and the policy version of the weights
    it samples with. `result()` waits once and merges the responses into the prompts."""

    def __init__(self, prompts: Batch, pending, version: int):
        self.prompts, self.pending, self.version = prompts, pending, version
        self._done: Batch | None = None

    def result(self) -> tuple[Batch, int]:
        if self._done is None:
            out = self.pending.result()
            for key in GEN_OUTPUTS:
                self.prompts[key] = out[key]
            self.prompts.meta.update(out.meta, policy_version=self.version)
            self._done = self.prompts
        return self._done, self.version
