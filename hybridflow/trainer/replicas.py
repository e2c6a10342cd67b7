"""The rollout pool as replicas that survive faults (trainer.async_rollout, one process per replica:
actor_rollout_ref.rollout.tensor_model_parallel_size=1).

Every call on the pool goes through `ReplicaSet.submit` (the pool's own `submit`, the same dispatch).
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

import logging
import threading
from typing import Any

from hybridflow.controller.worker_group import WorkerCallError, WorkerDiedError, WorkerTimeoutError

logger = logging.getLogger("hybridflow")

SYNC_METHODS = ("receive_weights", "weight_fingerprints")


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
        self.incarnation = [0] * self.world_size  # restarts so far, per replica
        self.latest: tuple[tuple, dict] | None = None  # the last receive_weights call's arguments
        self.lock = threading.Lock()  # submissions vs a restart: a call goes to the replica's current process
        self.restarts = 0
        self.receipts: dict[int, dict] = {}  # a restarted replica's receipt of the latest weights

    def submit(self, method: str, *args, **kwargs) -> "_Recovering":
        with self.lock:
            if method == "receive_weights":
                self.latest = (args, kwargs)
            return _Recovering(self, method, args, kwargs, self.view.submit(method, *args, **kwargs), list(self.incarnation))

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

    def recover(self, error: WorkerCallError, seen: list[int]) -> None:
        """Restart every replica in `error.ranks` still in the incarnation the failed call was
        submitted to (`seen`); one restarted since by another failed call is not restarted again."""
        with self.lock:
            for rank in error.ranks:
                if self.incarnation[rank] != seen[rank]:
                    continue
                if self.incarnation[rank] >= self.max_restarts:
                    raise WorkerCallError(f"rollout replica {rank} (pool {self.pool.name!r}) failed after {self.incarnation[rank]} restart(s), "
                                          f"the most async_training.max_replica_restarts allows: {error}", (rank,)) from None
                self.incarnation[rank] += 1
                self.restarts += 1
                logger.warning("rollout replica %d (pool %r): %s; restarting it (restart %d of at most %d) with the latest weights",
                               rank, self.pool.name, str(error).split("; re-run")[0], self.incarnation[rank], self.max_restarts)
                self._restart(rank)

    def _restart(self, rank: int) -> None:
        """A new process in the replica's slot: the model, then the latest weights (in call order)."""
        from hybridflow.controller.worker_group import Pending

        self.group.replace_worker(rank, self.incarnation[rank])
        worker = self.group.workers[rank]
        calls = [getattr(worker, f"{self.role}__init_model").remote()]
        if self.latest is not None:
            args, kwargs = self.latest
            calls.append(getattr(worker, f"{self.role}__receive_weights").remote(*args, **kwargs))
        results = Pending(calls, lambda results: results, "init_model", self.pool.name).result(
            self.timeout_s, f"restarting rollout replica {rank}", "actor_rollout_ref.rollout.request_timeout_s")
        self.receipts[rank] = results[1] if len(results) > 1 else {"bytes_received": 0.0}


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
                return [self._received(r, e.ranks) for r in range(len(self.pending.refs))]
            return self.owner.submit(self.method, *self.args, **self.kwargs).result(timeout_s, waiting_for, key)

    def _received(self, rank: int, failed: tuple[int, ...]) -> dict:
        import ray

        return self.owner.receipts[rank] if rank in failed else ray.get(self.pending.refs[rank])
