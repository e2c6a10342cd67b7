"""The prepared GPU script: scripts/gpu_check.sh's plan (its --dry-run, no GPU needed) lists every
step, runs nothing, and passes config overrides that the validator accepts."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_dry_run_prints_every_step_and_runs_nothing(tmp_path):
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out")})
    assert proc.returncode == 0, proc.stderr
    steps = re.findall(r"^== \[([\w-]+)\]", proc.stdout, re.M)
    assert steps == ["device", "venv-cuda", "venv-vllm", "exact-cuda", "demo-bf16-nccl", "switch-bit-exact", "bench-reshard", "vllm-grpo", "tables"]
    assert proc.stdout.rstrip().endswith("dry run: nothing executed") and not (tmp_path / "out").exists()


def test_gpu_check_demo_overrides_are_valid_config(tiny_model_dir, task_dir, tmp_path):
    """The overrides the GPU demo steps pass (device aside: cuda is refused on a CPU machine) form
    a config the validator accepts, so a lent GPU is not spent on a config error."""
    from hybridflow.config import validate_config
    from hybridflow.demo import demo_rl_config

    plan = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], capture_output=True, text=True, timeout=60, cwd=ROOT).stdout
    files = {"train": str(task_dir / "train.parquet"), "val": str(task_dir / "val.parquet")}
    for name in ("demo-bf16-nccl", "vllm-grpo"):
        line = next(x for x in plan.splitlines() if x.startswith(f"== [{name}]"))
        overrides = [t for t in line.split() if "=" in t and "." in t.split("=")[0] and not t.startswith("trainer.device=")]
        assert overrides, line
        cfg = demo_rl_config(files, str(tiny_model_dir), str(tmp_path), 2, *[o for o in overrides if not o.startswith("actor_rollout_ref.rollout.name=")])
        validate_config(cfg)
