"""64 sandboxed black-box agents at once on 2 cores finish a GRPO step: each a process of its own in
the OS sandbox (tests/fixtures/agents/print_reward.py: one chat completion through its session, then
the reward its row names printed), all in flight together on a rollout manager, with the default
agent.timeout_s. Before the fix (b4554a1), six in flight held every thread of the driver's default
executor and the step's agents all ran to their timeout and scored 0; here none times out and each
trajectory trains with exactly the reward its program printed."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import rl_overrides

AGENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "agents", "print_reward.py")


def _rows(n: int, offset: int) -> list[dict]:
    return [{"data_source": "agent", "prompt": [{"role": "user", "content": f"row {offset + i}"}],
             "reward_model": {"style": "rule", "ground_truth": ""}, "extra_info": {"reward": (offset + i) / 100}} for i in range(n)]


@pytest.mark.timeout(600)
def test_64_sandboxed_agents_at_once_finish_a_grpo_step_with_the_rewards_they_print(ray_cluster, tiny_model_dir, tmp_path):
    from hybridflow.agent.sandbox import SandboxUnavailable, default_sandbox
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.data.tasks import write_parquet
    from hybridflow.trainer.rl import RLTrainer

    try:
        default_sandbox()
    except SandboxUnavailable as e:
        pytest.skip(f"no OS sandbox on this machine: {e}")
    write_parquet(_rows(8, 0), tmp_path / "train.parquet")
    write_parquet(_rows(8, 50), tmp_path / "val.parquet")
    cfg = load_config(None, rl_overrides(tiny_model_dir, tmp_path, tmp_path / "out",
                                         "data.max_prompt_length=64", "data.max_response_length=32", "data.train_batch_size=8",
                                         "actor_rollout_ref.rollout.n=8", "trainer.total_training_steps=1", "algorithm.adv_estimator=grpo",
                                         "actor_rollout_ref.rollout.multi_turn.enable=true", "trainer.val_before_train=false", "trainer.test_freq=0",
                                         f"actor_rollout_ref.rollout.agent.command={sys.executable} {AGENT}",
                                         "actor_rollout_ref.rollout.agent.sandbox=true", "trainer.async_rollout=true",
                                         "async_training.max_staleness=0", "resource_pool.pools.actor_pool.workers_per_node=1",
                                         "resource_pool.pools.rollout_pool.workers_per_node=1", "resource_pool.mapping.actor_rollout=actor_pool",
                                         "resource_pool.mapping.rollout=rollout_pool"), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        history = [h for h in trainer.fit()["history"] if h["step"] > 0]
        trajs = trainer.agent.last
    finally:
        trainer.shutdown()
    m = history[0]
    assert len(trajs) == 64 and m["agent/agent_timeouts"] == 0.0 and m["agent/agent_errors"] == 0.0
    assert trainer.managers is None or m["rollout/manager_restarts"] == 0.0
    assert sorted(round(t.reward, 2) for t in trajs) == sorted(r["extra_info"]["reward"] for r in _rows(8, 0) for _ in range(8))
    assert all(t.session_kind == "openai" and sum(t.response_mask) > 0 for t in trajs)  # each one's model tokens trained
