"""The async rollout's staleness bound, against a rollout pool that runs its calls one after another
(as a Ray actor runs one caller's calls) with heavy-tailed latencies: which weights sampled each
batch is the pool's own record, independent of the scheduler's bookkeeping."""

from __future__ import annotations

import queue
import random
import threading
import time
import types

import pytest
import torch

from hybridflow.protocol import Batch
from hybridflow.service.async_rollout import AsyncRollout
from hybridflow.trainer.keys import GEN_OUTPUTS
from version_sync import PendingSync, VersionSync


class _Call:
    def __init__(self):
        self.event, self.value = threading.Event(), None

    def result(self, timeout_s=None, waiting_for="", key=""):
        assert self.event.wait(timeout=30), waiting_for
        return self.value


class FifoPool:
    """One worker thread: calls run in submission order, each after a random (Pareto) delay. It holds
    a weight version that `receive_weights` replaces; a generation reports the version it ran with."""

    world_size = 1
    stamps = False

    def __init__(self, rng: random.Random, slow: float):
        self.rng, self.slow, self.held, self.calls = rng, slow, 0, queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def submit(self, method: str, *args, **kwargs) -> _Call:
        call = _Call()
        self.calls.put((call, method, args))
        return call

    def before(self, method: str, args: tuple) -> None:
        """Called on the pool's thread before it runs a call (a test orders calls here)."""

    def _run(self):
        from hybridflow.protocol import Completion

        while True:
            call, method, args = self.calls.get()
            self.before(method, args)
            time.sleep(min(self.slow * self.rng.paretovariate(1.5), 0.05))  # a long tail, capped for the test's time
            if method == "receive_weights":
                self.held = args[0]
                call.value = [{"bytes_received": 1}]
            elif method == "generate_requests":  # each token of a completion is the weights it ran with; the limit ends it
                reqs = args[0]["request"]
                call.value = Batch.from_dict(non_tensors={"completion": [
                    Completion((self.held,) * r.params.max_new_tokens, (0.0,) * r.params.max_new_tokens, "length") for r in reqs]})
            else:
                prompts = args[0]
                b = len(prompts)
                out = {k: torch.zeros(b, 3, dtype=torch.long) for k in GEN_OUTPUTS}
                out["response_mask"] = torch.ones(b, 3, dtype=torch.long)
                out["responses"] = torch.full((b, 3), self.held)  # the weights this generation ran with, as its "tokens"
                if self.stamps:  # as a rollout worker of its own pool does: the version it holds, per token
                    out["rollout_policy_version"] = torch.full((b, 3), self.held)
                call.value = Batch.from_dict(tensors=out)
            call.event.set()


class FakeWeightSync(VersionSync):
    """Publishes the trainer's version to the pool (queued behind its generations)."""

    def __init__(self, pool: FifoPool):
        super().__init__(pool, {"reshard/bytes_per_rank": 1.0})


@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_no_trained_batch_is_staler_than_k_and_each_is_trained_once(k, seed):
    rng = random.Random(seed)
    pool = FifoPool(rng, slow=0.002)
    sync = FakeWeightSync(pool)
    drawn = []

    def prompts() -> Batch:
        drawn.append(len(drawn))
        return Batch.from_dict(tensors={"input_ids": torch.full((2, 2), len(drawn) - 1), "attention_mask": torch.ones(2, 2),
                                        "position_ids": torch.zeros(2, 2)}, non_tensors={"uid": [f"b{len(drawn) - 1}"] * 2})

    steps = 12
    gen = AsyncRollout(pool, sync, prompts, lambda step: step, steps, max_staleness=k, loader_state=lambda: len(drawn))
    trained, staleness = [], []
    for step in range(1, steps + 1):
        batch, m = gen.take(step)
        sampled_by = int(batch["responses"][0, 0])  # the pool's record of the weights that ran the generation
        assert (batch["rollout_policy_version"] == sampled_by).all() and batch.meta["policy_version"] == sampled_by
        assert m["rollout/staleness"] == m["rollout/staleness_max"] == step - 1 - sampled_by <= k
        assert m["rollout/buffer_depth"] <= k
        staleness.append(m["rollout/staleness"])
        trained.append(batch.non_tensors["uid"][0])
        if gen.pending:  # a checkpoint now resumes before the oldest batch still queued
            assert gen.resume_loader_state() == step
        time.sleep(min(0.003 * rng.paretovariate(1.5), 0.05))  # the update
        gen.sync_weights(step)
    gen.drain()
    assert pool.held == steps  # the pool ends on the last update's weights
    assert trained == [f"b{i}" for i in range(steps)] and len(drawn) == steps  # every batch drawn was trained, once, in order
    assert staleness == [float(min(s - 1, k)) for s in range(1, steps + 1)]  # as fresh as the bound allows, never staler


