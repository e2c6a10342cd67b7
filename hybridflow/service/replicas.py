"""The rollout pool as replicas that survive faults (trainer.async_rollout, one process per replica:
actor_rollout_ref.rollout.tensor_model_parallel_size=1).

Every call on the pool goes through `ReplicaSet.submit`. Request-level generation
(`generate_requests`: agent turns, partial rollout's segments) is routed per request: a request of a
session (`Request.session`: a trajectory's turns, a paused response's segments) goes to the replica
that served the session before (its prefix may be cached there), any other to the replica with the
fewest requests in flight, so a slow replica gets fewer; each replica gets one call with its
requests. Batch generation (`generate_sequences`) and weight syncs keep the pool's dispatch (rows
split evenly over the replicas; a sync to every replica).

When a call finds a replica dead (its process SIGKILLed, out of memory) or not finished within its
deadline (actor_rollout_ref.rollout.request_timeout_s: a replica that stopped making progress), the
replica is killed and started again in its slot, loads the model and receives the latest weights
(the last sync's object refs, kept here), and then:

- a generation call raises `ReplicaRestarted`: its work is lost, nothing of it is used, and the
  caller submits it again (`async_rollout.py`, under its version lock: the new call samples with the
  weights the pool holds then, and records that version, so the staleness bound still holds);
- a weight sync counts as received by the restarted replica (it got the latest weights, which are
  this sync's or a later one's); a weight check (fingerprints) is taken again.

A replica restarted more than async_training.max_replica_restarts times stops the run with one line
naming it. Replicas of gen_tp > 1 processes share a process group and are not replaced (a failure
stops the run, naming the rank, as before).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

from hybridflow.controller.worker_group import Pending, WorkerCallError, WorkerDiedError, WorkerTimeoutError
from hybridflow.protocol import Batch

logger = logging.getLogger("hybridflow")

SYNC_METHODS = ("receive_weights", "weight_fingerprints")
REQUEST_TIMEOUT_KEY = "actor_rollout_ref.rollout.request_timeout_s"  # the deadline of every wait on generation
MAX_SESSIONS = 100_000  # sessions remembered for routing (the oldest forgotten first)
# A restart has two bounds: the new process's start (a Ray actor: an interpreter importing torch; it took
# over 8 s on a loaded 2-core machine, and an actor being constructed answers no probe) within
# PROCESS_START_S, then its init and weight calls within timeout_s (request_timeout_s, counted from their
# start on the worker as every call's deadline). A caller waiting for a restart another caller runs waits
# for both, so it never gives up on a restart that is still in time.
PROCESS_START_S = 60.0


class ReplicaRestarted(WorkerCallError):
    """Replicas died or stalled during a generation call and were restarted with the latest
    weights: the call's results are lost; submit it again."""


