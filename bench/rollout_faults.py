"""Faults injected from outside the process into an async multi-turn run: the tool recipe
(`hybridflow demo --recipe tool` from its committed warm start, tests/fixtures/recipes/tool),
30 GRPO steps with trainer.async_rollout (k = async_training.max_staleness = 2) on a rollout pool of
2 replicas, the agent loops on a rollout manager. The same run twice, side by side:

- ``no faults``;
- ``faults``: a rollout manager SIGKILLed (by pid) at steps 5, 12 and 19 and a rollout replica at
  steps 8, 15 and 22, each while later batches are in flight.

For each: every batch drawn from the loader trained once and in order (the loader's uids where the
trainer takes them), the largest staleness of any step (<= k), restarts counted, the held-out
accuracy at step 10 and at the end (greedy, the recipe's held-out products; every 10 steps), and wall time.
With several seeds (`--seeds`: trainer.seed and data.seed) it runs each pair per seed and prints the mean
held-out score with and without faults: async GRPO's timing alone moves one run's score by more than
the bound, so one pair cannot tell the faults' effect from that spread.

Run:  .venv/bin/python bench/rollout_faults.py [--steps 30] [--k 2] [--seeds 1,2,3,4] [--lr 1e-4] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures", "recipes", "tool")
MANAGER_KILLS, REPLICA_KILLS = (5, 12, 19), (8, 15, 22)


def run(out: str, steps: int, k: int, faults: bool, seed: int = 1, *overrides: str) -> dict:
    from hybridflow.config.pools import Role
    from hybridflow.demo import demo_tool_rl_config, prepare_recipe, val_key
    from hybridflow.service.async_rollout import record_batch_uids
    from hybridflow.trainer.rl import RLTrainer

    files, _, _ = prepare_recipe("tool", out)  # the recipe's data (its SFT is the fixture's)
    cfg = demo_tool_rl_config(files, FIXTURE, os.path.join(out, "rl"), steps, "trainer.async_rollout=true", f"async_training.max_staleness={k}",
                              "async_training.max_replica_restarts=4", "resource_pool.pools.actor_pool.workers_per_node=1",
                              "resource_pool.pools.rollout_pool.workers_per_node=2", "resource_pool.mapping.actor_rollout=actor_pool",
                              "resource_pool.mapping.rollout=rollout_pool", "actor_rollout_ref.rollout.agent.num_workers=1",
                              "trainer.test_freq=10", "trainer.progress_bar=false", "trainer.logger=[jsonl]", f"trainer.seed={seed}", f"data.seed={seed}",
                              *overrides)
    trainer = RLTrainer(cfg)
    killed = []
    start = time.perf_counter()
    try:
        trainer.init_workers()
        drawn, trained = record_batch_uids(trainer.async_gen)
        stop = threading.Event()

        def inject() -> None:  # from this process into the manager's / replica's: SIGKILL by pid
            plan = sorted([(s, "manager") for s in MANAGER_KILLS] + [(s, "replica") for s in REPLICA_KILLS])
            for step, what in plan:
                while trainer.global_step < step and not stop.is_set():
                    time.sleep(0.01)
                if stop.is_set():
                    return
                time.sleep(0.2)  # into the step: later batches in flight
                pid = trainer.managers.pids()[0] if what == "manager" else trainer.groups[trainer.pool_of(Role.ROLLOUT)].pids()[1]
                os.kill(pid, signal.SIGKILL)
                killed.append((step, what, pid))

        injector = threading.Thread(target=inject, daemon=True)
        if faults:
            injector.start()
        history = [h for h in trainer.fit()["history"] if h["step"] > 0]
        stop.set()
    finally:
        trainer.shutdown()
    key = val_key("tool")
    vals = [h[key] for h in history if key in h]
    last = history[-1]
    return {"seed": seed, "faults": faults, "steps": len(history), "trained_once_in_order": trained == drawn and len(set(trained)) == len(trained) == steps,
            "max_staleness": max(h["rollout/staleness_max"] for h in history), "manager_restarts": last.get("rollout/manager_restarts", 0.0),
            "replica_restarts": last.get("rollout/replica_restarts", 0.0), "rerun_trajectories": last.get("rollout/rerun_trajectories", 0.0),
            "lost_requests": sum(h.get("rollout/lost_requests", 0.0) for h in history), "killed": killed,
            "val_first": vals[0] if vals else float("nan"), "val_final": vals[-1] if vals else float("nan"), "wall_s": time.perf_counter() - start,
            # what explains a low score: the held-out products' calculator calls, and the training turns' tool errors / timeouts
            "val_tool_calls": [h["val-aux/agent/tool_calls/mean"] for h in history if "val-aux/agent/tool_calls/mean" in h],
            "tool_errors": sum(h.get("agent/tool_errors", 0.0) for h in history), "tool_timeouts": sum(h.get("agent/tool_timeouts", 0.0) for h in history)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--seeds", default="1", help="comma-separated; each runs the pair")
    # 1e-4, not the recipe's 2e-4: at 2e-4 async GRPO (k = 2) on this recipe oscillates on some seeds with or without faults (the
    # policy starts writing calls the calculator refuses, groups score all 0 and give no gradient; docs/results.md)
    ap.add_argument("--lr", type=float, default=1e-4, help="the actor's learning rate (the recipe's own: 2e-4)")
    ap.add_argument("--keep", default=None, help="keep each run's directory (metrics.jsonl, checkpoints) under this one")
    args = ap.parse_args()
    from hybridflow.controller.worker_group import init_ray

    init_ray(num_cpus=os.cpu_count())
    seeds = [int(x) for x in args.seeds.split(",")]
    rows = []
    for seed in seeds:
        for faults in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(args.keep, f"seed{seed}_{'faults' if faults else 'no_faults'}") if args.keep else tmp
                rows.append(run(out, args.steps, args.k, faults, seed, f"actor_rollout_ref.actor.optim.lr={args.lr}"))
                print(rows[-1], file=sys.stderr, flush=True)
    print(f"tool recipe, {args.steps} async GRPO steps, k = {args.k}, lr {args.lr}, 2 rollout replicas, 1 rollout manager; "
          f"cpus: {os.cpu_count()}")
    print("| seed | run | steps | each batch once, in order | max staleness | manager restarts | replica restarts | trajectories run again | "
          "requests sent again | held-out at step 10 | held-out at the end | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {'faults' if r['faults'] else 'no faults'} | {r['steps']} | {r['trained_once_in_order']} | {r['max_staleness']:.0f} | "
              f"{r['manager_restarts']:.0f} | {r['replica_restarts']:.0f} | {r['rerun_trajectories']:.0f} | {r['lost_requests']:.0f} | "
              f"{r['val_first']:.3f} | {r['val_final']:.3f} | {r['wall_s']:.0f} |")
    mean = {f: sum(r["val_final"] for r in rows if r["faults"] == f) / len(seeds) for f in (False, True)}
    diffs = [b["val_final"] - a["val_final"] for a, b in zip(rows[0::2], rows[1::2])]
    print(f"held-out at the end, mean of {len(seeds)} seed(s): no faults {mean[False]:.3f}, faults {mean[True]:.3f}, "
          f"difference {mean[True] - mean[False]:+.3f} (per seed: {', '.join(f'{d:+.3f}' for d in diffs)})")
    for r in rows[1::2]:
        print(f"kills, seed {r['seed']}: {r['killed']}")


if __name__ == "__main__":
    main()
