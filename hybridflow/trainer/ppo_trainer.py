"""`PPOTrainer`: the verl/HybridFlow-style constructor over the one typed config.

    from hybridflow import PPOTrainer
    trainer = PPOTrainer(actor_model="runs/sft_model", critic_model=None,          # None: GRPO (critic-free)
                         parallel_config="configs/parallel_dp2_tp2.yaml",  # or a dict of its keys
                         enable_resharding_opt=True,
                         resharding_overlap_with_compute=True,  # next batch prepared while the workers reshard
                         data={"train_files": ["runs/data/train.parquet"]},         # a section as a dict
                         **{"trainer.total_training_steps": 20})                    # or dotted keys
    trainer.fit()

Every keyword maps onto `HybridFlowConfig` (a section name takes a dict, a dotted key a value) and
the whole config is validated before Ray or any worker starts, exactly as `hybridflow train`.
`critic_model` given: PPO with GAE and that critic (algorithm.adv_estimator=gae unless set).
"""

from __future__ import annotations

import os
from typing import Any

from hybridflow.config import HybridFlowConfig, to_dict
from hybridflow.config.loader import _merge, dotted_tree, from_dict
from hybridflow.config.parallel import ENGINE_KWARGS, ParallelConfig
from hybridflow.trainer.rl import RLTrainer


def ppo_config(actor_model: str, critic_model: str | None = None, overrides: dict[str, Any] | None = None) -> HybridFlowConfig:
    """The typed config for `PPOTrainer`'s arguments (unknown keys name the closest valid one)."""
    tree = to_dict(HybridFlowConfig())
    tree = _merge(tree, dotted_tree("actor_rollout_ref.model.path", os.fspath(actor_model)))
    if critic_model is not None:
        tree = _merge(tree, {"algorithm": {"adv_estimator": "gae"}, "critic": {"model": {"path": os.fspath(critic_model)}}})
    for key, value in (overrides or {}).items():
        tree = _merge(tree, dotted_tree(key, value))
    return from_dict(HybridFlowConfig, tree)


class PPOTrainer(RLTrainer):
    def __init__(self, actor_model: str, critic_model: str | None = None, parallel_config: "str | dict | ParallelConfig | None" = None,
                 **kwargs: Any):
        engine = {k: kwargs.pop(k) for k in list(kwargs) if k in ENGINE_KWARGS}
        super().__init__(ppo_config(actor_model, critic_model, kwargs), parallel_config=parallel_config, **engine)