class ReplicaSet:
    def __init__(self, group: Any, role: str, max_restarts: int, timeout_s: float | None):
        """group: the rollout pool's worker group (`RayWorkerGroup`, its role `role`); max_restarts:
        the most restarts of one replica; timeout_s: the deadline of a restarted replica's start."""
        self.group, self.role, self.max_restarts, self.timeout_s = group, role, max_restarts, timeout_s
        self.view = group.role(role)
        self.world_size = group.world_size
        self.pool = group.pool
        # Guards the bookkeeping below, held for it alone: never across a submission (pickling), a
        # restart (a process start, a model load, a weight receipt) or a wait for results.
        self.cond = threading.Condition()
        self.incarnation = [0] * self.world_size  # restarts so far, per replica
        self.restarting: set[int] = set()  # replicas being restarted: calls to them wait, routed requests go elsewhere
        self.latest: tuple[tuple, dict] | None = None  # the last receive_weights call's arguments
        self.restarts = 0
        self.receipts: dict[int, dict] = {}  # a restarted replica's receipt of the latest weights
        self.outstanding: list[tuple[Any, int, int]] = []  # (object ref, replica, requests) of routed parts not finished yet
        self.sessions: collections.OrderedDict[str, int] = collections.OrderedDict()  # session -> the replica that served it
        self.listeners: list[Callable[[int, Any], None]] = []  # told (replica, its new actor handle) after a restart

    def submit(self, method: str, *args, **kwargs) -> "_Recovering":
        if method == "generate_requests":
            seen, pending = self._route(args[0])
            return _Recovering(self, method, args, kwargs, pending, seen)
        with self.cond:
            self._wait_for_restarts(range(self.world_size), f"{method} on every rollout replica")
            if method == "receive_weights":
                self.latest = (args, kwargs)
            seen = list(self.incarnation)
        # A call that reaches a replica restarted since `seen` fails or is superseded; `recover` then
        # restarts nothing more, and the caller submits it again.
        pending = self.view.submit(method, *args, **kwargs)
        # Replicas share no collective: one that finishes later than another on a long tail is not a
        # straggler (trainer.collective_timeout_s); only the caller's deadline (request_timeout_s) holds.
        pending.straggler_timeout_s = None
        return _Recovering(self, method, args, kwargs, pending, seen)

    def _wait_for_restarts(self, ranks, what: str) -> None:
        """Under self.cond: until none of `ranks` is being restarted (at most a process start + timeout_s,
        the restart's own bound)."""
        wanted = set(ranks)
        bound = None if self.timeout_s is None else PROCESS_START_S + self.timeout_s
        if not self.cond.wait_for(lambda: not (self.restarting & wanted), bound):
            raise WorkerTimeoutError(f"{what}: rollout replica(s) {sorted(self.restarting & wanted)} (pool {self.pool.name!r}) did not "
                                     f"restart within {bound:.0f} s (a process start + actor_rollout_ref.rollout.request_timeout_s)",
                                     tuple(sorted(self.restarting & wanted)))

    def _route(self, data: Batch) -> tuple[list[int], Pending]:
        """One call per replica with the requests routed to it; the completions come back in order.
        A replica being restarted gets none (unless every one is: then they wait for it)."""
        requests = list(data["request"])
        finished = self._finished_parts()
        with self.cond:
            self.outstanding = [o for o in self.outstanding if o[0] not in finished]
            if len(self.restarting) == self.world_size:
                self._wait_for_restarts(range(self.world_size), "generation requests")
            live = [d for d in range(self.world_size) if d not in self.restarting]
            load = [0] * self.world_size
            for _, d, n in self.outstanding:
                load[d] += n
            routed = []
            for r in requests:
                replica = self.sessions.get(r.session) if r.session is not None else None
                if replica is None or replica in self.restarting:
                    replica = min(live, key=lambda d: (load[d], d))
                if r.session is not None:
                    self.sessions[r.session] = replica
                    self.sessions.move_to_end(r.session)
                    if len(self.sessions) > MAX_SESSIONS:
                        self.sessions.popitem(last=False)
                load[replica] += 1
                routed.append(replica)
            ranks = sorted(set(routed))
            seen = list(self.incarnation)
            workers = [self.group.workers[d] for d in ranks]
        refs = [getattr(w, f"{self.role}__generate_requests").remote(  # pickled here, outside the lock
            Batch.from_dict(non_tensors={"request": [r for r, to in zip(requests, routed) if to == d]})) for w, d in zip(workers, ranks)]
        with self.cond:
            self.outstanding += [(ref, d, routed.count(d)) for ref, d in zip(refs, ranks)]

        def collect(results: list[Batch]) -> Batch:
            parts = {d: iter(out["completion"]) for d, out in zip(ranks, results)}
            metrics = {k: v for out in results for k, v in out.meta.get("metrics", {}).items()}  # per-replica keys
            return Batch.from_dict(non_tensors={"completion": [next(parts[d]) for d in routed]}, meta={"metrics": metrics})

        return seen, Pending(refs, collect, f"{self.role}__generate_requests", self.pool.name, ranks=ranks)

    def _finished_parts(self) -> set:
        """The routed parts that finished (or failed): they no longer load their replica."""
        with self.cond:
            refs = [ref for ref, _, _ in self.outstanding]
        if not refs:
            return set()
        import ray

        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return set(done)

    def load(self) -> list[int]:
        """Requests routed to each replica whose part has not finished."""
        finished = self._finished_parts()
        with self.cond:
            self.outstanding = [o for o in self.outstanding if o[0] not in finished]
            load = [0] * self.world_size
            for _, d, n in self.outstanding:
                load[d] += n
        return load

    def __getattr__(self, method: str):
        """The pool's methods called directly (validation's generation): submitted, waited for, and
        submitted again after a restart."""
        if method.startswith("_") or "view" not in self.__dict__ or method not in vars(self.view):
            raise AttributeError(method)

        def call(*args, **kwargs):
            while True:
                try:
                    return self.submit(method, *args, **kwargs).result()
                except ReplicaRestarted:
                    continue

        return call

    def metrics(self) -> dict[str, float]:
        return {"rollout/replica_restarts": float(self.restarts)}

    def handles(self) -> tuple[list[Any], list[int]]:
        """The replicas' actor handles and incarnations now (what a rollout manager calls)."""
        with self.cond:
            return list(self.group.workers), list(self.incarnation)

    def recover(self, error: WorkerCallError, seen: list[int]) -> None:
        """Restart every replica in `error.ranks` still in the incarnation the failed call was
        submitted to (`seen`); one restarted since by another failed call is not restarted again,
        and one being restarted by another caller is waited for. The lock is held for the
        bookkeeping only: the healthy replicas serve on while a replica restarts."""
        mine = []
        with self.cond:
            for rank in error.ranks:
                if self.incarnation[rank] != seen[rank] or rank in self.restarting:
                    continue
                if self.incarnation[rank] >= self.max_restarts:
                    raise WorkerCallError(f"rollout replica {rank} (pool {self.pool.name!r}) failed after {self.incarnation[rank]} restart(s), "
                                          f"the most async_training.max_replica_restarts allows: {error}", (rank,)) from None
                self.incarnation[rank] += 1
                self.restarts += 1
                self.restarting.add(rank)
                mine.append(rank)
            latest = self.latest
        for rank in mine:
            logger.warning("rollout replica %d (pool %r): %s; restarting it (restart %d of at most %d) with the latest weights",
                           rank, self.pool.name, str(error).split("; re-run")[0], self.incarnation[rank], self.max_restarts)
            try:
                handle = self._restart(rank, latest)
            finally:
                with self.cond:
                    self.restarting.discard(rank)
                    self.cond.notify_all()
            for tell in list(self.listeners):
                tell(rank, handle)
        with self.cond:
            self._wait_for_restarts(error.ranks, "a rollout replica's restart")

    def _restart(self, rank: int, latest: tuple[tuple, dict] | None) -> Any:
        """A new process in the replica's slot: the model, then the latest weights (in call order)."""
        self.group.replace_worker(rank, start_timeout_s=None if self.timeout_s is None else PROCESS_START_S)
        worker = self.group.workers[rank]
        calls = [getattr(worker, f"{self.role}__init_model").remote()]
        if latest is not None:
            args, kwargs = latest
            calls.append(getattr(worker, f"{self.role}__receive_weights").remote(*args, **kwargs))
        results = Pending(calls, lambda results: results, "init_model", self.pool.name).result(
            self.timeout_s, f"restarting rollout replica {rank}", "actor_rollout_ref.rollout.request_timeout_s")
        self.receipts[rank] = results[1] if len(results) > 1 else {"bytes_received": 0.0}
        return worker


