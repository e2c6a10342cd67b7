"""Rollout managers: multi-turn rollouts off the driver (actor_rollout_ref.rollout.agent.num_workers,
verl's name; trainer.async_rollout with generation replicas of one process).

N manager actors (Ray, asyncio: one event loop each) run the agent loops, the OpenAI-compatible
endpoint (one per manager, started once: one URL for the whole run), its sessions, the tools and
environments. A batch's trajectories are sharded over the managers (row i to manager i mod N; a
trajectory is one session, so all its turns stay on one manager), and each manager sends its
requests straight to the generation replicas (`ReplicaClient`: a session to the replica that served
it, others to the least loaded). The driver submits a batch, takes the finished trajectories with
their versions, and does nothing per turn.

Versions and the staleness bound: every completion carries the policy version its replica held when
it sampled (stamped on the replica, `workers/rollout.py`). A batch of step s may use no version below
its floor (s - 1) - k; the driver submits it only after the sync of that version was submitted to the
replicas, but a manager's request is another caller's, so it may reach a replica before that sync
does: then its completion is older than the floor and is sampled again (`rollout/stale_retries`),
until the replica holds the floor (at most request_timeout_s, else the run stops naming it). A
manager keeps the highest floor of the batches it was given: a request never samples below it.

Faults:
- a replica that dies or does not answer within request_timeout_s: the manager stops routing to it,
  sends the lost requests to the other replicas, and reports it; the driver restarts it (the
  ReplicaSet that owns the replicas and their incarnations) and tells every manager the new actor;
- a manager that dies (SIGKILL, out of memory): its shard of the batch is lost; the driver starts a
  new manager in its slot and runs that shard again (`rollout/rerun_trajectories`): the batch is
  assembled only from finished shards, so no trajectory is trained twice; the rerun samples with the
  weights the replicas hold now, never older than the batch's floor.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from hybridflow.agent.loop import RequestBatcher, run_trajectories
from hybridflow.agent.threads import in_own_thread
from hybridflow.config.schema import AgentConfig, MultiTurnConfig
from hybridflow.controller.worker_group import WorkerCallError, WorkerDiedError, WorkerTimeoutError
from hybridflow.protocol import Batch, Completion, Request, SamplingParams
from hybridflow.rollout.partial import generate_in_segments
from hybridflow.service.agent_rollout import PackedTrajectories, agent_settings, pack_trajectories

logger = logging.getLogger("hybridflow")

MAX_SESSIONS = 100_000  # sessions remembered for routing (the oldest forgotten first)
START_TIMEOUT_S = 300.0  # a manager's start: a process, its imports, the tokenizer, the endpoint


@dataclass(frozen=True)
class ManagerSpec:
    """What a manager builds itself from (sent once, when it starts)."""

    multi_turn: MultiTurnConfig
    agent: AgentConfig
    max_response_length: int
    max_prompt_length: int
    tokenizer_path: str
    model_name: str
    role: str  # the replicas' role in their group: their method is "<role>__generate_requests"
    request_timeout_s: float | None  # actor_rollout_ref.rollout.request_timeout_s
    base_params: SamplingParams  # the run's sampling settings (the endpoint's stop ids; tool loops get the batch's own)
    partial_chunk: int | None = None  # async_training.partial_rollout's segment length (None: off)


# ---------------------------------------------------------------------- a manager's view of the replicas
class ReplicaClient:
    """Routes requests to the generation replicas and checks the version each completion was sampled
    with against the floor. One lock, held for the bookkeeping alone (never across a call)."""

    def __init__(self, handles: Sequence[Any], incarnations: Sequence[int], role: str, timeout_s: float | None):
        self.role, self.timeout_s = role, timeout_s
        self.lock = threading.Lock()
        self.handles, self.incarnation = list(handles), list(incarnations)
        self.failed: set[int] = set()  # replicas found dead or hung, until the driver replaces them
        self.faults: list[tuple[int, int, str]] = []  # (replica, incarnation, why): not yet reported to the driver
        self.load = [0] * len(self.handles)  # requests in flight per replica
        self.sessions: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.floor = 0  # no completion below this policy version is accepted
        self.stale_retries = 0
        self.lost_requests = 0  # sent again after their replica failed
        self.busy: dict[str, float] = collections.defaultdict(float)  # the replicas' clocks (`async_rollout.ReplicaClocks`)
        self.on_fault: Any = None  # called (no arguments) once a fault is recorded: the manager wakes the driver's wait

    def raise_floor(self, version: int) -> None:
        with self.lock:
            self.floor = max(self.floor, version)

    def set_replica(self, rank: int, handle: Any, incarnation: int) -> None:
        """The driver restarted replica `rank`: its new actor."""
        with self.lock:
            if incarnation >= self.incarnation[rank]:
                self.handles[rank], self.incarnation[rank] = handle, incarnation
                self.failed.discard(rank)

    def take_faults(self) -> list[tuple[int, int, str]]:
        with self.lock:
            out, self.faults = self.faults, []
            return out

    def _fault(self, rank: int, incarnation: int, why: str) -> None:
        with self.lock:
            if incarnation != self.incarnation[rank] or rank in self.failed:
                return
            self.failed.add(rank)
            self.faults.append((rank, incarnation, why))
        if self.on_fault is not None:
            self.on_fault()

    def _route(self, requests: list[Request], todo: list[int]) -> dict[int, tuple[Any, int, list[int]]] | None:
        """replica -> (its actor, its incarnation, the indices of `todo` it serves); None: no replica is up."""
        with self.lock:
            live = [d for d in range(len(self.handles)) if d not in self.failed]
            if not live:
                return None
            parts: dict[int, list[int]] = {}
            for i in todo:
                session = requests[i].session
                d = self.sessions.get(session) if session is not None else None
                if d is None or d in self.failed:
                    d = min(live, key=lambda r: (self.load[r], r))
                if session is not None:
                    self.sessions[session] = d
                    self.sessions.move_to_end(session)
                    if len(self.sessions) > MAX_SESSIONS:
                        self.sessions.popitem(last=False)
                self.load[d] += 1
                parts.setdefault(d, []).append(i)
            return {d: (self.handles[d], self.incarnation[d], idx) for d, idx in parts.items()}

    async def call(self, requests: list[Request]) -> list[Completion]:
        """The completions of `requests`, in order, awaited on the manager's event loop (no thread
        per call). Lost requests go to another replica; stale completions are sampled again."""
        import ray

        out: list[Completion | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        waiting_since = None  # no replica up, or only stale answers, since then
        while todo:
            parts = self._route(requests, todo)
            if parts is None:
                waiting_since = waiting_since or time.monotonic()
                self._check_wait(waiting_since, "no generation replica is up (each failed and is being restarted by the driver)")
                await asyncio.sleep(0.05)
                continue
            calls = {}  # task awaiting a replica's reply -> (replica, incarnation, request indices, actor, object ref)
            for d, (h, inc, idx) in parts.items():
                ref = getattr(h, f"{self.role}__generate_requests").remote(Batch.from_dict(non_tensors={"request": [requests[i] for i in idx]}))
                calls[asyncio.ensure_future(_awaited(ref))] = (d, inc, idx, h, ref)
            ready, late = await self._replies(calls)
            redo, stale = [], 0
            for task, why in late.items():
                task.cancel()
                d, inc, idx, _, _ = calls[task]
                self._fault(d, inc, why)
                redo += idx
            for task in ready:
                d, inc, idx, _, _ = calls[task]
                try:
                    batch = task.result()
                except ray.exceptions.RayActorError as e:
                    self._fault(d, inc, f"died: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")
                    redo += idx
                    continue
                with self.lock:
                    floor = self.floor
                    for k, v in batch.meta.get("metrics", {}).items():
                        self.busy[k] += v
                for i, c in zip(idx, batch["completion"]):
                    if c.versions and min(c.versions) < floor:
                        redo.append(i)
                        stale += 1
                    else:
                        out[i] = c
            with self.lock:
                for d, (_, _, idx) in parts.items():
                    self.load[d] -= len(idx)
                self.stale_retries += stale
                self.lost_requests += len(redo) - stale
            if stale and len(redo) == stale:  # only stale answers: the replicas' sync is on its way
                waiting_since = waiting_since or time.monotonic()
                self._check_wait(waiting_since, f"the replicas still hold weights older than policy version {floor}, the batch's floor")
                await asyncio.sleep(0.02)
            else:
                waiting_since = None
            todo = sorted(redo)
        return out  # type: ignore[return-value]

    async def _replies(self, calls: dict) -> tuple[set, dict]:
        """Wait for the replicas' replies under request_timeout_s counted from when each call starts
        executing on its replica (asked of the replica when the deadline passes: a call queued behind
        others is waited for; one running too long, or a replica that does not answer or is dead, is
        late). Returns (the finished tasks, late task -> why)."""
        from hybridflow.controller.worker_group import call_progress

        pending, ready, late = set(calls), set(), {}
        wait_s = self.timeout_s
        while pending:
            done, pending = await asyncio.wait(pending, timeout=wait_s)
            ready |= done
            if not pending:
                break
            order = list(pending)
            progress = await asyncio.to_thread(call_progress, [(calls[t][3], calls[t][4]) for t in order], self.timeout_s)
            waits = []
            for t, (state, x) in zip(order, progress):
                if state == "wait":
                    waits.append(float(x))
                else:
                    late[t] = f"{x or 'no reply'} (actor_rollout_ref.rollout.request_timeout_s={self.timeout_s})"
                    pending.discard(t)
            wait_s = min(waits) if waits else None
        return ready, late

    def _check_wait(self, since: float, what: str) -> None:
        if self.timeout_s is not None and time.monotonic() - since > self.timeout_s:
            raise WorkerTimeoutError(f"rollout manager: {what}, for {self.timeout_s} s (actor_rollout_ref.rollout.request_timeout_s)", ())

    def take_clocks(self) -> dict[str, float]:
        """The replicas' clocks and this client's counts since the last take (summed over a step's shards)."""
        with self.lock:
            out, self.busy = dict(self.busy), collections.defaultdict(float)
            out["rollout/stale_retries"], out["rollout/lost_requests"] = float(self.stale_retries), float(self.lost_requests)
            self.stale_retries = self.lost_requests = 0
            return out


async def _awaited(ref: Any) -> Any:
    return await ref


@dataclass
class ShardResult:
    """What a manager returns for its shard of a batch."""

    packed: PackedTrajectories  # the shard's trajectories as tensors, in its row order
    trajectories: Any  # a Ray ref to them as objects (the manager's; read only through AgentRollout.last)
    generate_calls: int  # backend calls of its tool loops' batcher
    latencies: list[float]  # its model turns' (seconds; a black-box agent's: its endpoint's since the last shard)
    clocks: dict[str, float]  # the replicas' busy / span seconds and the client's counts


# ---------------------------------------------------------------------- the manager (a Ray actor's body)
class RolloutManager:
    """One manager: its endpoint (a black-box agent's), its sessions and agent loops, on its own
    asyncio loop; batches' shards come in as `generate` calls and run concurrently."""

    def __init__(self, spec: ManagerSpec, index: int, handles: Sequence[Any], incarnations: Sequence[int]):
        from transformers import AutoTokenizer

        from hybridflow.agent.tools import load_tool_config

        self.spec, self.index = spec, index
        self.tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path)
        endpoint_port = spec.agent.port + index if spec.agent.port else 0  # one fixed port per manager, kept for the whole run
        agent = dataclasses.replace(spec.agent, port=endpoint_port)
        self.settings = agent_settings(spec.multi_turn, spec.max_response_length, agent, spec.max_prompt_length, spec.model_name)
        self.tools = load_tool_config(spec.multi_turn.tool_config_path) if spec.multi_turn.tool_config_path else []
        self.client = ReplicaClient(handles, incarnations, spec.role, spec.request_timeout_s)
        self.faulted: asyncio.Event | None = None  # set when the client records a replica fault (made on the actor's loop)
        # A call per replica at once: a turn that arrives while a call runs goes out without waiting for it
        # (a replica that batches continuously takes it into its running batch; one that does not queues it).
        self.calls_in_flight = len(handles)
        self.stack = contextlib.AsyncExitStack()
        self.endpoint = None
        self.turns = 0  # backend requests served (model turns of every trajectory)

    async def start(self) -> str:
        """Start the endpoint (with a black-box agent): its URL, the same for every batch."""
        if self.settings.black_box is None:
            return ""
        from hybridflow.agent.openai_server import LiveEndpoint

        batcher = RequestBatcher(self._generate_fn, self.spec.base_params, self.calls_in_flight)
        self.endpoint = await self.stack.enter_async_context(LiveEndpoint(self.settings.endpoint, self.tokenizer, batcher).serve())
        return self.endpoint.base_url

    async def _generate_fn(self, requests: list[Request]) -> list[Completion]:
        self.turns += len(requests)
        if self.spec.partial_chunk is None:
            return await self.client.call(requests)
        # Partial rollout: the requests in segments (rollout/partial.py), each segment a call awaited on this loop;
        # every token's version is the replica's stamp.
        loop = asyncio.get_running_loop()

        def call(segment: list[Request]) -> tuple[list[Completion], int]:
            return asyncio.run_coroutine_threadsafe(self.client.call(segment), loop).result(), -1

        return await in_own_thread(generate_in_segments, requests, call, self.spec.partial_chunk)

    async def generate(self, rows: list[dict], params: SamplingParams, floor: int) -> ShardResult:
        """A shard's trajectories (in row order), its backend calls, its turns' latencies and the replicas' clocks."""
        self.client.raise_floor(floor)
        resources = {"openai_agent": self.endpoint} if self.endpoint is not None else None
        trajs, batcher = await run_trajectories(rows, self._generate_fn, self.tokenizer, self.settings, params, self.tools, resources,
                                                self.calls_in_flight)
        latencies = batcher.take_latencies() + (self.endpoint.batcher.take_latencies() if self.endpoint is not None else [])
        import ray

        packed = pack_trajectories(trajs, int(self.tokenizer.pad_token_id), self.settings.response_budget)  # tensors: cheap for the driver to take
        return ShardResult(packed, ray.put(trajs), batcher.calls, latencies, self.client.take_clocks())

    def set_replica(self, rank: int, handle: Any, incarnation: int) -> None:
        self.client.set_replica(rank, handle, incarnation)

    async def next_faults(self) -> list[tuple[int, int, str]]:
        """The replica faults found since the last answer, once there is one: the driver keeps one such call
        in flight per manager and waits on it with its batches (pushed, not polled: no driver work per turn)."""
        if self.faulted is None:
            self.faulted = asyncio.Event()
            self.client.on_fault = self.faulted.set
        while True:
            faults = self.client.take_faults()
            if faults:
                return faults
            self.faulted.clear()
            await self.faulted.wait()

    def stats(self) -> dict[str, float]:
        """This process: its pid, CPU seconds and the requests it served."""
        return {"pid": float(os.getpid()), "cpu_s": time.process_time(), "turns": float(self.turns)}

    async def stop(self) -> None:
        await self.stack.aclose()


