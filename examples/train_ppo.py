"""The demo's RL dataflow launched by torchrun: no Ray, every process is one rank and runs the
driver loop itself (the multi-controller half of the hybrid model, `controller/local_group.py`).

    torchrun --nproc_per_node=2 examples/train_ppo.py --output-dir runs/torchrun
    torchrun --nnodes=2 --node_rank=R --master_addr=HOST --master_port=29500 --nproc_per_node=8 examples/train_ppo.py ...

Same steps as `hybridflow demo` (data, tiny model, SFT warm start, GRPO with the exact-answer
reward, held-out accuracy before and after) with `trainer.launcher=torchrun`; rank 0 writes
`<output-dir>/summary.json` with the demo's keys. Extra `key=value` arguments override the GRPO
config (e.g. `algorithm.adv_estimator=gae` for PPO with a critic). Checkpoints have the Ray mode's
format: `trainer.save_freq=10` here, then `hybridflow train ... trainer.default_local_dir=<same>`
resumes under Ray (and the other way round).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch.distributed as dist

from hybridflow.controller.local_group import init_torchrun
from hybridflow.controller.worker import pick_device
from hybridflow.data.tasks import make_max_task
from hybridflow.demo import SFT_STEPS, VAL_KEY, demo_rl_config, demo_sft_config
from hybridflow.models.tiny import make_tiny_model
from hybridflow.trainer.rl import RLTrainer
from hybridflow.trainer.sft import run_sft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="runs/torchrun")
    p.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    p.add_argument("--rl-steps", type=int, default=60)
    p.add_argument("--sft-model", default=None, help="start from this SFT checkpoint (skip data, model and SFT; needs --data-dir)")
    p.add_argument("--data-dir", default=None, help="the task files of `hybridflow make-data` (default: written to <output-dir>/data)")
    p.add_argument("overrides", nargs="*", help="GRPO config overrides, key=value")
    args = p.parse_args()
    start = time.time()
    rank, world = init_torchrun(pick_device("auto"), 600)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=f"[rank {rank}] %(message)s")
    out = os.path.abspath(args.output_dir)
    data_dir = os.path.abspath(args.data_dir or os.path.join(out, "data"))
    files = {k: os.path.join(data_dir, f"{k}.parquet") for k in ("train", "val", "sft")}
    if rank == 0 and args.data_dir is None:  # every rank reads the same files
        make_max_task(data_dir)
    if rank == 0 and args.sft_model is None:
        make_tiny_model(os.path.join(out, "tiny_model"), hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    dist.barrier()
    launch = ["trainer.launcher=torchrun", f"trainer.n_gpus_per_node={world}"]

    sft = {"steps": 0, "final_loss": None}
    if args.sft_model is None:
        sft_cfg = demo_sft_config(files["sft"], os.path.join(out, "tiny_model"), out, args.sft_steps)
        sft_cfg.trainer.launcher, sft_cfg.trainer.n_gpus_per_node = "torchrun", world
        sft = run_sft(sft_cfg)

    cfg = demo_rl_config(files, args.sft_model or f"{out}/sft_model", f"{out}/grpo", args.rl_steps, *launch, *args.overrides)
    trainer = RLTrainer(cfg)
    try:
        result = trainer.fit()
    finally:
        trainer.shutdown()
    curve = [(h["step"], h[VAL_KEY]) for h in result["history"] if VAL_KEY in h]
    if rank == 0:
        summary = {"val_acc_after_sft": curve[0][1], "val_acc_final": curve[-1][1], "steps": result["steps"],
                   "wall_seconds": round(time.time() - start, 1), "sft_steps": sft["steps"], "sft_final_loss": sft["final_loss"],
                   "val_curve": curve, "launcher": "torchrun", "world_size": world, "output_dir": out}
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps({k: summary[k] for k in ("val_acc_after_sft", "val_acc_final", "steps", "wall_seconds")}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