class _Recovering:
    """A call on the replicas; its failure restarts the replicas that failed (`ReplicaSet.recover`)."""

    def __init__(self, owner: ReplicaSet, method: str, args: tuple, kwargs: dict, pending: Any, seen: list[int]):
        self.owner, self.method, self.args, self.kwargs, self.pending, self.seen = owner, method, args, kwargs, pending, seen

    def result(self, timeout_s: float | None = None, waiting_for: str = "", key: str = "") -> Any:
        try:
            return self.pending.result(timeout_s, waiting_for, key)
        except (WorkerDiedError, WorkerTimeoutError) as e:
            if not e.ranks:
                raise
            self.owner.recover(e, self.seen)
            if self.method not in SYNC_METHODS:
                raise ReplicaRestarted(f"{self.method}: rollout replica(s) {list(e.ranks)} restarted", e.ranks) from e
            if self.method == "receive_weights":  # the restarted replicas hold the latest weights; the others received these
                return [self._received(r, e.ranks, timeout_s) for r in range(len(self.pending.refs))]
            return self.owner.submit(self.method, *self.args, **self.kwargs).result(timeout_s, waiting_for, key)

    def _received(self, rank: int, failed: tuple[int, ...], timeout_s: float | None) -> dict:
        """A rank's receipt of this sync. A restarted rank holds the latest weights (its restart's
        receipt); another rank's result is collected under the call's deadline, and a rank found dead
        (or past the deadline) now is restarted as well (replicas that die together)."""
        if rank in failed:
            return self.owner.receipts[rank]
        one = Pending([self.pending.refs[rank]], lambda results: results[0], self.method, self.owner.pool.name, ranks=[rank])
        try:
            return one.result(timeout_s, f"rollout replica {rank}'s receipt of the weights", "actor_rollout_ref.rollout.request_timeout_s")
        except (WorkerDiedError, WorkerTimeoutError) as e:
            self.owner.recover(e, self.seen)
            return self.owner.receipts[rank]
