"""Async rollout with a staleness bound (trainer.async_rollout, the rollout role on a pool of its own).

The rollout pool generates ahead of training: the batch of step t (trained by the t-th update, on
top of t-1 updates) is submitted as soon as the weights the pool will hold when it runs are at
most k = async_training.max_staleness versions behind that update, i.e. while

    (t - 1) - version <= k          version: weight syncs submitted to the pool so far

so at step s the pool has the batches of steps s .. s+k queued or done, and no trained token is
older than k versions, by construction (nothing is generated that would have to be dropped).
Calls to a Ray actor run in the order one caller submits them, so a batch submitted after a weight
sync samples with those weights, and a sync submitted after batches waits for them on the pool
without blocking the driver. k = 0 generates each batch after the previous update's sync (the
synchronous schedule on a pool of its own); k = 1 overlaps one batch with each update.

Every batch records the version that sampled it: `rollout_policy_version` [b, R] per response
token (one version per trajectory: a request is not paused for a weight update), and the step's
metrics give `rollout/staleness` (updates since the sampling weights) with its per-token
min / mean / max, `rollout/buffer_depth` (batches generated or in flight beyond this step's) and
`timing_s/gen_wait` (the trainer waiting for its batch). Every wait on the pool has a deadline
(actor_rollout_ref.rollout.request_timeout_s): past it the run stops with one line naming the
pool, its ranks, the step and the version it waited for.

Resume: a checkpoint records the loader position before the oldest batch still queued, so the
batches in flight at a crash are generated again after the resume, with the restored weights
(staleness 0 for the first; the bound holds) -- regenerated, not persisted.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hybridflow.protocol import Batch, SamplingParams
from hybridflow.trainer.keys import PROMPT_KEYS
from hybridflow.trainer.weight_sync import REQUEST_TIMEOUT_KEY



@dataclass
class _InFlight:
    """One batch's generation on the rollout pool: its step, prompts, the pool call, the policy
    version of the weights it samples with, and the loader's position before its prompts."""

    step: int
    prompts: Batch
    pending: Any
    version: int
    loader_state: Any


