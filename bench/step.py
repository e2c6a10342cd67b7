"""One RL step, three placements side by side: colocated, split pools, split pools + async rollout.

    python bench/step.py [--steps 30] [--sft-steps 300] [--json PATH] [key=value ...]   # e.g. trainer.device=cuda

The demo task and model (SFT warm start once), then PPO (GAE with a critic, 8 prompts x 8 samples)
three times with the same seed:
- colocated:   actor/rollout and critic share 2 worker processes (2 workers);
- split:       actor/rollout on a 2-worker pool, critic on a 1-worker pool (3 workers); values and
               the critic update run alongside the actor's log-probs and update;
- split_async: as split, plus a 1-worker rollout pool generating batch k+1 while the trainer
               updates on batch k (4 workers), weights synced across pools after each update.
Rows: mode, step_seconds (median over steps after the first), val_acc (held-out, final), workers.
On a 2-core machine extra processes compete for the same cores: split pools need not win there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_rows  # noqa: E402

MODES = {
    "colocated": ([], 2),
    "split": (["resource_pool.pools.actor_pool.workers_per_node=2", "resource_pool.pools.critic_pool.workers_per_node=1",
               "resource_pool.mapping.actor_rollout=actor_pool", "resource_pool.mapping.critic=critic_pool"], 3),
    "split_async": (["resource_pool.pools.actor_pool.workers_per_node=2", "resource_pool.pools.critic_pool.workers_per_node=1",
                     "resource_pool.pools.rollout_pool.workers_per_node=1", "resource_pool.mapping.actor_rollout=actor_pool",
                     "resource_pool.mapping.critic=critic_pool", "resource_pool.mapping.rollout=rollout_pool", "trainer.async_rollout=true"], 4),
}


def run_mode(mode: str, files: dict, model: str, out: str, steps: int, extra: list[str]) -> dict:
    from hybridflow.demo import VAL_KEY, demo_rl_config
    from hybridflow.trainer.rl import RLTrainer

    overrides, workers = MODES[mode]
    cfg = demo_rl_config(files, model, os.path.join(out, mode), steps, *overrides, "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3",
                         "critic.ppo_micro_batch_size_per_gpu=32", f"trainer.test_freq={steps}", "trainer.progress_bar=false", "trainer.logger=[jsonl]", *extra)
    trainer = RLTrainer(cfg)
    try:
        result = trainer.fit()
    finally:
        trainer.shutdown()
    hist = [h for h in result["history"] if h["step"] > 0]
    return {"mode": mode, "step_seconds": statistics.median(h["timing_s/step"] for h in hist[1:]), "val_acc": result["final_val"][VAL_KEY], "workers": workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sft-steps", type=int, default=300)
    parser.add_argument("--modes", default="colocated,split,split_async")
    parser.add_argument("--json", default=None)
    parser.add_argument("overrides", nargs="*", help="config overrides for every mode (key=value)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hybridflow.controller.worker_group import init_ray
    from hybridflow.data.tasks import make_max_task
    from hybridflow.demo import demo_sft_config
    from hybridflow.models.tiny import make_tiny_model
    from hybridflow.trainer.sft import run_sft

    tmp = tempfile.mkdtemp(prefix="bench_step_")
    files = make_max_task(os.path.join(tmp, "data"))
    base = make_tiny_model(os.path.join(tmp, "tiny_model"), hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    init_ray()
    sft = demo_sft_config(files["sft"], str(base), tmp, args.sft_steps)
    sft.trainer.logger = ["jsonl"]
    run_sft(sft)
    rows = [run_mode(m, files, os.path.join(tmp, "sft_model"), tmp, args.steps, args.overrides) for m in args.modes.split(",")]

    print_rows(f"PPO (GAE + critic), demo task, 8 prompts x 8 samples, {args.steps} steps, {os.cpu_count()} CPU cores",
               [("mode", "mode", "<12"), ("workers", "workers", ">7d"), ("step_seconds", "step s", ">8.3f"), ("val_acc", "val acc", ">8.3f")],
               rows, args.json)

if __name__ == "__main__":
    main()
