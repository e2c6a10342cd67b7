"""Rollout managers (service/managers.py): the agent loops in Ray actors off the driver, each
sending its requests to the replicas itself. Real Ray actors: 2 generation replicas that stamp every
token with the weight version they hold, and 2 managers, SIGKILLed from outside mid-run. The oracle
is the replicas' own record (a token's id is the version its replica held), never the scheduler's
bookkeeping: every batch is trained once and in order, no token is staler than k."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from hybridflow.config.schema import AgentConfig, MultiTurnConfig
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker
from hybridflow.controller.worker_group import ColocatedWorkerGroup, ResourcePool
from hybridflow.protocol import Batch, Completion, SamplingParams
from hybridflow.service.agent_rollout import AgentRollout
from hybridflow.service.async_rollout import AsyncRollout
from hybridflow.service.replicas import ReplicaSet
from version_sync import VersionSync
from hybridflow.service.managers import ManagerPool, ManagerSpec

pytestmark = pytest.mark.usefixtures("ray_cluster")


class StampReplica(Worker):
    """A generation replica whose every token is the weight version it holds (stamped as the real
    rollout worker stamps it), after a short nap (a call takes time, so kills land mid-batch)."""

    def __init__(self):
        super().__init__()
        self.held = -1

    def dispatch_layout(self, layout):
        return self.rank, self.world_size, True

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.held = 0  # the model as loaded

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, version: int, check: bool = False) -> dict:
        self.held = version
        return {"bytes_received": 1.0}

    @register(Dispatch.ONE_TO_ALL)
    def set_nap(self, seconds: float) -> None:
        self.nap = seconds

    @register(Dispatch.DP_COMPUTE)
    def generate_requests(self, data: Batch) -> Batch:
        time.sleep(getattr(self, "nap", 0.03))
        out = [Completion((self.held,) * 3, (-0.5,) * 3, "stop", versions=(self.held,) * 3) for _ in data["request"]]
        return Batch.from_dict(non_tensors={"completion": out})


@pytest.fixture
def replicas():
    pool = ResourcePool(1, 2, 0.25, name="managed")
    group = ColocatedWorkerGroup(pool, {"rollout": (StampReplica, {})}, name=f"managed_{os.getpid()}_{time.monotonic_ns()}")
    group.role("rollout").init_model()
    yield ReplicaSet(group, "rollout", max_restarts=3, timeout_s=60.0), group
    group.shutdown()
    pool.release()


def _spec(tiny_model_dir, agent: AgentConfig | None = None) -> ManagerSpec:
    return ManagerSpec(MultiTurnConfig(enable=True), agent or AgentConfig(), 16, 64, str(tiny_model_dir), "tiny", "rollout", 60.0,
                       SamplingParams(max_new_tokens=16))


def _run(replicas: ReplicaSet, managers: ManagerPool, k: int, steps: int, rows: int, fault=lambda step: None) -> list[dict]:
    """`steps` async steps with the managers; checks each batch against the replicas' record."""
    sync = VersionSync(replicas)
    drawn = []

    def prompts() -> Batch:
        drawn.append(len(drawn))
        b = len(drawn) - 1
        return Batch.from_dict(non_tensors={"raw_prompt": [[{"role": "user", "content": f"batch {b} row {i}"}] for i in range(rows)],
                                            "extra_info": [{"agent_name": "single_turn_agent"}] * rows, "uid": [f"b{b}"] * rows})

    gen = AsyncRollout(replicas, sync, prompts, lambda step: SamplingParams(max_new_tokens=16, seed=step), steps, max_staleness=k,
                       timeout_s=60.0, agent=managers.agent, managers=managers, thread_deadline_s=120.0)
    history = []
    for step in range(1, steps + 1):
        fault(step)
        batch, m = gen.take(step)
        mask = batch["response_mask"].bool()
        versions = batch["rollout_policy_version"]
        assert torch.equal(versions[mask], batch["responses"][mask])  # the record is the version the replica held
        assert int(versions[mask].min()) >= step - 1 - k and m["rollout/staleness_max"] <= k
        assert mask.sum(1).tolist() == [3] * rows  # every trajectory finished, with its one turn
        history.append({"uid": batch.non_tensors["uid"][0], **m})
        gen.sync_weights(step)
    gen.drain()
    assert [h["uid"] for h in history] == [f"b{i}" for i in range(steps)] and len(drawn) == steps  # each batch trained once, in order
    return history