class AsyncRollout:
    def __init__(self, rollout: Any, weight_sync: Any, prompts: Callable[[], Batch], sampling: Callable[[int], SamplingParams],
                 total_steps: int, max_staleness: int = 1, timeout_s: float | None = None, loader_state: Callable[[], Any] = lambda: None,
                 agent: Any = None):
        """rollout: the rollout pool's view (`submit(method, ...) -> Pending`); weight_sync:
        `start_rollout_sync() -> RolloutSync` (`trainer/weight_sync.py`); prompts(): the next batch
        of prompts (drawn from the loader); sampling(step): that step's sampling parameters;
        loader_state(): the loader's position (what a checkpoint stores); agent: a multi-turn
        rollout (`agent_rollout.AgentRollout`) whose trajectories run on a driver thread per batch,
        each turn a request to the pool tagged with the policy version it samples with (tool time
        overlaps the other batches' generation and the update)."""
        self.rollout, self.weight_sync, self.prompts, self.sampling = rollout, weight_sync, prompts, sampling
        self.total_steps, self.k, self.timeout_s, self.loader_state = total_steps, max_staleness, timeout_s, loader_state
        self.agent = agent
        self.threads = concurrent.futures.ThreadPoolExecutor(max_staleness + 1, "agent-rollout") if agent is not None else None
        self.lock = threading.Lock()  # a call's submission and the version it samples with, vs a sync's submission
        self.queue: collections.deque[_InFlight] = collections.deque()  # submitted, not yet trained: oldest first
        self.syncs: collections.deque[tuple[int, Any]] = collections.deque()  # (batches submitted before it, RolloutSync) not collected
        self.next_step = 1  # the step whose batch is submitted next
        self.version = 0  # weight syncs submitted to the pool: the version of the next batch submitted
        self.submitted = 0  # batches submitted so far

    @property
    def pending(self) -> bool:
        """Batches are queued beyond the steps trained (a checkpoint resumes from the oldest)."""
        return bool(self.queue)

    def resume_loader_state(self) -> Any:
        """The loader position a checkpoint stores: before the oldest batch still queued (None: none is)."""
        return self.queue[0].loader_state if self.queue else None

    def _fill(self) -> None:
        """Submit every batch whose staleness at its training step stays within k."""
        while self.next_step <= self.total_steps and (self.next_step - 1) - self.version <= self.k:
            state = self.loader_state()
            prompts, params = self.prompts(), self.sampling(self.next_step)
            with self.lock:
                if self.agent is None:
                    pending = self.rollout.submit("generate_sequences", prompts.select(PROMPT_KEYS), params)
                else:
                    pending = _ThreadCall(self.threads.submit(self.agent.generate, _VersionedPool(self), prompts, params))
                self.queue.append(_InFlight(self.next_step, prompts, pending, self.version, state))
            self.next_step += 1
            self.submitted += 1

    def take(self, step: int) -> tuple[Batch, dict[str, float]]:
        """The generated batch of `step` and its metrics; first submits what the bound allows
        (on the first step, or after a resume, the batch of `step` itself)."""
        if not self.queue and self.next_step < step:  # resumed: nothing in flight, start at this step
            self.next_step = step
        self._fill()
        item = self.queue.popleft()
        if item.step != step:
            raise RuntimeError(f"async rollout: the oldest queued batch is step {item.step}'s, step {step} asked for it")
        wait_start = time.perf_counter()
        out = item.pending.result(self.timeout_s, f"step {step}'s batch (sampled with policy version {item.version})", REQUEST_TIMEOUT_KEY)
        batch = item.prompts
        for key in out.keys():
            batch[key] = out[key]
        metrics = {"timing_s/gen_wait": time.perf_counter() - wait_start, "rollout/buffer_depth": float(len(self.queue)),
                   **out.meta.pop("metrics", {})}
        batch.meta.update(out.meta, policy_version=item.version)
        mask = batch["response_mask"]
        if "rollout_policy_version" not in out:  # one call: every token sampled with the version it was submitted with
            batch["rollout_policy_version"] = torch.full(mask.shape, item.version, dtype=torch.long)  # [b, R]
        metrics.update(staleness_metrics(step, batch["rollout_policy_version"], mask))
        metrics.update(self._collect_syncs(self.submitted - len(self.queue)))  # syncs queued before a batch taken have run
        return batch, metrics

    def sync_weights(self, step: int) -> dict[str, float]:
        """After the update of `step`: the trained weights (policy version `step`) -> the rollout
        pool, queued behind the batches it is generating. The driver waits for the sync only when
        no later batch than the next step's is queued before it (then waiting costs nothing: the
        next step needs that batch first); otherwise it collects it once a batch after it is taken."""
        with self.lock:
            sync = self.weight_sync.start_rollout_sync()
            self.syncs.append((self.submitted, sync))
            self.version = step
        metrics = {"timing_s/sync_publish": sync.publish_s}
        if len(self.queue) <= 1:
            metrics.update(self.drain())
        return metrics

    def drain(self) -> dict[str, float]:
        """Wait for every sync submitted (the pool then holds the latest weights)."""
        return self._collect_syncs(self.submitted + 1)

    def _collect_syncs(self, batches_taken: int) -> dict[str, float]:
        """The metrics of the syncs submitted before batch number `batches_taken` (1-based count of
        batches submitted): a batch submitted after a sync has run, so the sync has (no wait)."""
        metrics: dict[str, float] = {}
        while self.syncs and self.syncs[0][0] < batches_taken:
            _, sync = self.syncs.popleft()
            metrics.update(sync.finish(self.timeout_s))
        return metrics


def staleness_metrics(step: int, versions: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Updates between the weights that sampled each response token and the update of `step`
    (which trains on top of step - 1 updates): the batch's, and per token min / mean / max."""
    lag = (step - 1 - versions)[mask.bool()].float()
    if not lag.numel():
        lag = (step - 1 - versions).flatten().float()
    return {"rollout/staleness": float(lag.max()), "rollout/staleness_min": float(lag.min()),
            "rollout/staleness_mean": float(lag.mean()), "rollout/staleness_max": float(lag.max())}


class _VersionedPool:
    """The rollout pool as the agent loop's group: each `generate_requests` call is submitted with
    the policy version the pool will sample it with (the syncs submitted before it), under the same
    lock as the syncs, and its completions carry that version."""

    def __init__(self, owner: AsyncRollout):
        self.owner = owner

    def generate_requests(self, data: Batch) -> Batch:
        o = self.owner
        with o.lock:
            version = o.version
            pending = o.rollout.submit("generate_requests", data)
        out = pending.result(o.timeout_s, f"a multi-turn request batch ({len(data)} requests, policy version {version})", REQUEST_TIMEOUT_KEY)
        return Batch.from_dict(non_tensors={"completion": [dataclasses.replace(c, policy_version=version) for c in out["completion"]]})


class _ThreadCall:
    """A batch's multi-turn rollout on a driver thread. Its wait has no deadline of its own: every
    request inside it has one (actor_rollout_ref.rollout.request_timeout_s), and tools theirs."""

    def __init__(self, future: concurrent.futures.Future):
        self.future = future

    def result(self, timeout_s: float | None = None, waiting_for: str = "", key: str = "") -> Batch:
        return self.future.result()
