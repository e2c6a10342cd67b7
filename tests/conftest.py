"""Shared fixtures: an offline tiny model + task data, and one local Ray cluster per session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray worker processes import test-defined worker classes by module name: put tests/ on their path.
_TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)

import pytest  # noqa: E402


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


@pytest.fixture(scope="session")
def demo_sft_model(ray_cluster, tmp_path_factory):
    """The demo's data and SFT warm start, once per session: (task files, SFT model dir)."""
    from hybridflow.data.tasks import make_max_task
    from hybridflow.demo import demo_sft_config
    from hybridflow.models.tiny import make_tiny_model
    from hybridflow.trainer.sft import run_sft

    out = tmp_path_factory.mktemp("demo_sft")
    files = make_max_task(out / "data")
    base = make_tiny_model(out / "tiny_model", hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    cfg = demo_sft_config(files["sft"], str(base), str(out))
    cfg.trainer.logger = ["jsonl"]
    run_sft(cfg)
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