class FakeAgent:
    """A multi-turn rollout: each row takes 3 model turns through the group, with tool time between
    them; a turn's completion is the weights the pool ran it with (the pool's record, as its token).

    With `pool` given, the first two batches (a prompt's tokens are its batch number: 1, 2, ...) are
    ordered so that a sync lands between two turns of the second whatever the machine's load (timing
    alone once gave no such turn in a loaded CI run): the first batch returns only after the
    second's first turn ran (with version 0: no sync can be submitted before the first batch is
    taken), and the second's tool call lasts until the pool holds version 1 (the sync the trainer
    submits after step 1, before it needs the second batch)."""

    def __init__(self, rng: random.Random, pool: FifoPool | None = None):
        self.rng, self.pool = rng, pool
        self.second_batch_turned = threading.Event()

    def generate(self, group, prompts: Batch, params) -> Batch:
        from hybridflow.protocol import Request, SamplingParams

        call = int(prompts["input_ids"][0, 0])  # the batch number (the threads may start in either order)
        b, turns = len(prompts), []
        for turn in range(3):
            out = group.generate_requests(Batch.from_dict(non_tensors={"request": [Request((1,), SamplingParams(max_new_tokens=1)) for _ in range(b)]}))
            turns.append(out["completion"])
            time.sleep(min(0.002 * self.rng.paretovariate(1.5), 0.05))  # a tool call
            if self.pool is not None and call == 2 and turn == 0:
                self.second_batch_turned.set()
                deadline = time.monotonic() + 30
                while self.pool.held < 1:
                    assert time.monotonic() < deadline, "the sync after step 1 never reached the pool"
                    time.sleep(0.001)
        if self.pool is not None and call == 1:
            assert self.second_batch_turned.wait(30), "the second batch's first turn never ran"
        out = {k: torch.zeros(b, 3, dtype=torch.long) for k in GEN_OUTPUTS}
        out["response_mask"] = torch.ones(b, 3, dtype=torch.long)
        out["responses"] = torch.tensor([[t[i].token_ids[0] for t in turns] for i in range(b)])  # the pool's record
        out["rollout_policy_version"] = torch.tensor([[t[i].versions[0] for t in turns] for i in range(b)])  # the scheduler's
        return Batch.from_dict(tensors=out, meta={"metrics": {"agent/turns": 3.0}})


@pytest.mark.parametrize("k", [0, 2])
def test_async_multi_turn_turns_carry_the_weights_that_sampled_them(k):
    """Trajectories run on driver threads while the trainer updates; weight syncs land between their
    turns, so one trajectory's turns may be sampled by different versions: each token's recorded
    version is the one the pool ran it with, none is newer than the trainer's or older than k."""
    rng = random.Random(k)
    pool = FifoPool(rng, slow=0.002)
    sync = FakeWeightSync(pool)
    count = [0]

    def prompts() -> Batch:  # each prompt's tokens are its batch number (1, 2, ...)
        count[0] += 1
        return Batch.from_dict(tensors={"input_ids": torch.full((2, 2), count[0])})

    steps, mixed = 8, 0
    agent = FakeAgent(rng, pool if k else None)  # at k = 0 the second batch starts only after the first sync
    gen = AsyncRollout(pool, sync, prompts, lambda step: step, steps, max_staleness=k, agent=agent)
    for step in range(1, steps + 1):
        batch, m = gen.take(step)
        versions, sampled_by = batch["rollout_policy_version"], batch["responses"]
        assert torch.equal(versions, sampled_by)  # the scheduler's version of every turn is the pool's record
        assert int(versions.min()) >= step - 1 - k and int(versions.max()) <= step - 1
        assert m["rollout/staleness_max"] == step - 1 - int(versions.min()) <= k and m["agent/turns"] == 3.0
        mixed += int((versions.max(dim=1).values != versions.min(dim=1).values).any())
        time.sleep(min(0.003 * rng.paretovariate(1.5), 0.05))
        gen.sync_weights(step)
    gen.drain()
    assert count[0] == steps and pool.held == steps
    # at k = 0 nothing runs during an update; at k = 2 syncs land between the turns of queued trajectories
    # (the second batch's, at least: the agent orders it so)
    assert mixed == 0 if k == 0 else mixed > 0