def test_managers_run_every_turn_off_the_driver_within_the_staleness_bound(replicas, tiny_model_dir):
    """Two managers, k = 1, 40 trajectories a batch (more than the replicas' slots: each call batches
    them): each batch in order, its tokens no staler than k by the replicas' own record; the turns
    were served by the managers' processes, not the driver's."""
    rs, _ = replicas
    agent = AgentRollout(MultiTurnConfig(enable=True), 16, __import__("transformers").AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    pool = ManagerPool(_spec(tiny_model_dir), 2, rs, max_restarts=2, agent=agent)
    try:
        history = _run(rs, pool, k=1, steps=5, rows=40)
        stats = pool.stats()
        assert sum(s["turns"] for s in stats) >= 5 * 40 and {int(s["pid"]) for s in stats}.isdisjoint({os.getpid()})
        assert all(s["turns"] > 0 for s in stats)  # sharded over both
        assert history[-1]["rollout/manager_restarts"] == 0.0
    finally:
        pool.shutdown()


def _wait_dead(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read() for p in pids):
        assert time.monotonic() < deadline, "not dead within 10 s"
        time.sleep(0.01)


@pytest.mark.parametrize("managers", [1, 2])
def test_a_killed_manager_and_a_killed_replica_are_restarted_and_no_batch_trains_twice(replicas, tiny_model_dir, managers):
    """SIGKILL by pid from outside: a manager at step 2 and a replica at step 4, while later batches are
    in flight on them. The lost shard runs again on the manager's replacement, the replica is restarted
    with the latest weights and the managers learn its new actor; every batch is trained once, in
    order, within the bound. With one manager every shard is on the killed one (its fault watch dies
    with it too: a wait that kept watching the dead manager spun without restarting it)."""
    rs, group = replicas
    agent = AgentRollout(MultiTurnConfig(enable=True), 16, __import__("transformers").AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    pool = ManagerPool(_spec(tiny_model_dir), managers, rs, max_restarts=2, agent=agent)

    def fault(step: int) -> None:
        if step == 2:
            pid = pool.pids()[0]
            os.kill(pid, signal.SIGKILL)
            _wait_dead([pid])
        if step == 4:
            pid = group.pids()[1]
            os.kill(pid, signal.SIGKILL)
            _wait_dead([pid])

    try:
        history = _run(rs, pool, k=1, steps=6, rows=24, fault=fault)
        last = history[-1]
        # the killed manager's shard (24 / managers rows) of each batch on it or submitted before its death was noticed: 1 or 2 batches
        shard = 24 // managers
        assert last["rollout/manager_restarts"] == 1.0 and last["rollout/rerun_trajectories"] in (shard, 2 * shard)
        assert last["rollout/replica_restarts"] >= 1.0 and rs.incarnation[1] >= 1
    finally:
        pool.shutdown()


async def agent_reports_its_url(client, row):
    """A black-box agent: one chat turn; its reward says which endpoint served it (the port)."""
    await client.chat.completions.create(model=row["model"], messages=row["messages"], max_tokens=4)
    return {"reward": 1.0, "port": int(str(client.base_url).split(":")[2].split("/")[0])}


def test_a_black_box_agent_plays_through_its_managers_endpoint_one_url_for_the_whole_run(replicas, tiny_model_dir):
    """agent.function on two managers: every trajectory of three batches is served by its manager's
    endpoint, started once (the URLs do not change between batches), and scores its reward."""
    rs, _ = replicas
    agent_cfg = AgentConfig(function=f"{__name__}:agent_reports_its_url", timeout_s=60.0)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(tiny_model_dir))
    agent = AgentRollout(MultiTurnConfig(enable=True), 16, tok, agent_cfg, 64, "tiny")
    pool = ManagerPool(_spec(tiny_model_dir, agent_cfg), 2, rs, max_restarts=2, agent=agent)
    try:
        urls = list(pool.urls)
        assert all(u.startswith("http://127.0.0.1:") for u in urls) and len(set(urls)) == 2
        for step in range(3):
            rows = Batch.from_dict(non_tensors={"raw_prompt": [[{"role": "user", "content": f"hi {i}"}] for i in range(8)],
                                                "extra_info": [{}] * 8})
            out = pool.submit(rows, SamplingParams(max_new_tokens=16, seed=step), 0).result()
            assert out["agent_reward"].tolist() == [1.0] * 8 and out.meta["metrics"]["agent/agent_errors"] == 0.0
        assert pool.urls == urls
    finally:
        pool.shutdown()


def test_a_replicas_queued_calls_do_not_count_against_its_deadline(replicas, tiny_model_dir):
    """request_timeout_s = 1 s, each call 0.8 s on its replica, and both managers split their shard
    over both replicas at once: each replica's second call waits 0.8 s in its queue and finishes
    1.6 s after it was sent. The deadline counts from when a call starts executing (asked of the replica), so no
    healthy replica is reported and no request sent again (counted from submission, the queued call
    was late and its replica restarted)."""
    rs, group = replicas
    group.role("rollout").set_nap(0.8)
    spec = dataclasses.replace(_spec(tiny_model_dir), request_timeout_s=1.0)
    agent = AgentRollout(MultiTurnConfig(enable=True), 16, __import__("transformers").AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    pool = ManagerPool(spec, 2, rs, max_restarts=2, agent=agent)
    try:
        rows = Batch.from_dict(non_tensors={"raw_prompt": [[{"role": "user", "content": f"r{i}"}] for i in range(4)],
                                            "extra_info": [{"agent_name": "single_turn_agent"}] * 4})
        start = time.monotonic()
        out = pool.submit(rows, SamplingParams(max_new_tokens=16, seed=0), 0).result()
        m = out.meta["metrics"]
        assert time.monotonic() - start >= 1.5  # the second call did queue behind the first
        assert m["rollout/lost_requests"] == 0.0 and rs.restarts == 0 and out["responses"].shape[0] == 4
    finally:
        pool.shutdown()
