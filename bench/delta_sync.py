"""Delta weight sync of the cross-pool sync, per step: what changed, what a full sync sends, what
the delta sync sends, and how long the sync took.

Async GRPO (trainer.async_rollout, staleness 1; 2 training workers, 1 rollout worker) with
actor_rollout_ref.hybrid_engine.delta_sync=true and trainer.check_weight_sync=true (every sync's
result is compared with the trainer's weights by fingerprint: a difference stops the run), on the
tiny model (digit_max, 4 prompts x 4 samples) and, with --smollm2 DIR, on SmolLM2-135M (its own
chat prompts of the same task, 2 prompts x 2 samples: ~80 s per step on 2 cores), in fp32 and
with bf16 mixed precision (bf16 generation weights), at lr 1e-6 (a realistic RL learning rate).

Columns per step: the fraction of the generation slices' elements that changed since the last
sync, bytes a full sync sends per rollout rank, bytes the delta sync sent (and their ratio), pieces
repaired, the sync's seconds. The first sync and every `delta_full_every`-th (10) send everything.

Run:  .venv/bin/python bench/delta_sync.py [--steps 20] [--smollm2 runs/models/smollm2-135m] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import length_parity_task, write_rows  # noqa: E402

ASYNC = ["trainer.async_rollout=true", "resource_pool.pools.actor_pool.workers_per_node=2", "resource_pool.pools.rollout_pool.workers_per_node=1",
         "resource_pool.mapping.actor_rollout=actor_pool", "resource_pool.mapping.rollout=rollout_pool", "trainer.check_weight_sync=true",
         "actor_rollout_ref.hybrid_engine.delta_sync=true", "actor_rollout_ref.actor.optim.lr=1e-6"]
PRECISIONS = {"fp32": [], "bf16": ["actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16"]}


def run(out: str, model: str, task: str, reward: str, steps: int, precision: str, small: bool) -> list[dict]:
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.trainer.rl import RLTrainer

    batch = ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
             "data.max_prompt_length=160"] if small else [
             "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.max_prompt_length=32"]
    cfg = load_config(None, [
        f"data.train_files=[{task}/train.parquet]", f"data.val_files=[{task}/val.parquet]", "data.max_response_length=8",
        f"actor_rollout_ref.model.path={model}", f"custom_reward_function.path={reward}", f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.logger=[jsonl]",
        "trainer.save_freq=-1", f"trainer.default_local_dir={out}", *batch, *ASYNC, *PRECISIONS[precision],
    ], schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [{"step": r["step"], "changed": r["sync/delta_changed_fraction"], "full_bytes": r["sync/full_bytes_per_rank"],
             "delta_bytes": r["sync/delta_bytes_per_rank"], "repairs": r["sync/delta_repairs"], "seconds": r["timing_s/sync_weights"],
             "checked": r["reshard/weight_max_diff"] == 0.0} for r in rows if "sync/delta_bytes_per_rank" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--smollm2", default=None, metavar="DIR")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from hybridflow.models.tiny import make_tiny_model

    tables = []
    with tempfile.TemporaryDirectory() as root:
        task, reward = length_parity_task(root)
        models = [("tiny", str(make_tiny_model(os.path.join(root, "tiny"), hidden_size=64, intermediate_size=128)), False)]
        if args.smollm2:
            models.append(("SmolLM2-135M", args.smollm2, True))
        for label, model, small in models:
            for precision in PRECISIONS:
                rows = run(os.path.join(root, f"{label}-{precision}"), model, task, reward, args.steps, precision, small)
                tables.append({"model": label, "precision": precision, "rows": rows})
                print(f"\n{label}, {precision}, lr 1e-6: delta sync per step (bytes per rollout rank)")
                print(f"{'step':>4} {'changed':>9} {'full sync B':>12} {'delta B':>10} {'ratio':>7} {'repairs':>8} {'sync s':>7} {'bit-exact':>9}")
                for r in rows:
                    print(f"{r['step']:>4} {r['changed']:>9.4f} {r['full_bytes']:>12.0f} {r['delta_bytes']:>10.0f} "
                          f"{r['delta_bytes'] / r['full_bytes']:>7.3f} {r['repairs']:>8.0f} {r['seconds']:>7.3f} {str(r['checked']):>9}")
    if args.json:
        write_rows(args.json, tables)


if __name__ == "__main__":
    main()
