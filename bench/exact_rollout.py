"""The exact rollout mode against the default sampler, side by side in one run.

Per precision (fp32; bf16 mixed precision, generating in bf16) and generation TP (1: two replicas
with the generation model; 2: one replica over both workers) the same GRPO run twice on 2 workers
(the tiny model, digit_max, 4 prompts x 4 samples, 16-token responses, 10 steps): with the default
HF `generate` sampler (KV cache, batched) and with actor_rollout_ref.rollout.exact=true
(models/exact.py `exact_row_logits`: one sequence at a time, a full forward per sampled token; at
gen_tp 2 through the training engine's FSDP2 module).

Columns: the largest train-rollout mismatch over the steps (rollout/logprob_diff_max) and its
median, the largest first-update actor/ppo_kl, generated tokens per second of the generation stage
(timing_s/gen, both workers together), the generation stage's and the old-log-prob stage's seconds
per step (median), and seconds per step.

Run:  .venv/bin/python bench/exact_rollout.py [--steps 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.common import length_parity_task, print_rows  # noqa: E402

PRECISIONS = {"fp32": [], "bf16": ["actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16"]}


def run(root: str, model: str, task: str, reward: str, steps: int, precision: str, gen_tp: int, exact: bool) -> dict:
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.trainer.rl import RLTrainer

    out = os.path.join(root, f"{precision}-tp{gen_tp}-{'exact' if exact else 'default'}")
    cfg = load_config(None, [
        f"data.train_files=[{task}/train.parquet]", f"data.val_files=[{task}/val.parquet]", "data.train_batch_size=4",
        "data.max_prompt_length=32", "data.max_response_length=16", f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.n=4", f"actor_rollout_ref.rollout.exact={str(exact).lower()}",
        f"custom_reward_function.path={reward}", f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.save_freq=-1",
        f"trainer.default_local_dir={out}", f"actor_rollout_ref.rollout.tensor_model_parallel_size={gen_tp}", *PRECISIONS[precision],
    ], schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    tokens = [r["response_length/mean"] * 16 for r in rows]  # 4 prompts x 4 samples per step
    gen = [r["timing_s/gen"] for r in rows]
    return {"row": f"{precision}, gen_tp {gen_tp}, {'exact' if exact else 'generate'}",
            "diff_max": max(r["rollout/logprob_diff_max"] for r in rows),
            "diff_median": statistics.median(r["rollout/logprob_diff_max"] for r in rows),
            "kl_max": max(abs(r["actor/ppo_kl"]) for r in rows),
            "gen_tok_s": sum(tokens) / sum(gen), "gen_s": statistics.median(gen),
            "old_lp_s": statistics.median(r["timing_s/old_log_prob"] for r in rows),
            "step_s": statistics.median(r["timing_s/step"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from hybridflow.models.tiny import make_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as root:
        task, reward = length_parity_task(root)
        model = make_tiny_model(os.path.join(root, "tiny"), hidden_size=64, intermediate_size=128)
        for precision in PRECISIONS:
            for gen_tp in (1, 2):
                for exact in (False, True):
                    rows.append(run(root, str(model), task, reward, args.steps, precision, gen_tp, exact))
    print_rows(f"exact rollout vs HF generate: GRPO, 2 workers, tiny model, {args.steps} steps", [
        ("row", "row", "<27"), ("diff_max", "logprob_diff_max", ">17.3g"), ("diff_median", "median", ">9.3g"),
        ("kl_max", "ppo_kl max", ">11.3g"), ("gen_tok_s", "gen tok/s", ">10.1f"), ("gen_s", "gen s", ">7.3f"),
        ("old_lp_s", "old_lp s", ">9.3f"), ("step_s", "step s", ">7.3f")], rows, args.json)


if __name__ == "__main__":
    main()
