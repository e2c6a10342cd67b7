"""Two Ray nodes on one machine (`tests/two_nodes.py`: a head and a second raylet on loopback,
each with its own custom resource label; run in a subprocess, since this process holds the
session's single-node cluster). Placement by label, the hybrid engine's node boundary and the
cross-pool transfer measured against the planner, a node lost mid-run, and the resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTS_PROCESSES = True  # every test runs a two-node Ray cluster (conftest marks them slow)


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "two_nodes.py"), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, err[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _run(*args: str) -> dict:
    return _result(_start(*args))


@pytest.fixture(scope="module")
def spread_run(tiny_model_dir, task_dir, varied_reward, tmp_path_factory):
    """The 2-node spread run, started when the module's first test asks for it and read by the
    spread test: it runs beside the split runs (each its own two-node cluster), not after them."""
    proc = _start("spread", tmp_path_factory.mktemp("spread") / "run", tiny_model_dir, task_dir, varied_reward)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _model_bytes(model_dir) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() * p.element_size() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())


def test_pools_on_two_nodes_train_lose_a_node_and_resume(spread_run, tiny_model_dir, task_dir, varied_reward, tmp_path):
    """PPO with the actor pool on node a, critic + reference and the async rollout on node b: the
    cross-pool transfer moves the rollout rank's generation slice (gen_tp 1: the whole model) each
    step; killing node b after step 2's checkpoint gives a named error within 60 s, and the same
    command resumes from step 2."""
    run = tmp_path / "run"
    killed = _run("split", run, tiny_model_dir, task_dir, varied_reward, "--kill-at", 3)
    assert killed["worker_nodes"] == {"a_pool": ["a", "a"], "b_pool": ["b"], "c_pool": ["b"]}
    # the reward workers sit on the driver's node (a), so losing b loses none (a soft affinity put some on b,
    # and a full-suite run then stopped on the reward workers' deaths instead of the pool's)
    assert killed["reward_worker_nodes"] and set(killed["reward_worker_nodes"]) == {"a"}, killed["reward_worker_nodes"]
    err = killed["error"] or ""
    assert err.startswith("WorkerDiedError") and "pool '" in err and "resume" in err, err
    assert killed["kill_to_error_s"] is not None and killed["kill_to_error_s"] < 60
    assert (run / "global_step_2").is_dir()

    resumed = _run("split", run, tiny_model_dir, task_dir, varied_reward)
    assert resumed["error"] is None, resumed["error"]
    hist = resumed["history"]
    assert [h["step"] for h in hist] == [3, 4]  # from the step-2 checkpoint
    model_bytes = _model_bytes(tiny_model_dir)
    assert all(h["reshard/bytes_per_rank"] == model_bytes for h in hist)  # all of it crosses from node a to node b
    assert all(h["critic/vf_loss"] > 0 for h in hist)


def test_an_actor_pool_spread_over_two_nodes_crosses_them_as_planned(spread_run):
    """2 nodes x 1 rank: the pool's ranks per node reach the engine's plan, and every byte a rank
    receives in the switch crosses the node boundary: measured (each rank's bytes received) ==
    the plan's cross-node bytes == its per-rank minimum summed."""
    r = _result(spread_run)
    assert r["error"] is None, r["error"]
    assert sorted(r["worker_nodes"]["a_pool"]) == ["a", "b"]  # one rank on each node, by the "trainer" label
    assert [h["step"] for h in r["history"]] == [1, 2, 3, 4]
    plan = r["plan"]
    measured = sum(r["received_per_rank"])
    assert measured == plan["cross_node_bytes"] == sum(plan["min_bytes_per_rank"]) > 0
    assert all(h["reshard/cross_node_bytes"] == plan["cross_node_bytes"] for h in r["history"])
