"""Rebuild the SFT warm starts that CI's recipe tests start from (tests/fixtures/recipes/<recipe>/).

Why fixtures: the tool and guess recipes' SFTs (450 + 250 and 300 steps) are most of those tests' time
(~4 and ~2.5 minutes on 2 cores) and they teach nothing the RL part of a test checks; the code recipe's
(300 steps, ~35 s) would be a third of its short test's. The fixture
is exactly what `hybridflow demo --recipe R` trains before its RL (same data, base model, configs
and seeds; the tool recipe's two SFT stages), saved with `sft_record.json`: the SFT's step count,
each stage's losses, the first stage's first losses and the final loss, and where it was built. `tests/test_e2e_agent.py` checks
that a fresh SFT of the recipe reproduces
the first recorded losses (so a fixture cannot silently drift from the code that claims to make
it), then runs the recipe's RL from the fixture (`hybridflow demo --sft-model DIR`).

Run after changing a recipe's task, tiny model, tokenizer or SFT config (~5 minutes each here):

    .venv/bin/python scripts/build_recipe_fixtures.py --recipe tool guess code vision
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "recipes")
FIRST_LOSSES = 5  # how many of the first SFT losses are recorded (and re-checked in CI)


def build(recipe: str) -> dict:
    import torch

    from hybridflow.demo import prepare_recipe, run_sft_stages

    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        _, _, stages = prepare_recipe(recipe, tmp)
        sft = run_sft_stages(stages)
        dest = os.path.join(FIXTURES, recipe)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(stages[-1].save_dir, dest, ignore=shutil.ignore_patterns("metrics.jsonl"))  # the curve is in the record
    record = {
        "recipe": recipe,
        "sft_steps": sft["steps"],
        "stages": sft["stages"],
        "first_losses": sft["stages"][0]["first_losses"][:FIRST_LOSSES],  # CI re-checks these: the first stage starts from the base model
        "final_loss": sft["final_loss"],
        "built_with": f"python scripts/build_recipe_fixtures.py --recipe {recipe}",
        "built_on": f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores",
        "seconds": round(time.time() - start, 1),
    }
    with open(os.path.join(dest, "sft_record.json"), "w") as f:
        json.dump(record, f, indent=2)
    return record


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", nargs="+", choices=["tool", "guess", "code", "vision"], required=True)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for recipe in args.recipe:
        rec = build(recipe)
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
