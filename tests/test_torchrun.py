"""torchrun (multi-controller) launch: the same dataflow without Ray, and checkpoints that move
between the two launchers."""

from __future__ import annotations

import json
import os

import pytest

from conftest import rl_overrides, run_torchrun as _torchrun
from hybridflow.config import HybridFlowConfig, load_config
from hybridflow.trainer.rl import RLTrainer

DRIVER = """
import sys
from hybridflow.config import HybridFlowConfig, load_config
from hybridflow.trainer.rl import RLTrainer
trainer = RLTrainer(load_config(None, sys.argv[1:], schema=HybridFlowConfig))
trainer.fit()
"""


def test_torchrun_grpo_learns_like_the_demo(demo_sft_model, tmp_path):
    files, sft_dir = demo_sft_model
    _torchrun("examples/train_ppo.py", "--output-dir", str(tmp_path), "--sft-model", sft_dir, "--data-dir", os.path.dirname(files["train"]),
              "--rl-steps", "30", "trainer.progress_bar=false", "trainer.logger=[jsonl]")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["launcher"] == "torchrun" and summary["world_size"] == 2 and summary["steps"] == 30
    assert summary["val_acc_after_sft"] < 0.3
    assert summary["val_acc_final"] >= 0.6 and summary["val_acc_final"] >= 2 * summary["val_acc_after_sft"]


def _step3(run_dir) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] == 3][-1]


@pytest.mark.usefixtures("ray_cluster")
def test_a_checkpoint_resumes_under_the_other_launcher(tiny_model_dir, task_dir, varied_reward, tmp_path):
    """torchrun 2 steps -> Ray step 3, and Ray 2 steps -> torchrun step 3: both step-3 losses equal
    an uninterrupted Ray run's to 1e-6."""
    base = [f"custom_reward_function.path={varied_reward}", "trainer.save_freq=2"]

    def ray_run(run_dir, steps):
        trainer = RLTrainer(load_config(None, rl_overrides(tiny_model_dir, task_dir, run_dir, *base, f"trainer.total_training_steps={steps}"),
                                        schema=HybridFlowConfig))
        try:
            trainer.fit()
        finally:
            trainer.shutdown()

    def torchrun_run(run_dir, steps):
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        _torchrun(str(script), *rl_overrides(tiny_model_dir, task_dir, run_dir, *base, f"trainer.total_training_steps={steps}",
                                              "trainer.launcher=torchrun"))

    ray_run(tmp_path / "straight", 3)
    torchrun_run(tmp_path / "t2r", 2)
    ray_run(tmp_path / "t2r", 3)
    ray_run(tmp_path / "r2t", 2)
    torchrun_run(tmp_path / "r2t", 3)
    want = _step3(tmp_path / "straight")
    for run in ("t2r", "r2t"):
        got = _step3(tmp_path / run)
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-7), (run, key)