def test_a_sync_never_passes_a_turn_between_its_version_and_its_submission():
    """A turn's version is read and its call submitted under the lock the syncs take, so a sync the
    trainer starts while a turn's submission is slow (routing, pickling many requests) waits for it
    and the turn runs with the version it recorded. On 4a1245f the version was read under the lock and
    the call submitted outside it: the sync below reached the pool first and the turn ran with weights
    one version newer than recorded (seen once in a full-suite run with real replicas)."""
    from hybridflow.protocol import Request, SamplingParams

    first_taken, submitting, marked = threading.Event(), threading.Event(), threading.local()

    class SlowSubmitPool(FifoPool):
        def submit(self, method: str, *args, **kwargs) -> _Call:
            if getattr(marked, "slow", False) and method == "generate_requests":
                submitting.set()
                time.sleep(0.2)  # a slow submission: a sync that can land first does so now
            return super().submit(method, *args, **kwargs)

    class TwoTurns:
        """Two turns per row; the second batch's second turn starts once the first batch is taken
        and is submitted slowly (its thread marked)."""

        def generate(self, group, prompts: Batch, params) -> Batch:
            b, turns = len(prompts), []
            for turn in range(2):
                marked.slow = int(prompts["input_ids"][0, 0]) == 1 and turn == 1
                if marked.slow:
                    assert first_taken.wait(10)
                out = group.generate_requests(Batch.from_dict(non_tensors={"request": [Request((1,), SamplingParams(max_new_tokens=1)) for _ in range(b)]}))
                turns.append(out["completion"])
            out = {k: torch.zeros(b, 2, dtype=torch.long) for k in GEN_OUTPUTS}
            out["response_mask"] = torch.ones(b, 2, dtype=torch.long)
            out["responses"] = torch.tensor([[t[i].token_ids[0] for t in turns] for i in range(b)])  # the pool's record
            out["rollout_policy_version"] = torch.tensor([[t[i].versions[0] for t in turns] for i in range(b)])  # the scheduler's
            return Batch.from_dict(tensors=out)

    pool = SlowSubmitPool(random.Random(0), slow=0.001)
    drawn = []

    def prompts() -> Batch:
        drawn.append(len(drawn))
        return Batch.from_dict(tensors={"input_ids": torch.full((2, 2), len(drawn) - 1)})

    gen = AsyncRollout(pool, FakeWeightSync(pool), prompts, lambda step: step, 3, max_staleness=1, agent=TwoTurns())
    for step in range(1, 4):
        batch, _ = gen.take(step)
        assert torch.equal(batch["rollout_policy_version"], batch["responses"]), (step, batch["rollout_policy_version"], batch["responses"])
        if step == 1:  # the sync starts while the second batch's second turn is being submitted
            first_taken.set()
            assert submitting.wait(10)
        gen.sync_weights(step)
    gen.drain()


