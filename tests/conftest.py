"""Shared fixtures: an offline tiny model + task data, and one local Ray cluster per session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray worker processes import test-defined worker classes by module name: put tests/ on their path.
_TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)

import inspect  # noqa: E402

import pytest  # noqa: E402

# `slow` means: the test starts Ray, torchrun or a multi-process torch.distributed group. It is
# computed here, not written by hand: a test is slow when it uses the session Ray cluster (directly
# or through a fixture) or its source starts processes in one of these ways. `scripts/test.sh --fast`
# runs the rest; `_fast_tests_start_no_processes` below fails a fast test that starts Ray or a
# process group anyway, so the rule cannot drift.
_STARTS_PROCESSES = ("mp.spawn", "start_processes", "run_torchrun", "torch.distributed.run", "_torchrun(", ".fit(", "init_workers(",
                     "run_sft(", "run_reward_model(", "demo_main(", "quickstart", "bench.", "hybridflow.demo", "RewardModelTrainer(",
                     "DPOTrainer(", "DataFlow(config=", "--calibrate", "_spawn(")


def _starts_processes(item) -> bool:
    """A module whose tests all start processes through a helper says so: STARTS_PROCESSES = True."""
    if "ray_cluster" in getattr(item, "fixturenames", ()) or item.get_closest_marker("vllm") or getattr(item.module, "STARTS_PROCESSES", False):
        return True
    try:
        src = inspect.getsource(item.function)
    except (OSError, TypeError):
        return False
    return any(p in src for p in _STARTS_PROCESSES)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.slow)
    # Files with process-starting tests first, each file's tests in their own order: the two xdist
    # workers (scripts/test.sh, --dist loadfile) take files in this order, so the long ones start
    # early and the many short ones even out the end instead of one long file running alone.
    heavy = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in heavy)


def _started() -> list[str]:
    """What is up in this process now: the Ray client and / or a torch.distributed group."""
    import sys

    ray = sys.modules.get("ray")
    dist = sys.modules.get("torch.distributed")
    return [name for name, on in (("Ray", ray is not None and ray.is_initialized()),
                                  ("a torch.distributed group", dist is not None and dist.is_available() and dist.is_initialized())) if on]


@pytest.fixture(autouse=True)
def _fast_tests_start_no_processes(request):
    """A test not marked slow must not start Ray or a torch.distributed group (one that a slow
    test started earlier in the session, like the session cluster, does not count)."""
    before = set(_started())
    yield
    if request.node.get_closest_marker("slow"):
        return
    started = [s for s in _started() if s not in before]
    if started:
        pytest.fail(f"{request.node.nodeid} is not marked slow but started {' and '.join(started)}: add its way of starting processes "
                    f"to tests/conftest.py _STARTS_PROCESSES", pytrace=False)


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory):
    from hybridflow.data.tasks import make_max_task

    out = tmp_path_factory.mktemp("task")
    make_max_task(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from hybridflow.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from hybridflow.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "llama", arch="llama", hidden_size=64, intermediate_size=128)


@pytest.fixture(scope="session")
def ray_cluster():
    from hybridflow.controller.worker_group import init_ray

    import ray

    # A fake custom resource label, so pools can be placed by label (tests/test_e2e_pools.py).
    init_ray(num_cpus=2, resources={"fake_h100": 4})
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def varied_reward(tmp_path_factory):
    """A reward with spread on an untrained model (its answers are random strings), so
    group-relative advantages are non-zero and every update really moves the weights."""
    path = tmp_path_factory.mktemp("reward") / "length_parity.py"
    path.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(len(solution_str) % 2)\n"
    )
    return path


def rl_overrides(model_dir, task_dir, out_dir, *extra: str) -> list[str]:
    """A small 2-worker RL run on the digit_max task (4 prompts x 4 samples, 3 steps)."""
    return [
        f"data.train_files=[{task_dir}/train.parquet]",
        f"data.val_files=[{task_dir}/val.parquet]",
        "data.train_batch_size=4",
        "data.val_batch_size=64",
        "data.max_prompt_length=32",
        "data.max_response_length=4",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.n=4",
        "trainer.total_training_steps=3",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.progress_bar=false",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={out_dir}",
        *extra,
    ]


def train_and_read_metrics(overrides: list[str], out_dir) -> list[dict]:
    """RLTrainer.fit on `overrides` (trainer.default_local_dir = out_dir, jsonl logger), then the
    run's metrics.jsonl rows."""
    import json

    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.trainer.rl import RLTrainer

    trainer = RLTrainer(load_config(None, overrides, schema=HybridFlowConfig))
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


DEMO_RL_STEPS = 20


@pytest.fixture(scope="session")
def demo_run(ray_cluster, tmp_path_factory):
    """The main job once per test run, as a user types it: `hybridflow demo` (task data, tiny model,
    SFT warm start, then DEMO_RL_STEPS GRPO steps). Returns (output dir, summary.json). Its SFT
    model is the warm start every other e2e test shares (`demo_sft_model`): one SFT per run. Under
    pytest-xdist (scripts/test.sh) the first worker to ask makes it in the directory the workers
    share, under a file lock, and the others wait for it and read it (xdist's own recipe for a
    session fixture made once)."""
    import json

    from filelock import FileLock

    from hybridflow.cli import main as cli_main

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # <basetemp>/popen-gwN -> <basetemp>, shared by the workers of this run
    out = root / "demo_shared" / "demo"
    with FileLock(str(root / "demo_shared.lock")):
        if not (out / "summary.json").exists():
            assert cli_main(["demo", "--output-dir", str(out), "--rl-steps", str(DEMO_RL_STEPS), "trainer.progress_bar=false"]) == 0
    return out, json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="session")
def demo_sft_model(demo_run):
    """The demo's data and SFT warm start: (task files, SFT model dir)."""
    out, _ = demo_run
    files = {k: str(out / "data" / f"{k}.parquet") for k in ("train", "val", "sft", "pref_train", "pref_val")}
    return files, str(out / "sft_model")


ROOT = os.path.dirname(_TESTS)


def run_torchrun(*args: str, timeout: int = 600):
    """`torchrun --standalone --nproc_per_node=2 ARGS` from the repository root; fails the test on a non-zero exit."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def random_rl_batch(vocab: int, rows: int, prompt: int, response: int, seed: int = 0):
    """A seeded micro-batch of random tokens: left-padded prompts of 2..prompt tokens, full responses,
    random advantages (`Batch` with input_ids / attention_mask / position_ids [rows, prompt + response],
    responses / response_mask / advantages [rows, response])."""
    import torch

    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, prompt + 1, (rows,), generator=g)
    mask = torch.cat([(torch.arange(prompt)[None] >= prompt - plen[:, None]).long(), torch.ones(rows, response, dtype=torch.long)], 1)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=g) * mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, prompt:],
                                    "response_mask": torch.ones(rows, response), "advantages": torch.randn(rows, response, generator=g)})


def join_gloo(rank: int, world: int, port: int) -> None:
    """In a spawned test rank: the variables a worker of ours sees, one thread, offline, and the
    gloo group on 127.0.0.1:port."""
    import torch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a gloo group's MASTER_PORT in multi-process tests)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
