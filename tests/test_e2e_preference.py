"""Preference learning end to end on 2 FSDP2 workers (the session's Ray cluster and SFT model):
the demo recipes shortened, with the demo's held-out greedy accuracy (rule scorer) as the bar."""

from __future__ import annotations

import math

import pytest

from hybridflow.config.pools import Role
from hybridflow.demo import demo_dpo_config, run_recipe
from hybridflow.trainer.dpo import DPOTrainer

pytestmark = pytest.mark.usefixtures("ray_cluster")
QUIET = ("trainer.logger=[jsonl]", "trainer.progress_bar=false")


def _assert_learned(run: dict) -> None:
    (_, before), (_, after) = run["val_curve"][0], run["val_curve"][-1]
    assert before < 0.3, run["val_curve"]  # the SFT model prefers the wrong rule
    assert after >= 0.6 and after >= 2 * before, run["val_curve"]


def test_offline_dpo_learns_and_its_first_step_is_log_2(demo_sft_model, tmp_path):
    files, sft_dir = demo_sft_model
    run = run_recipe("dpo", files, sft_dir, str(tmp_path), 20, *QUIET)
    first = run["history"][1]  # one optimizer step per step: step 1's metrics are all before any update
    assert first["step"] == 1
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert run["history"][-1]["rewards/accuracies"] > 0.9
    _assert_learned(run)


def _dpo(files, sft_dir, out, steps, *extra):
    return DPOTrainer(demo_dpo_config(files, sft_dir, str(out), steps, "dpo.precompute_ref_log_probs=true", "trainer.test_freq=-1",
                                      "trainer.val_before_train=false", "trainer.resume_mode=auto", *QUIET, *extra))


def _fit(trainer):
    try:
        return trainer.fit()["history"]
    finally:
        trainer.shutdown()


def test_dpo_precomputed_reference_resumes_bit_exact(demo_sft_model, tmp_path):
    """No reference model in memory; the cache is in the checkpoint; 2 steps + resume + 2 steps
    equals 4 uninterrupted steps exactly."""
    files, sft_dir = demo_sft_model
    straight = _dpo(files, sft_dir, tmp_path / "a", 4)
    assert Role.REF not in straight.role_pool
    full = _fit(straight)
    assert full[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # the cache is the initial policy's own log-probs
    _fit(_dpo(files, sft_dir, tmp_path / "b", 2, "trainer.save_freq=2"))
    resumed_trainer = _dpo(files, sft_dir, tmp_path / "b", 4)
    resumed = _fit(resumed_trainer)
    assert [h["step"] for h in resumed] == [3, 4]
    for key in ("train/loss", "rewards/margins", "logps/chosen", "actor/grad_norm"):
        assert [h[key] for h in resumed] == [h[key] for h in full[2:]], key


def test_online_dpo_learns_from_ranked_samples(demo_sft_model, tmp_path):
    files, sft_dir = demo_sft_model
    run = run_recipe("online-dpo", files, sft_dir, str(tmp_path), 20, *QUIET)
    assert run["history"][1]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert run["history"][-1]["critic/score/mean"] > run["history"][1]["critic/score/mean"]
    _assert_learned(run)


def test_rm_grpo_with_the_reward_model_on_its_own_pool(demo_sft_model, tmp_path):
    """Train a reward model on the pairs (held-out pairwise accuracy >= 0.9), then GRPO whose only
    reward is that model, placed on a 1-worker pool of its own while the actor has 2."""
    files, sft_dir = demo_sft_model
    pools = ("resource_pool.pools.actor_pool.workers_per_node=2", "resource_pool.pools.rm_pool.workers_per_node=1",
             "resource_pool.mapping.actor_rollout=actor_pool", "resource_pool.mapping.reward_model=rm_pool")
    run = run_recipe("rm-grpo", files, sft_dir, str(tmp_path), 20, *QUIET, *pools)
    assert run["rm_val_pair_acc"] >= 0.9
    assert "perf/pool_busy/rm_pool" in run["history"][-1] and "reward/mean" not in run["history"][-1]  # no rule reward ran
    _assert_learned(run)
