"""The verl/HybridFlow-style Python surface: `PPOTrainer` with and without a critic (the
quickstart example runs both)."""

from __future__ import annotations

import os
import sys

import pytest

from hybridflow.config import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


def test_ppo_trainer_keywords_map_onto_the_typed_config():
    from hybridflow.trainer.ppo_trainer import ppo_config

    cfg = ppo_config("actor", "critic", {"data": {"train_batch_size": 4}, "trainer.total_training_steps": 5})
    assert (cfg.algorithm.adv_estimator, cfg.critic.model.path, cfg.data.train_batch_size, cfg.trainer.total_training_steps) == ("gae", "critic", 4, 5)
    assert ppo_config("actor").algorithm.adv_estimator == "grpo"
    with pytest.raises(ConfigError, match="did you mean 'trainer.total_training_steps'"):
        ppo_config("actor", None, {"trainer.total_trainig_steps": 5})


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("critic", [False, True])
def test_ppo_trainer_quickstart_with_and_without_a_critic(critic, tmp_path):
    from ppo_trainer_quickstart import main

    result = main(["--output-dir", str(tmp_path), "--steps", "2"] + (["--critic"] if critic else []))
    last = result["history"][-1]
    assert result["steps"] == 2 and "actor/pg_loss" in last
    assert ("critic/vf_loss" in last) == critic  # GAE with the critic; GRPO without
    assert last["reshard/overlap_ratio"] >= 0  # resharding_overlap_with_compute=True took effect