# ---------------------------------------------------------------------- the driver's side
class ManagerPool:
    """The driver's handle on the managers: starts them, shards a batch over them, restarts one that
    dies (its shard run again), and restarts the replicas they report (through the ReplicaSet)."""

    def __init__(self, spec: ManagerSpec, n: int, replicas: Any, max_restarts: int, agent: Any):
        """replicas: the ReplicaSet (owns the replicas and their restarts); agent: the driver's
        AgentRollout (its settings and tokenizer build the batch from the trajectories)."""
        import ray

        self.spec, self.replicas, self.max_restarts, self.agent = spec, replicas, max_restarts, agent
        self.remote_cls = ray.remote(RolloutManager)
        self.restarts = [0] * n  # per manager slot: also its incarnation (a call to an older one is merely resubmitted)
        self.rerun_trajectories = 0
        self.lock = threading.Lock()  # the actors list vs a restart (the replica listener runs on the driver's threads)
        self.watching: dict[Any, tuple[int, int]] = {}  # a `next_faults` call in flight per manager: ref -> (manager, incarnation)
        self.lost: set[int] = set()  # managers whose watch found them dead, until restarted
        self.actors: list[Any] = [None] * n
        self.urls: list[str] = [""] * n
        for i in range(n):
            self._start(i)
        replicas.listeners.append(self._replica_restarted)

    def _start(self, i: int) -> None:
        import ray

        handles, incarnations = self.replicas.handles()
        actor = self.remote_cls.options(num_cpus=0, max_concurrency=10_000).remote(self.spec, i, handles, incarnations)
        url = ray.get(actor.start.remote(), timeout=START_TIMEOUT_S)
        with self.lock:
            self.actors[i], self.urls[i] = actor, url

    def _replica_restarted(self, rank: int, handle: Any) -> None:
        incarnation = self.replicas.incarnation[rank]
        with self.lock:
            actors = list(self.actors)
        for a in actors:
            a.set_replica.remote(rank, handle, incarnation)

    def submit(self, prompts: Batch, params: SamplingParams, floor: int, deadline_s: float | None = None) -> "ManagerCall":
        from hybridflow.service.agent_rollout import agent_rows

        rows = agent_rows(prompts)
        n = len(self.actors)
        shards = [list(range(i, len(rows), n)) for i in range(n)]
        return ManagerCall(self, rows, shards, params, floor, deadline_s)

    def fault_refs(self) -> dict[Any, tuple[int, int]]:
        """One `next_faults` call in flight per live manager (ref -> (manager, its incarnation)): what the
        driver's wait watches besides its batches."""
        with self.lock:
            watched = {i for i, _ in self.watching.values()}
            for i, a in enumerate(self.actors):
                if i not in watched and i not in self.lost:
                    self.watching[a.next_faults.remote()] = (i, self.restarts[i])
            return dict(self.watching)

    def faults_reported(self, ref: Any) -> None:
        """A manager's `next_faults` answered: restart the replicas it found dead or hung (each once)."""
        import ray

        with self.lock:
            i, incarnation = self.watching.pop(ref, (None, None))
        try:
            reported = ray.get(ref)
        except ray.exceptions.RayError:  # its manager died: not watched again until a batch's wait restarts it
            with self.lock:
                if i is not None and incarnation == self.restarts[i]:
                    self.lost.add(i)
            return
        for rank, incarnation, why in reported:
            seen = list(self.replicas.incarnation)
            seen[rank] = incarnation
            self.replicas.recover(WorkerDiedError(f"rollout replica {rank}: {why}", (rank,)), seen)

    def restart_manager(self, i: int, seen: int, error: Exception) -> None:
        """Manager `i` (in incarnation `seen`) died: a new one in its slot, unless another call found it first."""
        import ray

        if self.restarts[i] != seen:
            return
        if self.restarts[i] >= self.max_restarts:
            raise WorkerCallError(f"rollout manager {i} failed after {self.restarts[i]} restart(s), the most "
                                  f"async_training.max_replica_restarts allows: {error}", ()) from None
        self.restarts[i] += 1
        logger.warning("rollout manager %d: %s; restarting it (restart %d of at most %d); its unfinished trajectories run again",
                       i, str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__, self.restarts[i], self.max_restarts)
        with contextlib.suppress(Exception):
            ray.kill(self.actors[i], no_restart=True)
        with self.lock:  # its fault watch died with it
            self.watching = {ref: w for ref, w in self.watching.items() if w[0] != i}
        self._start(i)
        with self.lock:
            self.lost.discard(i)

    def pids(self) -> list[int]:
        import ray

        return [int(s["pid"]) for s in ray.get([a.stats.remote() for a in self.actors])]

    def stats(self) -> list[dict[str, float]]:
        import ray

        return ray.get([a.stats.remote() for a in self.actors])

    def metrics(self) -> dict[str, float]:
        return {"rollout/manager_restarts": float(sum(self.restarts)), "rollout/rerun_trajectories": float(self.rerun_trajectories)}

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.get(a.stop.remote(), timeout=10)
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        self.actors = []