class SecondBatchAcrossTheFirstSync(FifoPool):
    """Orders the first two batches of a partial rollout so that the sync after step 1 lands between
    two segments of the second batch's responses, whatever the machine's load (timing alone, at
    2 ms segments, once gave no such response in 8 steps). A prompt's first token is its batch
    number (1, 2, ...), its length says the segment (2 prompt tokens, 2 more per segment):
    - the second batch's first segment waits on the pool's thread until the first batch's only call
      is queued, so that call runs before the second batch's second segment is even submitted;
    - the second segment (the first batch has run by then, so step 1 can be taken) waits until the
      trainer has submitted the sync of step 1, so the third segment is submitted after that sync
      (under the lock the syncs take): it records version 1 and runs after the sync. The first segment
      was submitted before step 1 was taken, with version 0; the sync may land before or after the
      second segment's submission, so the switch comes after the first or the second segment."""

    def __init__(self, rng: random.Random, slow: float):
        self.first_queued, self.syncs_submitted = threading.Event(), 0
        super().__init__(rng, slow)

    def submit(self, method: str, *args, **kwargs) -> _Call:
        self.syncs_submitted += method == "receive_weights"
        call = super().submit(method, *args, **kwargs)
        if method == "generate_requests" and args[0]["request"][0].prompt_ids[0] == 1:
            self.first_queued.set()
        return call

    def before(self, method: str, args: tuple) -> None:
        if method != "generate_requests":
            return
        prompt = args[0]["request"][0].prompt_ids
        batch, segment = prompt[0], (len(prompt) - 2) // 2
        if batch == 2 and segment == 0:
            assert self.first_queued.wait(10), "the first batch's call was never queued"
        if batch == 2 and segment == 1:
            deadline = time.monotonic() + 10
            while not self.syncs_submitted:
                assert time.monotonic() < deadline, "the sync after step 1 was never submitted"
                time.sleep(0.001)


@pytest.mark.parametrize("k", [1, 2])
def test_partial_rollout_pauses_responses_for_weight_updates_within_the_bound(k):
    """async_training.partial_rollout: each response runs in segments (2 tokens of 8), so the syncs
    queued while it runs land between its segments: a response may be sampled by several versions,
    every token's recorded version is the one the pool ran it with, versions only grow along a
    response, and the oldest token is never more than k updates behind the step that trains it.
    The first batch's responses are one segment (2 tokens), and the pool orders the first two batches
    so that at least the second's responses span a sync (SecondBatchAcrossTheFirstSync)."""
    rng = random.Random(10 + k)
    pool = SecondBatchAcrossTheFirstSync(rng, slow=0.01)
    sync = FakeWeightSync(pool)
    from hybridflow.protocol import SamplingParams

    drawn = []

    def prompts() -> Batch:  # each prompt's tokens are its batch number (1, 2, ...)
        drawn.append(len(drawn) + 1)
        return Batch.from_dict(tensors={"input_ids": torch.full((3, 2), drawn[-1], dtype=torch.long), "attention_mask": torch.ones(3, 2, dtype=torch.long),
                                        "position_ids": torch.zeros(3, 2, dtype=torch.long)})

    def length(step: int) -> int:
        return 2 if step == 1 else 8

    steps, mixed = 8, 0
    gen = AsyncRollout(pool, sync, prompts, lambda step: SamplingParams(max_new_tokens=length(step), seed=step), steps, max_staleness=k,
                       partial_chunk=2, pad_id=0)
    for step in range(1, steps + 1):
        batch, m = gen.take(step)
        versions, sampled_by = batch["rollout_policy_version"], batch["responses"]
        assert versions.shape == (3, length(step)) and batch["response_mask"].all()
        assert torch.equal(versions, sampled_by)  # the scheduler's record of every token is the pool's
        assert (versions[:, 1:] >= versions[:, :-1]).all()
        assert int(versions.min()) >= step - 1 - k and int(versions.max()) <= step - 1
        assert m["rollout/staleness_max"] == step - 1 - int(versions.min()) <= k
        mixed += int(m["rollout/mixed_version_rows"])
        if step == 2:  # the second batch: every response began with version 0 and ended with version 1
            assert m["rollout/mixed_version_rows"] == 3 and versions[:, 0].eq(0).all() and versions[:, -1].eq(1).all(), versions
        time.sleep(min(0.003 * rng.paretovariate(1.5), 0.05))
        gen.sync_weights(step)
    gen.drain()
    assert pool.held == steps and mixed > 0


