"""Reward workers: the reward function and the code reward's sandboxes on a pool of CPU Ray actors
(``reward_model.num_workers``, verl's name), instead of one sample after another on the driver.

The driver decodes the responses (it holds the tokenizer) and sends the samples as plain values in
chunks of consecutive samples, at most one chunk in flight per worker: a worker that finishes gets
the next chunk, so a slow chunk (hanging programs) does not hold the others back. Each worker scores
its chunk with ``scoring.score_sample``, exactly what the driver does without workers (the same
timeout, the same per-sample deadline for sandboxes); the driver puts the results back in order and
adds them up (``manager.py``), so scores, metrics and extras are the ones the driver alone computes.

A worker that dies (SIGKILL, out of memory) is replaced in its slot and its chunk is scored again
on the new one (a reward is a pure function of the sample: scoring twice changes nothing). With
``custom_reward_function.timeout_s`` a chunk also has a deadline (every sample's timeout plus the
time to stop its sandboxes, plus a start allowance): a worker past it (stuck in code that holds the
GIL, where even the per-sample timeout cannot run) is killed and handled as dead. A chunk whose
worker died ``MAX_TRIES`` times stops the call with one line naming the worker and the samples.

Ray stays optional: it is imported only when a pool starts, and with no Ray or no workers the
manager scores on the driver as before.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import re
import sys
import threading
import time
from typing import Any, Callable, Sequence

from hybridflow.rewards.scoring import STOP_GRACE_S, SampleResult, score_sample

logger = logging.getLogger(__name__)

KEY = "reward_model.num_workers"
CHUNKS_PER_WORKER = 4  # a batch is cut into about this many chunks per worker: fewer Ray calls, still balanced at the end
MAX_TRIES = 3  # a chunk whose worker died this many times stops the call (a sample that kills its worker every time)
START_ALLOWANCE_S = 120.0  # a chunk's deadline includes a worker's start (a fresh process importing the reward function)
POLL_S = 0.2  # how often the driver, waiting for chunks, checks their deadlines


class RewardWorkerError(RuntimeError):
    """A reward worker failed in a way a replacement does not fix; the message names it."""


def worker_count(num_workers: int | None) -> int:
    """How many reward workers a manager uses: ``reward_model.num_workers``, or when it is None (the
    default) one per CPU up to 4 when Ray is initialised, else 0 (the driver scores).

    Why at most 4 by default: what a worker does is mostly start sandboxes (fork, namespaces, a
    Python interpreter: CPU work of its own) and wait for them, so more workers than cores only
    queue on the same cores, and on a node that also runs the model workers the reward should not
    take every core. Each worker is a Python process (tens of MB). A node with many idle cores and
    slow rewards (code with many test cases) gains from more: set the key (verl's examples use 8-64).
    Why 0 without Ray: the reward workers are Ray actors, and torchrun / no-Ray installs have none."""
    ray = sys.modules.get("ray")  # never imported here: with no Ray initialised there is nothing to ask
    ray_up = ray is not None and ray.is_initialized()
    if num_workers is None:
        return min(4, os.cpu_count() or 1) if ray_up else 0
    if num_workers > 0 and not ray_up:
        raise RewardWorkerError(f"{KEY}={num_workers}: reward workers are Ray actors and Ray is not initialised in this process "
                                f"(ray.init, or hybridflow's init_ray; a torchrun run has no Ray): set {KEY}=0 to score on the driver")
    return num_workers


def portable(compute_score: Callable) -> tuple:
    """What a worker rebuilds the reward function from. A function loaded from
    ``custom_reward_function.path`` travels as (path, name) and is loaded again there (its module is
    importable in this process only); anything else is pickled by Ray (by reference when its module
    is importable, by value otherwise)."""
    from hybridflow.rewards.loader import origin_of

    origin = origin_of(compute_score)
    return ("file", *origin) if origin is not None else ("object", compute_score)


class RewardWorker:
    """One reward worker (a Ray actor): scores chunks of samples with the reward function."""

    def __init__(self, scorer: tuple, timeout_s: float | None):
        if scorer[0] == "file":
            from hybridflow.rewards.loader import load_custom_reward_fn

            self.compute_score = load_custom_reward_fn(scorer[1], scorer[2])
        else:
            self.compute_score = scorer[1]
        self.timeout_s = timeout_s

    def pid(self) -> int:
        return os.getpid()

    def score(self, items: Sequence[tuple]) -> list[SampleResult]:
        """(data_source, solution_str, reward_model, extra_info) per sample -> their results, in order;
        stops after a configuration error (no scorer for a data_source), as the driver does."""
        out = []
        for item in items:
            out.append(score_sample(self.compute_score, self.timeout_s, *item))
            if out[-1].status == "config":
                break
        return out


class RewardWorkerPool:
    """The driver's handle on ``n`` reward workers: scores a batch's samples on them, in chunks."""

    def __init__(self, n: int, compute_score: Callable, timeout_s: float | None):
        import ray

        self.n, self.timeout_s = n, timeout_s
        self.scorer = portable(compute_score)
        self.remote_cls = ray.remote(RewardWorker)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # On the driver's node, hard: a soft affinity put 2 of 4 such actors on another node of a two-node
        # cluster (Ray 2.x, num_cpus=0), where custom_reward_function.path may not exist and whose loss
        # killed them (tests/test_e2e_two_nodes.py). The driver's node lost is the driver lost, so a hard
        # affinity never strands a worker.
        self.placement = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self.lock = threading.Lock()  # the actors and their incarnations vs a replacement (never held across a wait)
        self.actors: list[Any] = [None] * n
        self.incarnation = [0] * n
        self.restarts = 0  # workers replaced over the pool's life
        self.rescored_samples = 0
        for i in range(n):
            self._start(i)

    def _start(self, i: int) -> None:
        # num_cpus=0: a worker mostly waits on its sandboxes (processes Ray does not account for); reserving CPUs would
        # compete with the model workers' placement groups and could leave the pool waiting for resources that never free.
        # On the driver's node: the default count is that machine's CPUs, and custom_reward_function.path is a path there.
        actor = self.remote_cls.options(num_cpus=0, max_concurrency=2, scheduling_strategy=self.placement).remote(self.scorer, self.timeout_s)
        with self.lock:
            self.actors[i] = actor

    def pids(self, timeout_s: float = 60.0) -> list[int]:
        """The workers' process ids (each waits for its worker to have started)."""
        import ray

        with self.lock:
            actors = list(self.actors)
        return [int(p) for p in ray.get([a.pid.remote() for a in actors], timeout=timeout_s)]

    def chunk_deadline_s(self, size: int) -> float | None:
        """The longest a chunk of ``size`` samples may take on a worker (None without timeout_s: no limit was set)."""
        if self.timeout_s is None:
            return None
        return START_ALLOWANCE_S + size * (self.timeout_s + STOP_GRACE_S)

    def score(self, items: Sequence[tuple]) -> list[SampleResult]:
        """Every sample's result, in the order of ``items`` (see the module docstring)."""
        import ray

        if not items:
            return []
        size = max(1, math.ceil(len(items) / (self.n * CHUNKS_PER_WORKER)))
        chunks = [list(items[s:s + size]) for s in range(0, len(items), size)]
        done: list[list[SampleResult] | None] = [None] * len(chunks)
        tries = [0] * len(chunks)
        todo = collections.deque(range(len(chunks)))
        idle = collections.deque(range(self.n))
        in_flight: dict[Any, tuple[int, int, int, float]] = {}  # ref -> (chunk, worker, its incarnation, submitted at)
        overdue: dict[int, str] = {}  # worker -> why it was killed (past its chunk's deadline)
        while todo or in_flight:
            while todo and idle:
                c, w = todo.popleft(), idle.popleft()
                with self.lock:
                    actor, inc = self.actors[w], self.incarnation[w]
                in_flight[actor.score.remote(chunks[c])] = (c, w, inc, time.monotonic())
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=POLL_S)
            for ref in ready:
                c, w, inc, _started = in_flight.pop(ref)
                try:
                    done[c] = ray.get(ref)
                except ray.exceptions.RayActorError as e:  # the worker died (or was killed past its deadline): the chunk again, on a new one
                    why = overdue.pop(w, None) or _death(e)
                    tries[c] += 1
                    self._replace(w, inc, why)
                    if tries[c] >= MAX_TRIES:
                        raise RewardWorkerError(f"reward worker {w} ({KEY}) failed {tries[c]} times scoring {_span(c * size, len(chunks[c]))} of "
                                                f"the batch (each time replaced and the samples sent again); last: {why}") from None
                    self.rescored_samples += len(chunks[c])
                    todo.appendleft(c)
                except ray.exceptions.RayTaskError as e:  # the worker's code raised (not the reward function's: that is a scored error)
                    raise RewardWorkerError(f"reward worker {w} ({KEY}) raised scoring {_span(c * size, len(chunks[c]))}: "
                                            f"{_first_line(e)}") from None
                idle.append(w)
            now = time.monotonic()
            for ref, (c, w, inc, started) in in_flight.items():
                limit = self.chunk_deadline_s(len(chunks[c]))
                if limit is not None and now - started > limit and w not in overdue:
                    overdue[w] = (f"no result within {limit:.0f} s for {len(chunks[c])} samples "
                                  f"(custom_reward_function.timeout_s={self.timeout_s} each): killed")
                    with self.lock:
                        actor = self.actors[w] if self.incarnation[w] == inc else None
                    if actor is not None:
                        with contextlib.suppress(Exception):
                            ray.kill(actor, no_restart=True)  # its result ref now fails: handled above as a dead worker
        return [r for part in done for r in part]

    def _replace(self, w: int, seen: int, why: str) -> None:
        """Worker ``w`` (in incarnation ``seen``) died: a new one in its slot, unless that happened already."""
        import ray

        with self.lock:
            if self.incarnation[w] != seen:
                return
            old = self.actors[w]
            self.incarnation[w] += 1
            self.restarts += 1
        logger.warning("reward worker %d: %s; started a new one in its slot, its samples are scored again", w, why)
        with contextlib.suppress(Exception):
            ray.kill(old, no_restart=True)
        self._start(w)

    def shutdown(self) -> None:
        import ray

        with self.lock:
            actors, self.actors = self.actors, []
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)


def _span(first: int, n: int) -> str:
    return f"sample {first}" if n == 1 else f"samples {first}-{first + n - 1}"


def _death(e: BaseException) -> str:
    """What Ray says of a dead worker, in one line: its first line, the process id and Ray's exit type."""
    text = str(e)
    found = [f"{label} {m.group(1)}" for label, pattern in (("pid", r"\bpid: (\d+)"), ("exit type", r"Worker exit type: (\w+)"))
             if (m := re.search(pattern, text))]
    return _first_line(e).rstrip(".") + (f" ({', '.join(found)})" if found else "")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
