"""reasoning-gym tasks trained with GRPO, scored by reasoning-gym's own verifiers: held-out accuracy
before -> after, one row per task (and a SmolLM2-135M row with --smollm2).

Per task (hybridflow/data/reasoning_gym.py makes the rows; train seed 1, held-out seed 10**6 + 1):
- tiny rows: a fresh 2-layer x 128 char-level model, a short SFT (`--sft-steps`) on demonstrations
  `<answer>X</answer>` that follow a wrong rule with probability `--bias` (copy the question's last
  number instead of computing; spell the word forward), then `--steps` GRPO steps (8 prompts x 8 samples, `--lr`) with the task's verifier
  as the only reward. The greedy held-out accuracy is measured after the SFT and at the end.
- `--smollm2 DIR` (scripts/get_smollm2.py): SmolLM2-135M-Instruct after a short format SFT
  (`--smollm2-sft-steps` on the same kind of demonstrations, wrong rule with probability
  `--smollm2-bias`: as it comes it writes no `<answer>` tag and scores 0.00), then GRPO on chain_sum
  (8 prompts x 4 samples, `--smollm2-steps`, `--smollm2-lr`), before (after the SFT) -> after.

Run:  .venv/bin/python bench/reasoning_gym_tasks.py [--tasks chain_sum spell_backward] [--steps 30] [--smollm2 runs/models/smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridflow.config import HybridFlowConfig, SFTConfig, load_config  # noqa: E402
from hybridflow.data.reasoning_gym import make_rows  # noqa: E402
from hybridflow.data.tasks import write_parquet  # noqa: E402

TASKS = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "spell_backward": {"min_word_len": 3, "max_word_len": 4},
}
VAL_SEED = 10**6 + 1


def wrong(answer: str, question: str) -> str:
    """The wrong *rule* the SFT demonstrations follow with probability `bias` (as the demo's task
    does: the SFT model knows both rules and prefers the wrong one; GRPO has a rule to switch to):
    a number's answer -> the last number of the question (copy instead of compute); a word's ->
    the word reversed back (spell it forward)."""
    try:
        int(answer)
    except ValueError:
        return answer[::-1]
    numbers = re.findall(r"-?\d+", question.split("=")[0])
    return numbers[-1] if numbers and numbers[-1] != answer else str(int(answer) + 1)


def task_files(name: str, out: str, n_train: int, n_val: int, bias: float) -> dict:
    cfg = TASKS[name]
    train, val = make_rows(name, n_train, 1, cfg, "train"), make_rows(name, n_val, VAL_SEED, cfg, "val")
    rng = random.Random(0)

    def demo(r: dict) -> str:
        truth = r["reward_model"]["ground_truth"]
        return wrong(truth, r["prompt"][0]["content"]) if rng.random() < bias else truth

    sft = [{"messages": [*r["prompt"], {"role": "assistant", "content": f"<answer>{demo(r)}</answer>"}]} for r in train]
    return {"train": write_parquet(train, f"{out}/train.parquet"), "val": write_parquet(val, f"{out}/val.parquet"),
            "sft": write_parquet(sft, f"{out}/sft.parquet")}


def grpo_config(files: dict, model: str, out: str, steps: int, prompt_len: int, response_len: int, n: int, prompts: int,
                lr: float, micro: int = 16) -> HybridFlowConfig:
    """micro: sequences per forward (SmolLM2's 49k-token vocabulary makes each one's logits ~50 MB in fp32)."""
    return load_config(None, [
        f"data.train_files=[{files['train']}]", f"data.val_files=[{files['val']}]", f"data.train_batch_size={prompts}",
        f"data.max_prompt_length={prompt_len}", f"data.max_response_length={response_len}", f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}", f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}", f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.optim.lr={lr}", f"actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.rollout.temperature=1.0",
        "algorithm.adv_estimator=grpo", f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", "trainer.val_before_train=true",
        f"trainer.default_local_dir={out}", "trainer.resume_mode=disable", "trainer.save_freq=-1", "trainer.logger=[console]",
        "trainer.progress_bar=false",
    ], schema=HybridFlowConfig)


def fit(cfg) -> list[dict]:
    from hybridflow.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg)
    try:
        return trainer.fit()["history"]
    finally:
        trainer.shutdown()


def held_out(history: list[dict], name: str) -> tuple[float, float]:
    key = f"val-core/reasoning_gym/{name}/acc/mean@1"
    vals = [h[key] for h in history if key in h]
    return vals[0], vals[-1]


def sft(files: dict, model: str, out: str, steps: int, batch: int, lr: float, max_length: int) -> str:
    """A short SFT on the demonstrations; returns the saved model's directory."""
    from hybridflow.trainer.sft import run_sft

    run_sft(load_config(None, [
        f"train_files=[{files['sft']}]", "multiturn.enable=true", f"max_length={max_length}", f"train_batch_size={batch}",
        f"micro_batch_size_per_gpu={min(batch // 2, 32)}", f"total_steps={steps}", f"model.path={model}", f"optim.lr={lr}",
        "optim.lr_scheduler_type=cosine", "optim.lr_warmup_steps_ratio=0.05", f"save_dir={out}/sft_model",
        f"trainer.default_local_dir={out}/sft", "trainer.logger=[console]",
    ], schema=SFTConfig))
    return f"{out}/sft_model"


