"""Rollout replicas that survive faults: real Ray actors (2 replicas of a generation worker that
reports which weights it holds), SIGKILLed or hung mid-run under the async scheduler. The oracle is
the replicas' own record (each generated token is the weight version the replica held), never the
scheduler's bookkeeping: every batch is trained once, in order, no token is staler than k, and
each token's recorded version is the one its replica held, before and after the restart."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import ray
import torch

from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker
from hybridflow.controller.worker_group import ColocatedWorkerGroup, ResourcePool, WorkerCallError, WorkerDiedError
from hybridflow.protocol import Batch, Completion, Request, SamplingParams
from hybridflow.service.async_rollout import AsyncRollout
from hybridflow.trainer.keys import GEN_OUTPUTS
from hybridflow.service.replicas import ReplicaSet
from version_sync import VersionSync

pytestmark = pytest.mark.usefixtures("ray_cluster")


class VersionReplica(Worker):
    """A generation replica: holds the weight version it last received; every token it generates
    is that version. A call sleeps a little (a long tail); if `hang_file` exists when a call
    starts, the call deletes it and sleeps forever (a replica that stopped making progress)."""

    def __init__(self, hang_file: str = ""):
        super().__init__()
        self.held, self.hang_file, self.rng, self.slowdown, self.delay = -1, hang_file, random.Random(self.rank), 1.0, 0.0
        if hang_file and os.path.exists(hang_file + ".slow_process"):  # a process that takes a while to start (a loaded machine)
            time.sleep(float(open(hang_file + ".slow_process").read()))
        if hang_file and os.path.exists(hang_file + ".fail_start"):  # a replacement that cannot start (its node is gone, a broken install)
            raise RuntimeError("this replica cannot start")

    def dispatch_layout(self, layout):
        return self.rank, self.world_size, True

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.held = -1  # no weights until a sync
        if self.hang_file and os.path.exists(self.hang_file + ".slow_start"):  # a restart that takes a while (a large model's load)
            time.sleep(3)

    @register(Dispatch.ONE_TO_ALL)
    def slow_down(self, rank: int, factor: float) -> None:
        self.slowdown = factor if self.rank == rank else 1.0

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, version: int, check: bool = False) -> dict:
        self.held = version
        return {"bytes_received": 1.0}

    @register(Dispatch.ONE_TO_ALL)
    def delay_calls(self, rank: int, seconds: float) -> None:
        self.delay = seconds if self.rank == rank else 0.0

    def _nap(self) -> None:
        time.sleep(self.delay)
        if self.hang_file and os.path.exists(self.hang_file):
            os.remove(self.hang_file)
            time.sleep(3600)
        time.sleep(self.slowdown * min(0.01 * self.rng.paretovariate(1.5), 0.1))

    @register(Dispatch.DP_COMPUTE)
    def generate_requests(self, data: Batch) -> Batch:
        self._nap()
        n = [r.params.max_new_tokens for r in data["request"]]  # tokens: the weights held; log-probs: which replica served it
        return Batch.from_dict(non_tensors={"completion": [Completion((self.held,) * k, (float(self.rank),) * k, "length") for k in n]})

    @register(Dispatch.DP_COMPUTE)
    def generate_sequences(self, prompts: Batch, params: SamplingParams, release_after: bool = False) -> Batch:
        self._nap()
        b = len(prompts)
        out = {k: torch.zeros(b, 3, dtype=torch.long) for k in GEN_OUTPUTS}
        out["response_mask"] = torch.ones(b, 3, dtype=torch.long)
        out["responses"] = torch.full((b, 3), self.held)
        return Batch.from_dict(tensors=out)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def pool_group(tmp_path_factory):
    """One rollout pool of 2 VersionReplica workers for the module's tests (each test wraps it in a
    ReplicaSet of its own); its hang file."""
    hang = tmp_path_factory.mktemp("replicas") / "hang"
    pool = ResourcePool(1, 2, 0.25, name="replicas")
    group = ColocatedWorkerGroup(pool, {"rollout": (VersionReplica, {"hang_file": str(hang)})}, name=f"replicas_{os.getpid()}")
    group.role("rollout").init_model()
    yield group, hang
    group.shutdown()
    pool.release()


def _run(replicas: ReplicaSet, k: int, steps: int, partial: bool, fault=lambda step: None, sync_type=None) -> list[dict]:
    sync = (sync_type or VersionSync)(replicas)
    replicas.submit("receive_weights", 0).result()
    drawn = []

    def prompts() -> Batch:
        drawn.append(len(drawn))
        return Batch.from_dict(tensors={"input_ids": torch.ones(4, 2, dtype=torch.long), "attention_mask": torch.ones(4, 2, dtype=torch.long),
                                        "position_ids": torch.zeros(4, 2, dtype=torch.long)}, non_tensors={"uid": [f"b{len(drawn) - 1}"] * 4})

    gen = AsyncRollout(replicas, sync, prompts, lambda step: SamplingParams(max_new_tokens=6, seed=step), steps, max_staleness=k,
                       timeout_s=replicas.timeout_s, partial_chunk=2 if partial else None)
    history = []
    for step in range(1, steps + 1):
        fault(step)
        batch, m = gen.take(step)
        versions = batch["rollout_policy_version"]
        assert torch.equal(versions, batch["responses"])  # every token's record is the version its replica held
        assert int(versions.min()) >= step - 1 - k and int(versions.max()) <= step - 1 and m["rollout/staleness_max"] <= k
        history.append({"uid": batch.non_tensors["uid"][0], **m})
        gen.sync_weights(step)
    gen.drain()
    assert [h["uid"] for h in history] == [f"b{i}" for i in range(steps)] and len(drawn) == steps  # each batch trained once, in order
    return history


@pytest.mark.parametrize("partial", [True, False])
def test_a_replica_killed_mid_run_is_restarted_and_its_calls_run_again(pool_group, partial):
    group, _ = pool_group
    replicas = ReplicaSet(group, "rollout", max_restarts=2, timeout_s=60.0)

    def kill(step):
        if step == 3:
            os.kill(group.pids()[1], signal.SIGKILL)

    history = _run(replicas, k=2, steps=8, partial=partial, fault=kill)
    assert history[-1]["rollout/replica_restarts"] == 1.0 and replicas.incarnation == [0, 1]
    assert history[-1]["rollout/resubmitted_calls"] >= 1.0


def test_two_replicas_killed_together_during_a_sync_are_both_restarted(pool_group):
    """Both replicas SIGKILLed while a weight sync is in flight: the sync's failure names one rank first;
    the other's receipt must not be waited for without a deadline or raise raw (on b4554a1: Ray's own
    RayActorError for the second rank stopped the run)."""
    group, _ = pool_group
    replicas = ReplicaSet(group, "rollout", max_restarts=2, timeout_s=60.0)

    class KillingSync(VersionSync):
        def start_rollout_sync(self):
            if self.version == 3:
                pids = group.pids()
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while any(_alive(pid) for pid in pids):  # both are gone before the sync reaches them
                    assert time.monotonic() < deadline, "the replicas did not die within 10 s"
                    time.sleep(0.01)
            return super().start_rollout_sync()

    history = _run(replicas, k=1, steps=5, partial=False, sync_type=KillingSync)
    assert history[-1]["rollout/replica_restarts"] == 2.0 and replicas.incarnation == [1, 1]


def test_validation_on_the_rollout_pool_survives_a_replica_restart(pool_group):
    """Validation generates on the rollout service (`RolloutService.generate`, what RLTrainer's
    validation calls): a replica SIGKILLed before the call is restarted and the batch generated again
    (on b4554a1 ReplicaRestarted reached the trainer and stopped the run)."""
    from hybridflow.service import RolloutService

    group, _ = pool_group
    replicas = ReplicaSet(group, "rollout", max_restarts=2, timeout_s=60.0)
    replicas.submit("receive_weights", 7).result()
    service = RolloutService(scheduler=None, replicas=replicas, managers=None, agent=None, deadline_s=None)
    prompts = Batch.from_dict(tensors={"input_ids": torch.ones(4, 2, dtype=torch.long), "attention_mask": torch.ones(4, 2, dtype=torch.long),
                                       "position_ids": torch.zeros(4, 2, dtype=torch.long)})
    os.kill(group.pids()[1], signal.SIGKILL)
    out = service.generate(prompts, SamplingParams(max_new_tokens=3, do_sample=False), "validation", 60.0)
    assert replicas.restarts == 1 and out["responses"].shape == (4, 3)
    assert bool((out["responses"] == 7).all())  # the restarted replica got the latest weights before generating again


def test_a_replica_slower_than_the_others_is_not_a_straggler(pool_group, monkeypatch):
    """Replicas share no collective: one that finishes 2 s after the other is not restarted, even with
    the group's straggler rule (trainer.collective_timeout_s) at 0.5 s. On b4554a1 replica calls
    inherited that rule: the slower replica was restarted (and the restarts ran out)."""
    group, _ = pool_group
    replicas = ReplicaSet(group, "rollout", max_restarts=2, timeout_s=60.0)
    replicas.submit("receive_weights", 5).result()
    monkeypatch.setattr(group, "straggler_timeout_s", 0.5)
    group.role("rollout").delay_calls(1, 2.0)
    try:
        prompts = Batch.from_dict(tensors={"input_ids": torch.ones(4, 2, dtype=torch.long), "attention_mask": torch.ones(4, 2, dtype=torch.long),
                                           "position_ids": torch.zeros(4, 2, dtype=torch.long)})
        out = replicas.submit("generate_sequences", prompts, SamplingParams(max_new_tokens=3)).result(60.0)
    finally:
        group.role("rollout").delay_calls(1, 0.0)
    assert replicas.restarts == 0 and bool((out["responses"] == 5).all())


def test_a_hung_replica_is_named_within_its_deadline_and_replaced(pool_group, caplog):
    group, hang = pool_group
    replicas = ReplicaSet(group, "rollout", max_restarts=3, timeout_s=8.0)

    def hang_at_3(step):
        if step == 3:
            hang.write_text("once")

    start = time.time()
    history = _run(replicas, k=1, steps=6, partial=True, fault=hang_at_3)
    assert time.time() - start < 90
    assert history[-1]["rollout/replica_restarts"] >= 1.0
    assert "did not finish generate_requests within 8.0 s" in caplog.text and "restarting it" in caplog.text


def test_requests_go_to_the_least_loaded_replica_and_a_session_stays_on_its_replica(pool_group):
    """Replica 1 is 20x slower. Four threads each send 6 calls of 4 requests: two of a thread's
    requests belong to sessions (the same two in each call, as a trajectory's turns), two belong to
    none. Every session is served by one replica throughout, and the requests without a session go
    mostly to the fast replica (the slow one keeps more in flight)."""
    import threading

    from hybridflow.protocol import Request

    group, _ = pool_group
    replicas = ReplicaSet(group, "rollout", max_restarts=0, timeout_s=60.0)
    served: dict[str, set] = {}
    free = [0, 0]
    lock = threading.Lock()

    def client(t: int) -> None:
        for call in range(6):
            reqs = [Request((1,), SamplingParams(max_new_tokens=2), session=f"t{t}-s{j}") for j in range(2)]
            reqs += [Request((1,), SamplingParams(max_new_tokens=2)) for _ in range(2)]
            out = replicas.submit("generate_requests", Batch.from_dict(non_tensors={"request": reqs})).result(60)
            with lock:
                for r, c in zip(reqs, out["completion"]):
                    if r.session is None:
                        free[int(c.log_probs[0])] += 1
                    else:
                        served.setdefault(r.session, set()).add(int(c.log_probs[0]))

    group.role("rollout").slow_down(1, 20.0)
    try:
        replicas.submit("receive_weights", 0).result()
        threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    finally:
        group.role("rollout").slow_down(-1, 1.0)
    assert len(served) == 8 and all(len(s) == 1 for s in served.values()), served  # one replica per session
    assert sum(free) == 48 and free[0] > free[1], free  # the fast replica served more of the rest
    assert replicas.load() == [0, 0]


def test_a_replica_past_its_restarts_stops_the_run_naming_it(pool_group):
    group, _ = pool_group
    replicas = ReplicaSet(group, "rollout", max_restarts=0, timeout_s=60.0)

    def kill(step):
        if step == 2:
            os.kill(group.pids()[0], signal.SIGKILL)

    try:
        with pytest.raises(WorkerCallError, match=r"rollout replica 0 \(pool 'replicas'\) failed after 0 restart\(s\), the most "
                                                  r"async_training.max_replica_restarts allows: .*rank 0 .* died"):
            _run(replicas, k=1, steps=4, partial=False, fault=kill)
    finally:  # the pool's other tests need replica 0 back
        group.replace_worker(0)
        ray.get(group.workers[0].rollout__init_model.remote())


def test_a_replica_restart_blocks_no_healthy_replica(pool_group):
    """Replica 0 is SIGKILLed and restarted (a start that takes 3 s); requests submitted meanwhile are
    served by replica 1 before the restart ends (on b4554a1 the restart held the set's lock through
    the new process's start, model load and weight receipt, and every submission waited for it)."""
    group, hang = pool_group
    replicas = ReplicaSet(group, "rollout", max_restarts=2, timeout_s=60.0)
    replicas.submit("receive_weights", 0).result()
    slow = f"{hang}.slow_start"
    open(slow, "w").close()
    pid = group.pids()[0]
    os.kill(pid, signal.SIGKILL)
    while _alive(pid):
        time.sleep(0.01)
    restart = threading.Thread(target=replicas.recover, args=(WorkerDiedError("killed", (0,)), list(replicas.incarnation)))
    try:
        restart.start()
        deadline = time.monotonic() + 10
        while 0 not in getattr(replicas, "restarting", {0}):  # (b4554a1 kept no such record: its lock was held from here on)
            assert time.monotonic() < deadline, "the restart did not begin"
            time.sleep(0.005)
        requests = [Request((1,), SamplingParams(max_new_tokens=2)) for _ in range(4)]
        out = replicas.submit("generate_requests", Batch.from_dict(non_tensors={"request": requests})).result(30)
        assert restart.is_alive(), "the requests waited for the restart"
        assert [c.log_probs[0] for c in out["completion"]] == [1.0] * 4  # all served by replica 1
    finally:
        os.remove(slow)
        restart.join(60)
    assert replicas.incarnation == [1, 0] and not replicas.restarting
    out = replicas.submit("generate_requests", Batch.from_dict(non_tensors={"request": requests})).result(30)
    assert [c.token_ids for c in out["completion"]] == [(0, 0)] * 4  # both up, the restarted one holding the latest weights


def test_a_restart_whose_process_starts_slowly_is_waited_for_by_every_caller(pool_group):
    """The new process of a restarted replica takes 4 s to start, twice the 2 s request deadline (a Ray
    actor importing torch on a loaded machine took over 8 s). Deadlines count from a call's start on
    its worker, so the restart waits for the process, then gives its calls 2 s; another caller waiting
    for that restart waits as long. Before, the restarter's init call was probed while the actor was
    still being constructed (no answer: "late") and a waiting caller gave up after 2 s of wall clock:
    `test_a_hung_replica_is_named_within_its_deadline_and_replaced` failed that way under load."""
    group, hang = pool_group
    replicas = ReplicaSet(group, "rollout", max_restarts=2, timeout_s=2.0)
    replicas.submit("receive_weights", 7).result(30)
    slow = f"{hang}.slow_process"
    with open(slow, "w") as f:
        f.write("4")
    errors: list[BaseException] = []

    def restart() -> None:
        try:
            replicas.recover(WorkerDiedError("killed", (0,)), list(replicas.incarnation))
        except BaseException as e:  # noqa: BLE001  (asserted below)
            errors.append(e)

    thread = threading.Thread(target=restart)
    try:
        thread.start()
        deadline = time.monotonic() + 10
        while 0 not in replicas.restarting:
            assert time.monotonic() < deadline, "the restart did not begin"
            time.sleep(0.005)
        start = time.monotonic()
        replicas.submit("receive_weights", 8).result(30)  # waits for replica 0's restart, then reaches both replicas
        waited = time.monotonic() - start
    finally:
        os.remove(slow)
        thread.join(60)
    assert not errors, errors
    assert waited > 2.0, waited  # it did wait out the slow start, past the request deadline
    assert replicas.incarnation == [1, 0] and replicas.restarts == 1
    requests = [Request((1,), SamplingParams(max_new_tokens=2)) for _ in range(4)]
    out = replicas.submit("generate_requests", Batch.from_dict(non_tensors={"request": requests})).result(30)
    assert [c.token_ids for c in out["completion"]] == [(8, 8)] * 4  # both replicas hold the latest weights


def test_a_replacement_that_dies_before_it_starts_is_a_named_worker_error(pool_group):
    """A replacement whose process dies before it answers (here its constructor raises; in
    test_e2e_two_nodes.py its node is gone) is a WorkerDiedError naming the rank, the pool and the
    resume hint, not Ray's raw ActorDiedError (which the trainer does not name)."""
    group, hang = pool_group
    fail = f"{hang}.fail_start"
    open(fail, "w").close()
    try:
        with pytest.raises(WorkerDiedError, match=r"the replacement of rank 0 \(pool 'replicas'\) died before it started: .*resume"):
            group.replace_worker(0, start_timeout_s=30)
    finally:
        os.remove(fail)
        group.replace_worker(0, start_timeout_s=30)  # the pool's other tests need replica 0 back
        ray.get(group.workers[0].rollout__init_model.remote())
