"""A call's deadline (`Pending.result(timeout_s=...)`, e.g. actor_rollout_ref.rollout.request_timeout_s)
counts from the moment the call starts executing on its worker, as the worker records it: calls
queued on a busy, healthy worker are not late, while a call that runs past its deadline, a call stuck
behind one that does, and a stopped worker (it answers no probe) are still named, by rank."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker
from hybridflow.controller.worker_group import RayWorkerGroup, ResourcePool, WorkerTimeoutError

pytestmark = pytest.mark.usefixtures("ray_cluster")

KEY = "actor_rollout_ref.rollout.request_timeout_s"


class Napper(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float, rank: int | None = None) -> int:
        """Sleeps `seconds` (on rank `rank` only, if given); returns the rank."""
        if rank is None or rank == self.rank:
            time.sleep(seconds)
        return self.rank


@pytest.fixture(scope="module")
def group():
    pool = ResourcePool(1, 2, 0.25, name="deadlines")
    wg = RayWorkerGroup(pool, Napper, name=f"deadlines_{os.getpid()}")
    assert wg.submit("nap", 0.0).result(timeout_s=60) == [0, 1]  # started: no process start counts below
    yield wg
    wg.shutdown()
    pool.release()


def test_calls_queued_on_a_busy_worker_are_not_late(group):
    """Three 0.8 s calls submitted together, each waited for with a 1 s deadline by a thread of its
    own (as the agent loop's batch threads do): the workers run them one after another, the last one
    ends about 2.4 s after its submission, and none is late (on the code that counted a deadline from
    the wait's start, the second and third raised WorkerTimeoutError and a healthy replica was restarted)."""
    calls = [group.submit("nap", 0.8) for _ in range(3)]
    results: list = [None] * 3

    def wait(i: int) -> None:
        try:
            results[i] = calls[i].result(1.0, f"call {i}", KEY)
        except Exception as e:  # noqa: BLE001
            results[i] = e

    start = time.monotonic()
    threads = [threading.Thread(target=wait, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [[0, 1]] * 3, results
    assert time.monotonic() - start >= 2.4  # they did queue


def test_a_call_past_its_deadline_still_fails_naming_the_rank(group):
    """Rank 1 runs 2.5 s under a 1 s deadline: named (running for 1 s) at about 1 s; a call
    submitted after it waits behind a call running past the deadline, and is named too."""
    long = group.submit("nap", 2.5, rank=1)
    after = group.submit("nap", 0.0)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as e:
        long.result(1.0, "the long call", KEY)
    assert time.monotonic() - start < 2.3 and e.value.ranks == (1,)
    msg = str(e.value)
    assert "the long call: the worker worker rank(s) [1] (pool 'deadlines') did not finish nap within 1.0 s (" + KEY in msg
    assert "rank 1 running for 1 s" in msg
    with pytest.raises(WorkerTimeoutError) as e:
        after.result(1.0, "the call behind it", KEY)
    assert e.value.ranks == (1,) and "rank 1 queued behind a call running for" in str(e.value)
    assert after.result() == [0, 1]  # no deadline: it ends once the long call has


def test_a_stopped_worker_is_named_within_its_deadline_and_the_probe_timeout(group):
    """SIGSTOP: the process answers nothing, not even a probe (a separate concurrency group, but the
    same process): named after the 1 s deadline plus at most the 1 s probe."""
    pid = group.pids()[1]
    os.kill(pid, signal.SIGSTOP)
    try:
        call = group.submit("nap", 0.1)
        start = time.monotonic()
        with pytest.raises(WorkerTimeoutError) as e:
            call.result(1.0, "a call to a stopped worker", KEY)
        took = time.monotonic() - start
        assert e.value.ranks == (1,) and "rank 1 no answer to a probe within 1 s" in str(e.value)
        assert 1.0 <= took < 4.0, took
    finally:
        os.kill(pid, signal.SIGCONT)
    assert call.result(30) == [0, 1]  # it only was stopped: it goes on


def test_a_worker_stopped_after_a_probe_is_named_at_the_next_one(group):
    """A call queued behind a 0.8 s one: at its 1 s deadline the probe finds it running for 0.2 s (due
    again at 1.8 s); the process is stopped at 1.3 s, so the probe at 1.8 s gets no answer: named then."""
    pid = group.pids()[1]
    group.submit("nap", 0.8)
    call = group.submit("nap", 2.0, rank=1)
    stopper = threading.Timer(1.3, os.kill, (pid, signal.SIGSTOP))
    start = time.monotonic()
    stopper.start()
    try:
        with pytest.raises(WorkerTimeoutError) as e:
            call.result(1.0, "a call on a stopped worker", KEY)
        took = time.monotonic() - start
        assert e.value.ranks == (1,) and "rank 1 no answer to a probe" in str(e.value)
        assert 1.8 <= took < 5.0, took
    finally:
        stopper.join()
        os.kill(pid, signal.SIGCONT)
    assert call.result(30) == [0, 1]
