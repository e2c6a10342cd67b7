"""Rewards on a pool of reward workers (reward_model.num_workers, hybridflow/rewards/workers.py).

The pool gives exactly the driver's scores, metrics and extras on a mix of math and code samples,
with more chunks in flight than workers; a sample past custom_reward_function.timeout_s has its
sandbox processes killed (checked by pid from outside, a child that left its process group with
setsid included) and no further test case started; a SIGKILLed worker is replaced and its chunk
scored again; a sample that kills its worker every time stops the call with one line naming it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid

import pytest
import torch

from hybridflow.config import ConfigError
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.config.validate import validate_config
from hybridflow.protocol import Batch
from hybridflow.rewards import workers
from hybridflow.rewards.loader import load_custom_reward_fn
from hybridflow.rewards.manager import RewardManager
from hybridflow.rewards.workers import RewardWorkerError, worker_count


class _CharTokenizer:
    """One token per character (any text round-trips, code included)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def _batch(samples: list[tuple[str, str, object]]) -> Batch:
    """(data_source, response text, ground truth) per row; the response padded with 0s, mask 0 there."""
    T = max(len(text) for _, text, _ in samples) + 2
    ids = torch.zeros((len(samples), T), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (_, text, _) in enumerate(samples):
        ids[i, :len(text)] = torch.tensor([ord(c) for c in text])
        mask[i, :len(text)] = 1
    return Batch(tensors={"responses": ids, "response_mask": mask},
                 non_tensors={"data_source": [s for s, _, _ in samples], "reward_model": [{"ground_truth": g} for _, _, g in samples],
                              "extra_info": [{"index": i} for i in range(len(samples))]})


ADD = "```python\ndef add(a, b):\n    return a + b\n```"
ECHO = "```python\nprint(input()[::-1])\n```"
LOOP_CHECK = "for i in range(2):\n    assert add(i, 1) == i + 1"
MIX = [  # math (exact, gsm8k, boxed: numbers, no symbolic helper) and code (asserts, stdin, call-based, in-process, broken)
    ("arith_add", "so 12", "12"), ("arith_add", "13", "12"), ("openai/gsm8k", "#### 1,234", "1234"), ("gsm8k", "72", "72"),
    ("math", "\\boxed{42}", "42"), ("math", "the answer is \\boxed{41}", "42"), ("math", "no answer", "3"),
    ("code", ADD, ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]),
    ("code", ECHO, [{"input": "abc", "output": "cba"}, {"input": "xy", "output": "xy"}]),
    ("code", ADD, {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}),
    ("code", ADD, [LOOP_CHECK, "assert add(0, 0) == 0"]),  # one check graded in-process: reward/code_inprocess_checks
    ("code", "```python\nraise SystemExit(3)\n```", [{"input": "", "output": ""}]),
    ("code", ADD, {"inputs": ["1"], "outputs": ["1", "2"]}),  # malformed ground truth: an error sample
    ("arith_add", "7", "7"),
]


def test_pool_gives_the_drivers_scores_metrics_and_extras(ray_cluster):
    batch = _batch(MIX)
    here = RewardManager(_CharTokenizer(), timeout_s=60)
    pool = RewardManager(_CharTokenizer(), timeout_s=60, num_workers=2)
    try:
        expected, expected_metrics = here(batch)
        got, metrics = pool(batch)
        assert pool.pool is not None and here.pool is None
        assert len(MIX) > 2 * workers.CHUNKS_PER_WORKER  # chunks of 2: 7 chunks on 2 workers
        assert torch.equal(got, expected) and metrics == expected_metrics
        assert (pool.last_scores, pool.last_preds, pool.last_extras, pool.last_decoded) == \
            (here.last_scores, here.last_preds, here.last_extras, here.last_decoded)
        assert metrics["reward/errors"] == 1.0 and metrics["reward/code_inprocess_checks"] == 1.0 and metrics["reward/timeouts"] == 0.0
        assert 0 < metrics["reward/mean"] < 1
        assert os.getpid() not in pool.pool.pids()
    finally:
        pool.close()


_SLOW_FN = """
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "die":
        os.kill(os.getpid(), 9)  # kills its worker, every time
    time.sleep(float(ground_truth))
    return {"score": float(len(solution_str)), "pid": float(os.getpid())}
"""


