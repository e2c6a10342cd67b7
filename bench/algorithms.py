"""The demo task with each RL algorithm, side by side from one SFT model.

One SFT warm start (the demo's: biased digit_max demonstrations), then the demo's GRPO run with
each algorithm's keys; the table gives held-out greedy accuracy after SFT, at step 20 and at the
end, and the wall time of each run.

    grpo      algorithm.adv_estimator=grpo (the demo)
    dr_grpo   + loss_agg_mode=seq-mean-token-sum-norm, algorithm.norm_adv_by_std_in_grpo=false
    dapo      + clip_ratio_low 0.2 / clip_ratio_high 0.28, token-mean, overlong shaping (buffer 2 of 4 tokens),
              dynamic sampling (algorithm.filter_groups, up to 20 generation rounds a step); configs/dapo_tiny.yaml.
              At most 40 steps: once the policy solves nearly every training prompt, groups with differing
              rewards become rare (measured: 8-15 rounds a step from step 32, 20 rounds for 5 of 8 groups at
              step 44); such a step trains on the groups kept (data/underfilled_batches; verl would stop,
              as algorithm.filter_groups.strict=true does), and the cap bounds the wall time
    gspo      + policy_loss.loss_mode=gspo (clip 3e-4 / 4e-4, as the paper)
    cispo     + policy_loss.loss_mode=cispo
    distill   on-policy distillation, no reward in the update: a 3-layer teacher SFT'd on correct answers
              scores each sampled token (demo --recipe distill; the wall time includes the teacher's SFT)

Run:  .venv/bin/python bench/algorithms.py --json runs/bench_algorithms.json [--steps 60] [--only gspo,cispo]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_rows  # noqa: E402

A = "actor_rollout_ref.actor"
ALGORITHMS = {
    "grpo": [],
    "dr_grpo": [f"{A}.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.norm_adv_by_std_in_grpo=false"],
    "dapo": [f"{A}.clip_ratio_low=0.2", f"{A}.clip_ratio_high=0.28", f"{A}.loss_agg_mode=token-mean",
             "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=2", "reward_model.overlong_buffer.penalty_factor=1.0",
             "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=20"],
    "gspo": [f"{A}.policy_loss.loss_mode=gspo", f"{A}.clip_ratio_low=3e-4", f"{A}.clip_ratio_high=4e-4"],
    "cispo": [f"{A}.policy_loss.loss_mode=cispo"],
    "distill": [],  # its own recipe: run_recipe("distill")
}
MAX_STEPS = {"dapo": 40}  # varied groups become rare on this easy task: late steps take 20 generation rounds (see above)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--only", default=None, help="comma-separated algorithms (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hybridflow.data.tasks import make_max_task
    from hybridflow.demo import demo_sft_config, run_recipe
    from hybridflow.models.tiny import make_tiny_model
    from hybridflow.trainer.sft import run_sft

    out = tempfile.mkdtemp(prefix="bench_algorithms_")
    files = make_max_task(os.path.join(out, "data"))
    base = make_tiny_model(os.path.join(out, "tiny_model"), hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    cfg = demo_sft_config(files["sft"], str(base), out)
    cfg.trainer.logger = ["jsonl"]
    run_sft(cfg)
    rows = []
    for name in (args.only.split(",") if args.only else ALGORITHMS):
        start = time.perf_counter()
        steps = min(args.steps, MAX_STEPS.get(name, args.steps))
        run = run_recipe("distill" if name == "distill" else "grpo", files, os.path.join(out, "sft_model"), os.path.join(out, name), steps,
                         "trainer.progress_bar=false",
                         "trainer.logger=[jsonl]", *ALGORITHMS[name])
        curve = dict(run["val_curve"])
        rows.append({"algorithm": name, "val_after_sft": curve[0], "val_step_20": curve.get(20, float("nan")), "val_final": run["val_curve"][-1][1],
                     "steps": run["steps"], "wall_seconds": time.perf_counter() - start})
        print(f"{name}: {curve}", flush=True)
    print_rows(f"the demo task (digit_max) from one SFT model, {args.steps} steps each (dapo: at most 40), held-out greedy accuracy",
               [("algorithm", "algorithm", "<9"), ("val_after_sft", "after SFT", ">9.3f"), ("val_step_20", "step 20", ">8.3f"),
                ("val_final", "final", ">6.3f"), ("steps", "steps", ">5"), ("wall_seconds", "wall s", ">7.1f")], rows, args.json)


if __name__ == "__main__":
    main()