def tiny_row(name: str, root: str, args) -> dict:
    from hybridflow.models.tiny import make_tiny_model

    t = time.time()
    out = f"{root}/{name}"
    files = task_files(name, f"{out}/data", 4000, 100, args.bias)
    base = make_tiny_model(f"{out}/tiny", hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    model = sft(files, base, out, args.sft_steps, 64, 2e-3, 200)
    history = fit(grpo_config(files, model, f"{out}/grpo", args.steps, 160, 24, 8, 8, args.lr))
    before, after = held_out(history, name)
    return {"row": f"tiny, {name}", "before": before, "after": after, "steps": args.steps, "wall_s": time.time() - t}


def smollm2_row(path: str, root: str, args) -> dict:
    t = time.time()
    files = task_files("chain_sum", f"{root}/smol/data", 2000, 50, args.smollm2_bias)
    model = sft(files, path, f"{root}/smol", args.smollm2_sft_steps, 16, args.smollm2_sft_lr, 256)
    history = fit(grpo_config(files, model, f"{root}/smol/grpo", args.smollm2_steps, 192, 48, 4, 8, args.smollm2_lr, micro=4))
    before, after = held_out(history, "chain_sum")
    return {"row": "SmolLM2-135M, chain_sum", "before": before, "after": after, "steps": args.smollm2_steps, "wall_s": time.time() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="*", default=sorted(TASKS), choices=sorted(TASKS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sft-steps", type=int, default=800)
    ap.add_argument("--lr", type=float, default=2e-4, help="the tiny rows' GRPO learning rate")
    ap.add_argument("--bias", type=float, default=0.7, help="share of SFT demonstrations that follow the wrong rule")
    ap.add_argument("--smollm2", default=None, metavar="DIR")
    ap.add_argument("--smollm2-steps", type=int, default=15)
    ap.add_argument("--smollm2-lr", type=float, default=5e-6)
    ap.add_argument("--smollm2-sft-steps", type=int, default=40)
    ap.add_argument("--smollm2-sft-lr", type=float, default=3e-5)
    ap.add_argument("--smollm2-bias", type=float, default=0.5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name in args.tasks:
            rows.append(tiny_row(name, root, args))
        if args.smollm2:
            rows.append(smollm2_row(args.smollm2, root, args))
    print(f"\n{'row':<28} {'held-out before':>16} {'after':>7} {'GRPO steps':>11} {'wall s':>8}")
    for r in rows:
        print(f"{r['row']:<28} {r['before']:>16.2f} {r['after']:>7.2f} {r['steps']:>11} {r['wall_s']:>8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
