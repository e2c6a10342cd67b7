"""The prepared GPU check: scripts/gpu_check.sh's plan (its --dry-run, no GPU needed) lists every
step, runs nothing, and passes config overrides that the validator accepts; the torchrun path it
runs imports no Ray. Its CPU rehearsal (every step executed) is tests/test_gpu_check.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["device", "wheels", "env", "demo", "grpo", "exact", "tables"]


def _dry_run(*args: str, env: dict | None = None) -> str:
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", *args], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_gpu_check_dry_run_prints_every_step_and_runs_nothing(tmp_path):
    for device in ("cuda", "cpu"):
        out = _dry_run("--device", device, env={"GPU_CHECK_OUT": str(tmp_path / "out")})
        assert re.findall(r"^== \[([\w-]+)\]", out, re.M) == STEPS
        assert out.rstrip().endswith("dry run: nothing executed") and not (tmp_path / "out").exists()
        # nothing from a package index: the wheels are installed from the carried folder only
        assert "pip install" in out and all("--no-index" in line for line in out.splitlines() if "pip install" in line)
        assert "--standalone --nproc_per_node=1 examples/train_ppo.py" in out  # the demo through torchrun, one process
    gpu = _dry_run()
    assert "nvidia-smi" in gpu and "--tiny" not in next(x for x in gpu.splitlines() if x.startswith("== [grpo]"))
    # the GPU shapes are printed (the rehearsal runs tiny ones): SmolLM2-135M and Qwen2.5-0.5B
    assert "hidden 576, 30 layers, 9 heads / 3 KV, intermediate 1536, vocab 49152" in gpu
    assert "hidden 896, 24 layers, 14 heads / 2 KV, intermediate 4864, vocab 151936" in gpu
    cpu = _dry_run("--device", "cpu")
    assert "--tiny" in next(x for x in cpu.splitlines() if x.startswith("== [grpo]")) and "vocab 49152" not in cpu
    bad = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "tpu"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--device cuda or cpu" in bad.stderr


def test_gpu_check_overrides_are_valid_config(tiny_model_dir, task_dir, tmp_path):
    """The overrides the demo step and bench/grpo_device.py pass (device aside: cuda is refused on a
    CPU machine) form configs the validator accepts, so a lent GPU is not spent on a config error."""
    import importlib.util

    from hybridflow.config import HybridFlowConfig, load_config, validate_config
    from hybridflow import demo

    spec = importlib.util.spec_from_file_location("grpo_device", os.path.join(ROOT, "bench", "grpo_device.py"))
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    reward = tmp_path / "reward.py"
    reward.write_text(grpo.REWARD)
    plan = _dry_run()
    files = {"train": str(task_dir / "train.parquet"), "val": str(task_dir / "val.parquet")}
    line = next(x for x in plan.splitlines() if x.startswith("== [demo]"))
    demo_overrides = [t for t in line.split() if "=" in t and "." in t.split("=")[0] and not t.startswith("trainer.device=")]
    assert "actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16" in demo_overrides
    launch = ("trainer.launcher=torchrun", "trainer.n_gpus_per_node=1")  # examples/train_ppo.py's, at world size 1
    validate_config(demo.demo_rl_config(files, str(tiny_model_dir), str(tmp_path), 2, *launch, *demo_overrides))
    for size in ("full", "tiny"):
        cfg = load_config(None, grpo.overrides(str(tiny_model_dir), files["train"], str(reward), str(tmp_path), "cpu", size),
                          schema=HybridFlowConfig)
        validate_config(cfg)
        assert cfg.trainer.check_weight_sync and cfg.trainer.launcher == "torchrun"


def test_the_torchrun_path_imports_without_ray():
    """A torchrun-only install (one node, no Ray): with `ray` not importable (hidden by the rehearsal's
    meta-path filter, scripts/gpu_check/sitecustomize.py), the trainer, the torchrun launch, the demo
    and the GPU check's benches import, and none of them loads Ray."""
    code = """
import importlib.util, sys
assert importlib.util.find_spec("ray") is None
try:
    import ray
    raise SystemExit("ray imported")
except ModuleNotFoundError:
    pass
import importlib
from hybridflow.config.validate import CHECK_MODULES
# examples/train_ppo.py's imports, the async rollout's replicas (Ray at use only), what validating a config imports
for m in ("trainer.rl", "trainer.sft", "controller.local_group", "controller.worker_group", "demo", "models.tiny", "service.replicas", "service.managers"):
    importlib.import_module("hybridflow." + m)
for m in CHECK_MODULES:
    importlib.import_module(m)
sys.path.insert(0, "bench")
import grpo_device, exact_device  # noqa: F401
assert "ray" not in sys.modules
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "scripts", "gpu_check"), "HYBRIDFLOW_HIDE_MODULES": "ray", "HYBRIDFLOW_HIDE_DISTS": "ray"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