def test_a_file_reward_runs_on_every_worker_and_a_killed_worker_is_replaced(ray_cluster, tmp_path, monkeypatch):
    path = tmp_path / "slow_reward.py"
    path.write_text(_SLOW_FN)
    fn = load_custom_reward_fn(str(path))
    samples = [("mine", "x" * (i % 5 + 1), "0.15") for i in range(16)]
    mgr = RewardManager(_CharTokenizer(), fn, num_workers=2)
    try:
        scores, metrics = mgr(_batch(samples[:4]))  # starts the pool
        pids = mgr.pool.pids()
        assert set(mgr.last_extras["pid"]) == set(map(float, pids))  # a function loaded from a file, scored on both workers
        victim = pids[0]
        out: dict = {}
        call = threading.Thread(target=lambda: out.update(result=mgr(_batch(samples))))
        call.start()
        time.sleep(0.4)  # both workers busy (chunks of 2 samples, 0.3 s each)
        os.kill(victim, signal.SIGKILL)
        call.join(60)
        scores, metrics = out["result"]
        assert scores.sum(-1).tolist() == [float(i % 5 + 1) for i in range(16)] and metrics["reward/errors"] == 0.0
        assert mgr.pool.restarts == 1 and mgr.pool.rescored_samples >= 1
        now = mgr.pool.pids()
        assert victim not in now and set(now) - set(pids) <= set(map(int, mgr.last_extras["pid"]))  # the new worker scored too

        monkeypatch.setattr(workers, "MAX_TRIES", 2)
        with pytest.raises(RewardWorkerError, match=r"reward worker \d \(reward_model.num_workers\) failed 2 times scoring sample 2 of the batch"):
            mgr(_batch([("mine", "a", "0"), ("mine", "b", "0"), ("mine", "die", "0"), ("mine", "c", "0")]))
    finally:
        mgr.close()


_MARK = f"hf-reward-timeout-{uuid.uuid4().hex}"
# Re-execs itself with a marker in its argv, then starts two children with it (one in a session of its own), and sleeps.
_HANGS = f"""```python
import os, subprocess, sys, time
if {_MARK!r} not in sys.argv:
    os.execv(sys.executable, [sys.executable, "-u", "main.py", {_MARK!r}])
# shells start in milliseconds where a Python took seconds under load; "; exit 0" keeps each shell (its argv marked) alive
subprocess.Popen(["/bin/sh", "-c", "sleep 120; exit 0", {_MARK!r}])
subprocess.Popen(["/bin/sh", "-c", "sleep 120; exit 0", {_MARK!r}], start_new_session=True)  # one that left the process group (setsid)
time.sleep(120)
```"""


def _marked() -> set[int]:
    """Pids of the processes (anywhere on this machine, seen from outside the sandbox) with the marker in their argv."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if _MARK.encode() in f.read():
                        out.add(int(entry))
            except OSError:
                continue
    return out


def _alive_with_mark(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return _MARK.encode() in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("num_workers", [1, 0])
def test_a_sample_past_its_timeout_has_its_sandboxes_killed(ray_cluster, num_workers):
    cases = [{"input": "", "output": "never"}] * 3  # without the deadline: 3 runs of 6 s (the code reward's wall limit)
    # 3 s: the program starts 2 Pythons (itself, its exec) and two shells before the deadline (4 Pythons took over 1.5 s
    # at load average ~50, and over 3 s once in a full-suite run); still under one run's 6 s wall limit with the 2.5 s slack below
    mgr = RewardManager(_CharTokenizer(), timeout_s=3.0, num_workers=num_workers)
    try:
        if num_workers:
            mgr(_batch([("arith_add", "1", "1")]))  # the pool is up before the clock matters
        out: dict = {}
        started = time.monotonic()
        call = threading.Thread(target=lambda: out.update(result=mgr(_batch([("code", _HANGS, cases), ("arith_add", "4", "4")]))))
        call.start()
        seen: set[int] = set()
        while call.is_alive():
            seen |= _marked()
            time.sleep(0.05)
        took = time.monotonic() - started
        scores, metrics = out["result"]
        assert len(seen) >= 3, f"the sandboxed program never ran (marked processes seen: {seen})"  # itself and its two children
        assert [p for p in seen if _alive_with_mark(p)] == []  # killed by the time the manager returned
        assert metrics["reward/timeouts"] == 1.0 and scores.sum(-1).tolist() == [0.0, 1.0]
        assert took < 3.0 + 2.5, took  # not the 6 s wall limit of one run
        time.sleep(0.5)
        assert _marked() == set()  # and no further test case of the sample started
    finally:
        mgr.close()


def test_worker_count_and_the_key(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as without Ray (or with Ray not initialised)
    assert worker_count(None) == 0 and worker_count(0) == 0
    with pytest.raises(RewardWorkerError, match="reward_model.num_workers=2: reward workers are Ray actors"):
        worker_count(2)
    assert HybridFlowConfig().reward_model.num_workers is None
    for value, problem in ((-1, "reward_model.num_workers must be an integer >= 0"),
                           (2, "reward_model.num_workers=2: reward workers are Ray actors and trainer.launcher=torchrun")):
        cfg = HybridFlowConfig()
        cfg.reward_model.num_workers = value
        cfg.trainer.launcher = "torchrun"
        with pytest.raises(ConfigError) as e:
            validate_config(cfg)
        assert problem in str(e.value)
