"""Replace the reward stage of the GRPO dataflow with your own function, in a few lines.

Run `hybridflow demo` first (it writes runs/demo/sft_model and runs/demo/data), then:

    python examples/custom_reward_stage.py [MODEL_DIR] [DATA_DIR] [STEPS]

A stage function receives `batch.select(stage.inputs)` -- for "reward": responses, response_mask,
data_source, reward_model, extra_info -- and returns a Batch holding the stage's declared outputs
(here `token_level_scores`, [B, T] float, the score placed on the last response token).
"""

from __future__ import annotations

import os
import sys

import torch

from hybridflow.config import load_config
from hybridflow.protocol import Batch
from hybridflow.rewards.scorers import exact_answer_score
from hybridflow.trainer.rl import RLTrainer

LENGTH_PENALTY = 0.05  # per decoded character beyond the one-digit answer


def make_reward_stage(tokenizer):
    def my_reward_stage(batch: Batch) -> Batch:
        """Exact answer (1/0) minus a small length penalty."""
        mask = batch["response_mask"].bool()
        lengths = mask.sum(-1)
        scores = torch.zeros(mask.shape, dtype=torch.float32)
        for i, (ids, m) in enumerate(zip(batch["responses"].cpu(), mask.cpu())):
            text = tokenizer.decode(ids[m].tolist(), skip_special_tokens=True)
            correct = exact_answer_score(text, batch["reward_model"][i]["ground_truth"])
            last = max(int(lengths[i]) - 1, 0)
            scores[i, last] = correct - LENGTH_PENALTY * max(len(text.strip()) - 1, 0)
        return Batch.from_dict(tensors={"token_level_scores": scores}, meta={"metrics": {"my_reward/mean_len": lengths.float().mean().item()}})

    return my_reward_stage


def main(model_dir: str = "runs/demo/sft_model", data_dir: str = "runs/demo/data", steps: int = 5) -> None:
    cfg = load_config(None, [
        f"data.train_files=[{os.path.join(data_dir, 'train.parquet')}]",
        "data.train_batch_size=8", "data.max_prompt_length=32", "data.max_response_length=4",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.actor.optim.lr=5e-4", "actor_rollout_ref.rollout.n=8",
        "algorithm.adv_estimator=grpo", f"trainer.total_training_steps={steps}",
        "trainer.default_local_dir=runs/custom_reward", "trainer.resume_mode=disable",
    ])
    trainer = RLTrainer(cfg)
    try:
        trainer.init_workers()
        flow = trainer.build_dataflow()
        flow.replace("reward", make_reward_stage(trainer.tokenizer))  # <- the whole customisation
        for _ in range(steps):
            trainer.global_step += 1  # fit() does this; it also seeds the rollout sampling
            m = trainer.train_step(flow)
            print(f"step {trainer.global_step}: score {m['critic/score/mean']:+.3f}  "
                  f"mean_len {m['my_reward/mean_len']:.2f}  reward_s {m['timing_s/reward']:.3f}", flush=True)
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    argv = sys.argv[1:]
    main(*argv[:2], *(int(a) for a in argv[2:3]))
