"""Synchronous vs async rollout on a long-tailed multi-turn workload, side by side in one run.

The tool recipe (`hybridflow demo --recipe tool`: 8 prompts x 8 trajectories per step, the
calculator) from its committed warm start (tests/fixtures/recipes/tool), with the calculator behind
a heavy-tailed delay (bench/async_tools.py: Pareto(1.5), median ~0.08 s, capped at 2 s), for the
same number of steps (the same samples) in each mode:

    sync        the colocated rollout on the actor's 2 workers (generate, then train)
    async k=1   a rollout pool of its own (1 worker) generating one batch ahead
    async k=2   ... up to two batches ahead (trajectories of two batches in flight while training)
    k=2 partial ... with partial rollout (async_training.partial_rollout: requests in 32-token
                segments, so a weight sync reaches a running turn at the next boundary)

Columns: seconds per step (steps 2..N, the first one starts the pipeline), the trainer's wait for
its batch per step (async: timing_s/gen_wait; sync: the generation stage, during which it cannot
train), the trainer's idle fraction (that wait over the step) and the generation replicas' idle
fraction (async: rollout/gen_idle_fraction, the share of the pool's wall time between its calls
not spent generating; sync: the update's share of the step, when the colocated rollout cannot
generate), the largest staleness trained on, the responses sampled by more than one version, and
the held-out accuracy after the last step (greedy, the recipe's metric). On this 2-core machine the pools share the same 2 cores, so generation and
training compete for them: what async can win here is the tools' waiting time.

Run:  .venv/bin/python bench/async.py [--steps 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ASYNC = ["trainer.async_rollout=true", "resource_pool.pools.actor_pool.workers_per_node=2", "resource_pool.pools.rollout_pool.workers_per_node=1",
         "resource_pool.mapping.actor_rollout=actor_pool", "resource_pool.mapping.rollout=rollout_pool"]
MODES = [("sync", []), ("async k=1", ASYNC + ["async_training.max_staleness=1"]), ("async k=2", ASYNC + ["async_training.max_staleness=2"]),
         ("async k=2 + partial", ASYNC + ["async_training.max_staleness=2", "async_training.partial_rollout=true"])]


def slow_tool_config(recipe_config: str, out: str) -> str:
    """The recipe's tool config with the calculator replaced by the slow one (same schema)."""
    with open(recipe_config) as f:
        cfg = json.load(f)
    for tool in cfg["tools"]:
        tool["class_name"] = os.path.join(ROOT, "bench", "async_tools.py") + ":SlowCalculator"
    path = os.path.join(out, "slow_tool_config.yaml")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def run_mode(name: str, extra: list[str], files: dict, tools: str, out: str, steps: int) -> dict:
    from hybridflow.demo import demo_tool_rl_config, val_key
    from hybridflow.trainer.rl import RLTrainer

    cfg = demo_tool_rl_config(files, os.path.join(ROOT, "tests", "fixtures", "recipes", "tool"), out, steps, *extra,
                              f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}", "trainer.val_before_train=false",
                              f"trainer.test_freq={steps}", "trainer.save_freq=0", "trainer.progress_bar=false", "trainer.logger=[jsonl]")
    start = time.time()
    trainer = RLTrainer(cfg)
    try:
        history = [h for h in trainer.fit()["history"] if h["step"] > 0]
    finally:
        trainer.shutdown()
    later = history[1:] or history

    def mean(f) -> float:
        return sum(f(h) for h in later) / len(later)

    wait_key = "timing_s/gen_wait" if extra else "timing_s/gen"
    gen_idle = (lambda h: h.get("rollout/gen_idle_fraction", 0.0)) if extra else (lambda h: 1.0 - h["timing_s/gen"] / h["timing_s/step"])
    return {"mode": name, "s_per_step": mean(lambda h: h["timing_s/step"]), "wait_per_step": mean(lambda h: h.get(wait_key, 0.0)),
            "trainer_idle": mean(lambda h: h.get(wait_key, 0.0) / h["timing_s/step"]), "gen_idle": mean(gen_idle),
            "max_staleness": max(h.get("rollout/staleness_max", 0.0) for h in history),
            "mixed_rows": sum(h.get("rollout/mixed_version_rows", 0.0) for h in history),
            "val_acc": history[-1].get(val_key("tool")), "wall_s": time.time() - start}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from hybridflow.data.tasks import make_multiply_task

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = make_multiply_task(os.path.join(tmp, "data"))  # the fixture's task (default seed)
        tools = slow_tool_config(files["tool_config"], tmp)
        for name, extra in MODES:
            rows.append(run_mode(name, extra, files, tools, os.path.join(tmp, name.replace(" ", "_").replace("=", "")), args.steps))
            print(f"[bench] {rows[-1]}", flush=True)
    base = rows[0]["s_per_step"]
    print(f"\n{args.steps} GRPO steps of the tool recipe with a heavy-tailed calculator (8 prompts x 8 trajectories)\n")
    print("| mode | s / step | trainer wait / step | vs sync | trainer idle | generation idle | max staleness | mixed-version rows | held-out acc | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r["val_acc"] is None else f"{r['val_acc']:.2f}"
        print(f"| {r['mode']} | {r['s_per_step']:.2f} | {r['wait_per_step']:.2f} | {base / r['s_per_step']:.2f}x | {r['trainer_idle']:.2f} | "
              f"{r['gen_idle']:.2f} | {r['max_staleness']:.0f} | {r['mixed_rows']:.0f} | {acc} | {r['wall_s']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
