"""The single controller on Ray: worker groups, dispatch modes, colocation, the process group."""

from __future__ import annotations

import os

import torch

from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker
from hybridflow.controller.worker_group import ColocatedWorkerGroup, RayWorkerGroup, ResourcePool
from hybridflow.protocol import Batch



class EchoWorker(Worker):
    def __init__(self, tag: str = "echo"):
        super().__init__()
        self.tag = tag

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> tuple[str, int, int, int]:
        return self.tag, self.rank, self.world_size, os.getpid()

    @register(Dispatch.DP_COMPUTE)
    def double(self, data: Batch) -> Batch:
        return Batch.from_dict(tensors={"y": data["x"] * 2, "rank": torch.full((len(data),), self.rank)})

    @register(Dispatch.RANK_ZERO)
    def all_reduce_ranks(self) -> float:
        import torch.distributed as dist

        self.init_process_group("cpu")
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return float(t)


class Sleeper(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> int:
        import time

        time.sleep(seconds)
        return self.rank


class OtherRole(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


def test_worker_group_dispatch_modes(ray_cluster):
    pool = ResourcePool(nnodes=1, procs_per_node=2, cpus_per_worker=0.25)
    wg = RayWorkerGroup(pool, EchoWorker, name="echo_test", tag="hi")
    try:
        infos = wg.whoami()
        assert [(t, r, w) for t, r, w, _ in infos] == [("hi", 0, 2), ("hi", 1, 2)]
        assert infos[0][3] != infos[1][3]  # two processes

        # 5 rows over 2 ranks: padded to 6, ranks get 3 each, padding dropped on the way back.
        out = wg.double(Batch.from_dict(tensors={"x": torch.arange(5)}))
        assert out["y"].tolist() == [0, 2, 4, 6, 8]
        assert out["rank"].tolist() == [0, 0, 0, 1, 1]

        assert wg.all_reduce_ranks() == 3.0  # 1 + 2 over a real gloo group
    finally:
        wg.shutdown()
        pool.release()


def test_colocated_roles_share_one_process(ray_cluster):
    pool = ResourcePool(nnodes=1, procs_per_node=2, cpus_per_worker=0.25)
    wg = ColocatedWorkerGroup(pool, {"echo": (EchoWorker, {"tag": "a"}), "other": (OtherRole, {})}, name="coloc_test")
    try:
        echo, other = wg.role("echo"), wg.role("other")
        echo_pids = [p for *_, p in echo.whoami()]
        assert echo_pids == other.pid() == wg.pids()
        assert echo.double(Batch.from_dict(tensors={"x": torch.arange(4)}))["y"].tolist() == [0, 2, 4, 6]
    finally:
        wg.shutdown()
        pool.release()


def test_a_call_past_its_deadline_is_named_not_waited_for(ray_cluster):
    """Every rank hung (no straggler to compare with): the caller's deadline reports what it waited for."""
    import time

    import pytest

    from hybridflow.controller.worker_group import WorkerTimeoutError

    pool = ResourcePool(nnodes=1, procs_per_node=2, cpus_per_worker=0.25)
    wg = RayWorkerGroup(pool, Sleeper, name="sleeper_test")
    try:
        assert wg.submit("nap", 0.0).result(timeout_s=30) == [0, 1]
        start = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as e:
            wg.submit("nap", 600.0).result(timeout_s=2, waiting_for="step 3's batch (sampled with policy version 2)",
                                          key="actor_rollout_ref.rollout.request_timeout_s")
        assert time.monotonic() - start < 30
        msg = str(e.value)
        assert "step 3's batch (sampled with policy version 2)" in msg and "rank(s) [0, 1]" in msg and "nap" in msg
        assert "within 2 s (actor_rollout_ref.rollout.request_timeout_s" in msg
    finally:
        wg.shutdown()
        pool.release()


def test_a_rollout_replicas_requests_run_in_their_own_concurrency_group_on_the_actor_the_group_starts():
    """The worker group starts a rollout worker's actor with the class's concurrency groups and its
    `generate_requests` in the requests group (Ray's mark on the method), also fused with other roles;
    every other method stays in the default group (one call at a time)."""
    from hybridflow.controller.worker import PROBE_GROUP, colocated_worker_cls, tracked_worker_cls
    from hybridflow.controller.worker_group import concurrency_groups
    from hybridflow.workers.rollout import REQUEST_GROUP, RolloutWorker

    fused = colocated_worker_cls({"rollout": RolloutWorker})
    assert set(concurrency_groups(fused)) == {PROBE_GROUP, REQUEST_GROUP}
    tracked = tracked_worker_cls(fused)
    assert tracked.rollout__generate_requests.__ray_concurrency_group__ == REQUEST_GROUP
    assert not hasattr(tracked.rollout__receive_weights, "__ray_concurrency_group__")
    assert not hasattr(tracked.rollout__generate_sequences, "__ray_concurrency_group__")
