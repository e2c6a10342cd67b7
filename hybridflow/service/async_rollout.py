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

Every batch records the versions that sampled it: `rollout_policy_version` [b, R] per response
token. One call samples a whole batch with one version; a multi-turn trajectory's turns (each a
call, on a driver thread per batch) may be sampled by different versions, and with
async_training.partial_rollout every request runs in segments (`rollout/partial.py`), so a sync
lands between two segments of a running response: the tokens it has keep their version, the rest
is sampled with the new weights. A version only grows within a response, so the oldest token of a
batch is its first, and the bound above holds per token.

The step's metrics: `rollout/staleness` (updates since the oldest sampling weights) with its
per-token min / mean / max, `rollout/mixed_version_rows` (responses sampled by more than one
version), `rollout/buffer_depth` (batches generated or in flight beyond this step's),
`timing_s/gen_wait` (the trainer waiting for its batch) and `rollout/trainer_idle_fraction` (that
wait over the time since the previous batch was taken), and `rollout/gen_idle_fraction` with one
`rollout/gen_idle_fraction/replica{d}` per generation replica (the share of the wall time between
the replica's calls, since the previous step, in which it was not generating). Every wait on the
pool has a deadline (actor_rollout_ref.rollout.request_timeout_s): past it the run stops with one
line naming the pool, its ranks, the step and the version it waited for.

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

from hybridflow.controller.worker_group import WorkerTimeoutError
from hybridflow.protocol import Batch, Completion, Request, SamplingParams
from hybridflow.rollout.base import generate_batch
from hybridflow.rollout.partial import generate_in_segments
from hybridflow.trainer.keys import PROMPT_KEYS
from hybridflow.service.replicas import REQUEST_TIMEOUT_KEY, ReplicaRestarted



@dataclass
class _InFlight:
    """One batch's generation on the rollout pool: its step, prompts and sampling parameters, the
    pool call, the policy version of the weights it samples with, and the loader's position before
    its prompts."""

    step: int
    prompts: Batch
    params: SamplingParams
    pending: Any
    version: int
    loader_state: Any


class AsyncRollout:
    def __init__(self, rollout: Any, weight_sync: Any, prompts: Callable[[], Batch], sampling: Callable[[int], SamplingParams],
                 total_steps: int, max_staleness: int = 1, timeout_s: float | None = None, loader_state: Callable[[], Any] = lambda: None,
                 agent: Any = None, partial_chunk: int | None = None, pad_id: int = 0, thread_deadline_s: float | None = None,
                 managers: Any = None):
        """rollout: the rollout pool's view (`submit(method, ...) -> Pending`); weight_sync:
        `start_rollout_sync() -> RolloutSync` (`trainer/weight_sync.py`); prompts(): the next batch
        of prompts (drawn from the loader); sampling(step): that step's sampling parameters;
        loader_state(): the loader's position (what a checkpoint stores); agent: a multi-turn
        rollout (`agent_rollout.AgentRollout`) whose trajectories run on a driver thread per batch,
        each turn a request to the pool tagged with the policy version it samples with (tool time
        overlaps the other batches' generation and the update); partial_chunk: partial rollout's
        segment length in tokens (None: off; on, single-turn batches run on driver threads too, and
        pad_id pads their responses); thread_deadline_s: the most a multi-turn or partial batch may take;
        managers: the rollout managers (`managers.ManagerPool`) that run the agent's
        trajectories off the driver (None: on a driver thread per batch)."""
        self.rollout, self.weight_sync, self.prompts, self.sampling = rollout, weight_sync, prompts, sampling
        self.total_steps, self.k, self.timeout_s, self.loader_state = total_steps, max_staleness, timeout_s, loader_state
        self.agent, self.partial_chunk, self.pad_id, self.thread_deadline_s = agent, partial_chunk, pad_id, thread_deadline_s
        self.managers = managers
        threaded = managers is None and (agent is not None or partial_chunk is not None)  # each batch's requests driven from a driver thread
        self.threads = concurrent.futures.ThreadPoolExecutor(max_staleness + 1, "async-rollout") if threaded else None
        self.lock = threading.Lock()  # the version and counters, read by the batch threads' pool calls (bookkeeping only)
        self.queue: collections.deque[_InFlight] = collections.deque()  # submitted, not yet trained: oldest first
        self.syncs: collections.deque[tuple[int, Any]] = collections.deque()  # (batches submitted before it, RolloutSync) not collected
        self.next_step = 1  # the step whose batch is submitted next
        self.version = 0  # weight syncs submitted to the pool: the version of the next batch submitted
        self.submitted = 0  # batches submitted so far
        self.resubmitted = 0  # generation calls submitted again after a replica restart (their first results unused)
        self.clocks = ReplicaClocks()  # the generation replicas' busy time since the last step
        self.last_take = time.perf_counter()

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
            floor = max(0, (self.next_step - 1) - self.k)  # the oldest version this batch may hold (syncs up to it are submitted)
            if self.managers is not None:  # the trajectories run on the rollout managers, off the driver
                pending = self.managers.submit(prompts, params, floor, self.thread_deadline_s)
            elif self.agent is not None:
                pending = _ThreadCall(self.threads.submit(self.agent.generate, _VersionedPool(self), prompts, params), self.thread_deadline_s)
            elif self.partial_chunk is not None:
                pending = _ThreadCall(self.threads.submit(generate_batch, _VersionedPool(self), prompts.select(PROMPT_KEYS), params, self.pad_id),
                                      self.thread_deadline_s)
            else:  # submitted from this thread, as the syncs are: the pool runs them in this order
                pending = self.rollout.submit("generate_sequences", prompts.select(PROMPT_KEYS), params)
            self.queue.append(_InFlight(self.next_step, prompts, params, pending, self.version, state))
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
        while True:
            try:
                out = item.pending.result(self.timeout_s, f"step {step}'s batch (sampled with policy version {item.version})", REQUEST_TIMEOUT_KEY)
                break
            except ReplicaRestarted:  # one pool call (single-turn): generate the whole batch again, with the weights held now
                with self.lock:
                    item.version, self.resubmitted = self.version, self.resubmitted + 1
                    item.pending = self.rollout.submit("generate_sequences", item.prompts.select(PROMPT_KEYS), item.params)
        batch = item.prompts
        for key in out.keys():
            batch[key] = out[key]
        now = time.perf_counter()
        wait = now - wait_start
        with self.lock:  # the threads' calls add to the clocks
            gen_metrics = self.clocks.take(out.meta.pop("metrics", {}))
        metrics = {"timing_s/gen_wait": wait, "rollout/trainer_idle_fraction": wait / max(now - self.last_take, 1e-9),
                   "rollout/buffer_depth": float(len(self.queue)), "rollout/resubmitted_calls": float(self.resubmitted), **gen_metrics}
        if hasattr(self.rollout, "metrics"):  # a ReplicaSet: its restarts so far
            metrics.update(self.rollout.metrics())
        self.last_take = now
        batch.meta.update(out.meta, policy_version=item.version)
        mask = batch["response_mask"]
        if "rollout_policy_version" not in out:  # one pool call: every token sampled with the version it was submitted with
            batch["rollout_policy_version"] = torch.full(mask.shape, item.version, dtype=torch.long)  # [b, R]
        metrics.update(staleness_metrics(step, batch["rollout_policy_version"], mask))
        if metrics["rollout/staleness_max"] > self.k:  # read from the replicas' own record: asserted, not assumed
            raise StalenessError(f"async rollout: step {step}'s batch has tokens sampled with policy version "
                                 f"{step - 1 - int(metrics['rollout/staleness_max'])}, {int(metrics['rollout/staleness_max'])} updates behind the "
                                 f"update that trains on it; async_training.max_staleness={self.k} allows at most {self.k}. A replica served "
                                 f"this batch with weights older than the syncs submitted before it: the rollout pool lost a sync")
        metrics.update(self._collect_syncs(self.submitted - len(self.queue)))  # syncs queued before a batch taken have run
        return batch, metrics

    def sync_weights(self, step: int) -> dict[str, float]:
        """After the update of `step`: the trained weights (policy version `step`) -> the rollout
        pool, queued behind the batches it is generating. The driver waits for the sync only when
        no later batch than the next step's is queued before it (then waiting costs nothing: the
        next step needs that batch first); otherwise it collects it once a batch after it is taken."""
        published = self.weight_sync.publish_for_rollout(step)  # the slow half (crop, cast, checksums, ray.put): no lock held
        with self.lock:  # the receipt queued and the version counted as one step: a call submitted after it samples with these weights
            sync = published.submit()
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
    valid = mask.bool()
    lag = (step - 1 - versions)[valid].float()
    if not lag.numel():
        lag = (step - 1 - versions).flatten().float()
    big = torch.iinfo(versions.dtype).max
    newest = torch.where(valid, versions, -1).max(dim=1).values  # [b]
    oldest = torch.where(valid, versions, big).min(dim=1).values  # [b]
    mixed = ((newest > oldest) & valid.any(dim=1)).sum()
    return {"rollout/staleness": float(lag.max()), "rollout/staleness_min": float(lag.min()),
            "rollout/staleness_mean": float(lag.mean()), "rollout/staleness_max": float(lag.max()),
            "rollout/mixed_version_rows": float(mixed)}


class _VersionedPool:
    """The rollout pool as the agent loop's group (and, with partial rollout, as the backend that
    `generate_batch` calls): each pool call is submitted with the policy version the pool will
    sample it with (the syncs submitted before it), under the same lock as the syncs, and its
    completions carry that version per token; with partial rollout a request is several calls."""

    def __init__(self, owner: AsyncRollout):
        self.owner = owner

    def call(self, requests: list[Request]) -> tuple[list[Completion], int]:
        """One pool call, submitted again (with the version held then) if a replica restarts during it."""
        o = self.owner
        data = Batch.from_dict(non_tensors={"request": requests})
        while True:
            # The version and the submission as one step, as a sync's receipt and its version are: a sync
            # submitted between them would reach the replica first, and a replica that stamps no version
            # (taken to hold this one) would sample with newer weights than recorded. The submission only
            # queues the call (its requests pickled: small); the replica's work runs outside the lock.
            with o.lock:
                version = o.version
                pending = o.rollout.submit("generate_requests", data)
            try:
                out = pending.result(o.timeout_s, f"{len(requests)} generation requests (policy version {version})", REQUEST_TIMEOUT_KEY)
                break
            except ReplicaRestarted:
                with o.lock:
                    o.resubmitted += 1
        with o.lock:
            o.clocks.add(out.meta.get("metrics", {}))
        return [c if c.versions is not None else dataclasses.replace(c, versions=(version,) * len(c.token_ids)) for c in out["completion"]], version

    def complete(self, requests: list[Request]) -> list[Completion]:
        if self.owner.partial_chunk is not None:
            return generate_in_segments(requests, self.call, self.owner.partial_chunk)
        return self.call(requests)[0]

    def generate_requests(self, data: Batch | list[Request]) -> Batch | list[Completion]:
        """The agent loop's group call (a Batch with a "request" column -> one with "completion"),
        or the backend call of `generate_batch` (requests -> completions)."""
        if isinstance(data, Batch):
            return Batch.from_dict(non_tensors={"completion": self.complete(list(data["request"]))})
        return self.complete(list(data))


class ReplicaClocks:
    """The generation replicas' busy and wall seconds, summed over the calls that returned since the
    last step: each call reports `rollout/replica{d}/busy_s` (generating) and `.../span_s` (since
    the replica's previous call ended), so busy / span is the replica's share of time generating."""

    PREFIX = "rollout/replica"

    def __init__(self):
        self.busy: dict[str, float] = collections.defaultdict(float)
        self.span: dict[str, float] = collections.defaultdict(float)

    def add(self, metrics: dict[str, float]) -> dict[str, float]:
        """Sum a call's replica clocks; returns its other metrics."""
        rest = {}
        for key, value in metrics.items():
            if key.startswith(self.PREFIX) and key.endswith(("/busy_s", "/span_s")):
                replica, _, kind = key[len(self.PREFIX):].rpartition("/")
                (self.busy if kind == "busy_s" else self.span)[replica] += value
            else:
                rest[key] = value
        return rest

    def take(self, metrics: dict[str, float]) -> dict[str, float]:
        """A step's generation metrics: `metrics` (a batch's own call, if any) less the clocks, plus
        the idle fraction per replica since the last step and their mean; the sums restart."""
        out = self.add(metrics)
        idle = {f"rollout/gen_idle_fraction/replica{r}": max(0.0, 1.0 - self.busy[r] / self.span[r]) for r in sorted(self.span) if self.span[r] > 0}
        if idle:
            out.update(idle, **{"rollout/gen_idle_fraction": sum(idle.values()) / len(idle)})
        self.busy.clear()
        self.span.clear()
        return out


class StalenessError(RuntimeError):
    """A trained batch holds tokens older than async_training.max_staleness allows."""


class _ThreadCall:
    """A batch's rollout on a driver thread (multi-turn, or partial). Every pool call inside it has
    a deadline (actor_rollout_ref.rollout.request_timeout_s), tools and environments theirs
    (multi_turn.tool_timeout_s), black-box agents theirs (agent.timeout_s); the batch as a whole
    has `deadline_s`, what those allow its longest trajectory (None: no limit)."""

    def __init__(self, future: concurrent.futures.Future, deadline_s: float | None):
        self.future, self.deadline_s = future, deadline_s

    def result(self, timeout_s: float | None = None, waiting_for: str = "", key: str = "") -> Batch:
        try:
            return self.future.result(timeout=self.deadline_s)
        except concurrent.futures.TimeoutError:
            raise WorkerTimeoutError(f"{waiting_for or 'a batch'}: its rollout on a driver thread did not finish within {self.deadline_s:.0f} s, "
                                     "what its longest trajectory may take (multi_turn.max_assistant_turns x (request_timeout_s + "
                                     "multi_turn.tool_timeout_s), or agent.timeout_s): something it waits for has no deadline of its own",
                                     ()) from None


def record_batch_uids(rollout: AsyncRollout) -> tuple[list[tuple], list[tuple]]:
    """Wrap `rollout`'s prompts and take so that each batch's uids are recorded when drawn from the
    loader and when taken for training; returns the two lists, appended to as the run goes. What fault
    benches and tests check: every batch drawn trained once and in order (drawn == trained)."""
    drawn: list[tuple] = []
    trained: list[tuple] = []
    prompts, take = rollout.prompts, rollout.take

    def drawing() -> Batch:
        batch = prompts()
        drawn.append(tuple(batch.non_tensors["uid"]))
        return batch

    def taking(step: int) -> tuple[Batch, dict[str, float]]:
        batch, metrics = take(step)
        trained.append(tuple(batch.non_tensors["uid"]))
        return batch, metrics

    rollout.prompts, rollout.take = drawing, taking
    return drawn, trained
