"""PPO (GAE with a critic) written as `add_stage` calls, on workers the trainer places on pools.

Run `hybridflow demo` first (it writes runs/demo/sft_model and runs/demo/data), then:

    python examples/ppo_dataflow.py [MODEL_DIR] [DATA_DIR] [STEPS]

The actor (FSDP2, 2 workers) and the critic (1 worker) live on separate pools, so the scheduler
runs `values` alongside `old_log_prob` and `update_critic` alongside `update_actor`. Sizes are
global (all workers of the stage's pool together); see hybridflow/trainer/dataflow.py.
"""

from __future__ import annotations

import sys

from hybridflow.algorithms import get_adv_estimator
from hybridflow.config import HybridFlowConfig, load_config
from hybridflow.protocol import Batch
from hybridflow.trainer.dataflow import DataFlow
from hybridflow.trainer.rl import GEN_OUTPUTS, PROMPT_KEYS, REWARD_KEYS, TRAIN_KEYS, RLTrainer


def config(model_dir: str, data_dir: str, out_dir: str) -> HybridFlowConfig:
    return load_config(None, [
        f"data.train_files=[{data_dir}/train.parquet]", f"data.val_files=[{data_dir}/val.parquet]", "data.train_batch_size=8",
        "data.max_prompt_length=32", "data.max_response_length=4", f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.actor.optim.lr=5e-4", "actor_rollout_ref.rollout.n=8", "algorithm.adv_estimator=gae",
        "critic.optim.lr=1e-3", "critic.ppo_micro_batch_size_per_gpu=32", f"trainer.default_local_dir={out_dir}",
        "resource_pool.pools.actor_pool.workers_per_node=2", "resource_pool.pools.critic_pool.workers_per_node=1",
        "resource_pool.mapping.actor_rollout=actor_pool", "resource_pool.mapping.critic=critic_pool",
    ], schema=HybridFlowConfig)


def gae(batch: Batch) -> Batch:
    adv, returns = get_adv_estimator("gae")(batch["token_level_scores"], batch["response_mask"], values=batch["values"], gamma=1.0, lam=1.0)
    return Batch.from_dict(tensors={"advantages": adv, "returns": returns})


def train(model_dir: str, data_dir: str, steps: int, out_dir: str = "runs/ppo_dataflow") -> dict:
    trainer = RLTrainer(config(model_dir, data_dir, out_dir))
    trainer.init_workers()
    actor, critic, step = trainer.actor, trainer.critic, [0]
    reward = lambda b: Batch.from_dict(tensors={"token_level_scores": trainer.reward_fn(b)[0]})  # noqa: E731
    try:
        # ---- PPO, one stage per line ----
        flow = DataFlow(config=trainer.cfg)
        flow.add_stage("rollout", lambda b: actor.generate_sequences(b, trainer._sampling(step=step[0]), release_after=True), PROMPT_KEYS, GEN_OUTPUTS,
                       pool="actor_pool")
        flow.add_stage("reward", reward, REWARD_KEYS, ["token_level_scores"])
        flow.add_stage("old_log_prob", actor.compute_log_prob, TRAIN_KEYS, ["old_log_probs"])
        flow.add_stage("values", critic.compute_values, TRAIN_KEYS, ["values"])
        flow.add_stage("adv", gae, ["token_level_scores", "response_mask", "values"], ["advantages", "returns"])
        flow.add_stage("update_critic", critic.update_critic, TRAIN_KEYS + ["values", "returns"], [])
        flow.add_stage("update_actor", actor.update_actor, TRAIN_KEYS + ["old_log_probs", "advantages"], [], batch_size=64)
        flow.add_stage("sync_weights", lambda b: actor.reshard() and None, [], [], pool="actor_pool")
        # ----
        before = trainer.validate()
        for step[0] in range(1, steps + 1):
            results = flow.run(trainer._prepare_batch())
            print(f"step {step[0]:>3d}  score {results['token_level_scores'].sum(-1).mean():.3f}  "
                  f"pg_loss {results['actor/pg_loss']:+.4f}  vf_loss {results['critic/vf_loss']:.4f}", flush=True)
        after = trainer.validate()
    finally:
        trainer.shutdown()
    return {"before": before, "after": after, "timeline": flow.timeline}


if __name__ == "__main__":
    args = sys.argv[1:]
    out = train(args[0] if args else "runs/demo/sft_model", args[1] if len(args) > 1 else "runs/demo/data", int(args[2]) if len(args) > 2 else 40)
    print("held-out accuracy:", out["before"], "->", out["after"])
