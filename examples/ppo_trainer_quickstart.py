"""`PPOTrainer` quickstart on the tiny model (verl/HybridFlow-style constructor).

    python examples/ppo_trainer_quickstart.py --output-dir runs/quickstart            # GRPO, no critic
    python examples/ppo_trainer_quickstart.py --output-dir runs/quickstart --critic   # PPO with a critic

Writes the digit_max task and a tiny random model into --output-dir, then trains a few steps with
the resharding switches of the HybridFlow post's example set as keywords (a parallel config of 2
data-parallel workers, the optimized switch overlapped with the driver's batch preparation, a
staging budget of 0.1 of the generation weights) and prints the last step's metrics.
"""

from __future__ import annotations

import argparse
import json
import os

from hybridflow import PPOTrainer
from hybridflow.data.tasks import make_max_task
from hybridflow.models.tiny import make_tiny_model


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="runs/quickstart")
    p.add_argument("--critic", action="store_true", help="PPO with a critic (GAE) instead of GRPO")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    out = os.path.abspath(a.output_dir)
    files = make_max_task(os.path.join(out, "data"))
    model = str(make_tiny_model(os.path.join(out, "tiny_model")))
    trainer = PPOTrainer(
        actor_model=model,
        critic_model=model if a.critic else None,  # the critic starts from the policy's backbone
        parallel_config={"model_parallel_size": 1, "data_parallel_size": 2},
        # overlap: the driver prepares the next batch (data loading + collation) while the workers reshard;
        # staging budget 0.1 x the generation weights (on this tiny model less than one layer: one layer at a time, logged)
        enable_resharding_opt=True, resharding_overlap_with_compute=True, resharding_buffer_percent=0.1,
        data={"train_files": [str(files["train"])], "val_files": [str(files["val"])], "train_batch_size": 4,
              "max_prompt_length": 32, "max_response_length": 4},
        actor_rollout_ref={"rollout": {"n": 4}, "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 8}},
        **{"critic.ppo_micro_batch_size_per_gpu": 8, "trainer.total_training_steps": a.steps, "trainer.default_local_dir": f"{out}/run",
           "trainer.logger": ["console"], "trainer.progress_bar": False,
           "trainer.resume_mode": "disable"},  # a fresh run each time (checkpoints are on by default: auto would resume the last one)
    )
    try:
        result = trainer.fit()
    finally:
        trainer.shutdown()
    last = result["history"][-1]
    print(json.dumps({k: last[k] for k in sorted(last) if k.startswith(("actor/pg_loss", "critic/vf_loss", "critic/score/mean"))}))
    return result


if __name__ == "__main__":
    main()