class ManagerCall:
    """One batch on the managers: a shard per manager; `result()` assembles the batch once every
    shard finished (a shard lost with its manager is run again on the manager's replacement)."""

    def __init__(self, pool: ManagerPool, rows: list[dict], shards: list[list[int]], params: SamplingParams, floor: int,
                 deadline_s: float | None):
        self.pool, self.rows, self.shards, self.params, self.floor, self.deadline_s = pool, rows, shards, params, floor, deadline_s
        self.started = time.monotonic()
        self.refs: dict[Any, tuple[int, int]] = {}  # in flight: ref -> (shard = manager index, the manager's incarnation)
        self.done: dict[int, ShardResult] = {}
        for i, shard in enumerate(shards):
            if shard:
                self._submit(i)

    def _submit(self, i: int) -> None:
        rows = [self.rows[j] for j in self.shards[i]]
        self.refs[self.pool.actors[i].generate.remote(rows, self.params, self.floor)] = (i, self.pool.restarts[i])

    def result(self, timeout_s: float | None = None, waiting_for: str = "", key: str = "") -> Batch:
        import ray

        while self.refs:
            left = None if self.deadline_s is None else self.deadline_s - (time.monotonic() - self.started)
            if left is not None and left <= 0:
                raise WorkerTimeoutError(f"{waiting_for or 'a batch'}: the rollout managers did not finish within {self.deadline_s:.0f} s, what "
                                         "its longest trajectory may take", ())
            watched = self.pool.fault_refs()
            ready, _ = ray.wait(list(self.refs) + list(watched), num_returns=1, timeout=left)
            for ref in ready:
                if ref in watched:  # a manager found replicas dead or hung
                    self.pool.faults_reported(ref)
                    continue
                i, seen = self.refs.pop(ref)
                try:
                    self.done[i] = ray.get(ref)
                except ray.exceptions.RayActorError as e:  # the manager died: its shard again, on a new one
                    self.pool.restart_manager(i, seen, e)
                    self.pool.rerun_trajectories += len(self.shards[i])
                    self._submit(i)
        calls, clocks, latencies = 0, collections.defaultdict(float), []
        for part in self.done.values():
            calls += part.generate_calls
            latencies += part.latencies
            for k, v in part.clocks.items():
                clocks[k] += v
        out = self.pool.agent.merge([(self.shards[i], part.packed, part.trajectories) for i, part in self.done.items()], self.params, calls, latencies)
        out.meta["metrics"] = {**out.meta["metrics"], **clocks, **self.pool.metrics()}
        return out