class LosingSync(FakeWeightSync):
    """Syncs after the second are lost on their way (the pool never receives them)."""

    def start_rollout_sync(self) -> PendingSync:
        if self.version <= 2:
            return super().start_rollout_sync()
        call = types.SimpleNamespace(result=lambda timeout_s=None: [{"bytes_received": 1}])
        return PendingSync(call)


def test_a_batch_staler_than_k_stops_the_run_naming_it():
    """The bound is asserted on the pool's own record, not the scheduler's count of syncs submitted: a
    pool that lost the syncs after the second serves step 5 with version 2 at k = 1 (on b4554a1 the
    batch was trained, its rollout/staleness reported as 2)."""
    from hybridflow.service.async_rollout import StalenessError

    pool = FifoPool(random.Random(0), slow=0.001)
    pool.stamps = True
    sync = LosingSync(pool)

    def prompts() -> Batch:
        return Batch.from_dict(tensors={"input_ids": torch.ones(2, 2, dtype=torch.long), "attention_mask": torch.ones(2, 2),
                                        "position_ids": torch.zeros(2, 2)})

    gen = AsyncRollout(pool, sync, prompts, lambda step: step, 8, max_staleness=1)
    with pytest.raises(StalenessError, match=r"step 5's batch has tokens sampled with policy version 2, 2 updates behind .*max_staleness=1"):
        for step in range(1, 9):
            gen.take(step)
            gen.sync_weights(step)


def test_a_multi_turn_batch_that_never_finishes_stops_at_its_deadline():
    """A batch on a driver thread whose trajectories wait on something with no deadline of its own:
    take() names it once the batch's deadline passes (on b4554a1 it waited forever)."""
    from hybridflow.controller.worker_group import WorkerTimeoutError

    release = threading.Event()

    class StuckAgent:
        def generate(self, group, prompts, params):
            release.wait(30)
            raise RuntimeError("released")

    pool = FifoPool(random.Random(0), slow=0.001)
    gen = AsyncRollout(pool, FakeWeightSync(pool), lambda: Batch.from_dict(non_tensors={"raw_prompt": [[]]}), lambda step: step, 2,
                       max_staleness=0, agent=StuckAgent(), thread_deadline_s=0.5)
    start = time.monotonic()
    try:
        with pytest.raises(WorkerTimeoutError, match=r"step 1's batch .*did not finish within 0 s"):
            gen.take(1)
        assert time.monotonic() - start < 10
    finally:
        release.set()


def test_publishing_the_weights_holds_no_lock_a_batch_needs():
    """A sync's slow half (crop, cast, checksums, ray.put) runs while a batch thread's requests are
    submitted and answered: on b4554a1 the publish ran under the version lock that every agent turn
    and partial-rollout segment takes to submit, so the turn below waited for the whole publish."""
    from hybridflow.protocol import Request, SamplingParams
    from hybridflow.service.async_rollout import _VersionedPool

    pool = FifoPool(random.Random(0), slow=0.001)
    publishing, published = threading.Event(), threading.Event()

    class SlowPublish(FakeWeightSync):
        def publish_for_rollout(self, version):
            publishing.set()
            assert published.wait(30)
            return super().publish_for_rollout(version)

        def start_rollout_sync(self):  # b4554a1's one-step sync: the publish inside it
            if not publishing.is_set():
                publishing.set()
                assert published.wait(30)
            return super().start_rollout_sync()

    gen = AsyncRollout(pool, SlowPublish(pool), lambda: None, lambda step: step, 4, max_staleness=1)
    syncer = threading.Thread(target=gen.sync_weights, args=(1,), daemon=True)
    syncer.start()
    assert publishing.wait(10)
    answered = []
    turn = threading.Thread(target=lambda: answered.append(_VersionedPool(gen).complete([Request((1, 2), SamplingParams(max_new_tokens=2))])))
    turn.start()
    turn.join(10)
    published.set()
    syncer.join(10)
    assert answered and answered[0][0].token_ids == (0, 0), "a turn waited for the weight publish"
