"""Do the agent recipes learn on every seed? `hybridflow demo --recipe R --seed S` for each recipe and
seed (the seed drives the task data, the tiny model's initialisation, the SFT and the RL run), one
fresh process each, and a table: held-out score after SFT and after RL, the recipe's bar, and wall
seconds (SFT included).

Bars (docs/agents.md): tool: held-out accuracy >= 0.8 after RL; guess: turns per solved game down by
>= 1.5 and score up by >= 0.1 (what CI asserts at step 10).

Run:  .venv/bin/python bench/recipes.py --seeds 0-4 [--recipes tool guess] [--rl-steps N] [--json PATH] [KEY=VALUE ...]
(~8-9 minutes per tool run and ~6-8 per guess run on 2 cores.) KEY=VALUE overrides go to every
recipe's RL config (e.g. actor_rollout_ref.rollout.temperature=0.7); `--reuse-sft` starts from the
SFT a previous run of the same recipe and seed left in --out (its wall seconds then leave the SFT out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def seeds(spec: str) -> list[int]:
    """"0-4" -> [0, 1, 2, 3, 4]; "0,2" -> [0, 2]."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def bar(recipe: str, s: dict) -> tuple[str, bool]:
    if recipe == "tool":
        return ">= 0.8", s["val_acc_final"] >= 0.8
    turns_ok = s.get("val_turns_per_solved_final", 99) <= s.get("val_turns_per_solved_after_sft", 0) - 1.5
    return "turns -1.5, score +0.1", turns_ok and s["val_acc_final"] >= s["val_acc_after_sft"] + 0.1


def run(recipe: str, seed: int, out: str, rl_steps: int | None, overrides: list[str], reuse_sft: bool) -> dict:
    flags = ["--rl-steps", str(rl_steps)] if rl_steps else []
    kept = os.path.join(out, "sft_model_kept")  # the SFT of a first run, copied aside so a rerun's output cannot overwrite it
    if reuse_sft and os.path.isdir(kept):
        flags += ["--sft-model", kept]
    cmd = [sys.executable, "-m", "hybridflow.cli", "demo", "--recipe", recipe, "--seed", str(seed), "--output-dir", out, *flags,
           "trainer.progress_bar=false", *overrides]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}",
                "wall_seconds": round(time.time() - start, 1)}
    if not os.path.isdir(kept) and os.path.isdir(os.path.join(out, "sft_model")):
        shutil.copytree(os.path.join(out, "sft_model"), kept)
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0-4")
    ap.add_argument("--recipes", nargs="+", default=["tool", "guess"], choices=["tool", "guess"])
    ap.add_argument("--rl-steps", type=int, default=None, help="default: each recipe's own (tool 20, guess 40)")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_recipes"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--reuse-sft", action="store_true", help="start from the SFT an earlier run of this recipe and seed kept in --out")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE overrides for every recipe's RL config")
    args = ap.parse_args()
    rows = []
    print("| recipe | seed | after SFT | after RL (every 10 steps) | bar | met | wall s |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for recipe in args.recipes:
        for seed in seeds(args.seeds):
            s = run(recipe, seed, os.path.join(args.out, f"{recipe}-{seed}"), args.rl_steps, args.overrides, args.reuse_sft)
            if "error" in s:
                print(f"| {recipe} | {seed} | - | - | - | failed: {s['error'][:80]} | {s['wall_seconds']} |", flush=True)
            else:
                what, met = bar(recipe, s)
                extra = (f" ({s['val_turns_per_solved_after_sft']:.1f} -> {s['val_turns_per_solved_final']:.1f} turns/solved)"
                         if recipe == "guess" and "val_turns_per_solved_final" in s else "")
                curve = " / ".join(f"{acc:.2f}" for step, acc in s["val_curve"][1:])  # held-out every test_freq steps
                print(f"| {recipe} | {seed} | {s['val_acc_after_sft']:.2f} | {curve}{extra} | {what} | "
                      f"{'yes' if met else 'no'} | {s['wall_seconds']:.0f} |", flush=True)
            rows.append({"recipe": recipe, "seed": seed, **{k: v for k, v in s.items() if k != "val_curve"}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
