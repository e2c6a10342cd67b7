"""`hybridflow` command line: train | sft | dpo | rm | demo | make-model | make-data | plot | export | plan | prepare.

    hybridflow train configs/grpo_tiny.yaml actor_rollout_ref.rollout.n=8 trainer.total_training_steps=20
    hybridflow sft configs/sft_tiny.yaml total_steps=100
    hybridflow dpo configs/dpo_tiny.yaml dpo.beta=0.1        (dpo.online=true: online DPO)
    hybridflow rm configs/rm_tiny.yaml total_steps=100
    hybridflow demo --output-dir runs/demo [--recipe grpo|dpo|rm-grpo|online-dpo]
    hybridflow plot runs/demo/grpo/metrics.jsonl -o curves.png
    hybridflow export runs/demo/grpo/global_step_60 runs/policy_hf
    hybridflow plan --preset llama3-8b --nodes 8 --gpus-per-node 8 --train-layout pp2xtp8xdp4 --gen-tp 4
    hybridflow prepare gsm8k_train.jsonl --split train -o data/gsm8k/train.parquet
    hybridflow prepare --reasoning-gym chain_sum --size 2000 --seed 1 -o data/rg/train.parquet
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _load(schema, config: str | None, overrides: list[str]):
    from hybridflow.config import ConfigError, load_config

    try:
        return load_config(config, overrides, schema=schema)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


def _user_errors() -> dict[type, str]:
    """Errors a user can act on, reported as one line (prefix: message) and exit status 1, no traceback."""
    from hybridflow.config import ConfigError
    from hybridflow.controller.worker_group import WorkerCallError, WorkerDiedError
    from hybridflow.data.dataset import DataError
    from hybridflow.rewards.loader import RewardFunctionError
    from hybridflow.trainer.rl import NonFiniteError

    return {ConfigError: "config error", DataError: "data error", RewardFunctionError: "reward function error",
            WorkerDiedError: "worker died", WorkerCallError: "worker error", NonFiniteError: "training diverged"}


def _run_reporting(fn, *args):
    errors = _user_errors()
    try:
        return fn(*args)
    except tuple(errors) as e:
        prefix = next(p for cls, p in errors.items() if isinstance(e, cls))
        sys.exit(f"{prefix}: {e}")


def cmd_train(args, dpo: bool = False) -> int:
    from hybridflow.config import HybridFlowConfig

    cfg = _load(HybridFlowConfig, args.config, args.overrides)

    def make():  # validates the config and reads the data before Ray or any worker starts
        if dpo:
            from hybridflow.trainer.dpo import DPOTrainer

            return DPOTrainer(cfg)
        from hybridflow.trainer.rl import RLTrainer

        return RLTrainer(cfg, parallel_config=args.parallel_config)

    trainer = _run_reporting(make)
    try:
        result = _run_reporting(trainer.fit)
    finally:
        trainer.shutdown()
    print(json.dumps({"steps": result["steps"], "final_val": result["final_val"]}))
    return 0


def cmd_sft(args) -> int:
    from hybridflow.config import SFTConfig
    from hybridflow.trainer.sft import run_sft

    cfg = _load(SFTConfig, args.config, args.overrides)
    result = _run_reporting(run_sft, cfg)
    print(json.dumps({k: result[k] for k in ("steps", "first_loss", "final_loss", "model_dir")}))
    return 0


def cmd_rm(args) -> int:
    from hybridflow.config import RewardTrainConfig
    from hybridflow.trainer.reward_model import run_rm

    cfg = _load(RewardTrainConfig, args.config, args.overrides)
    result = _run_reporting(run_rm, cfg)
    print(json.dumps({k: result[k] for k in ("steps", "first_loss", "final_loss", "val_pair_acc", "model_dir")}))
    return 0


FORWARDED = {"make-model": "hybridflow.models.tiny:main_make_model", "make-data": "hybridflow.data.tasks:main_make_data",
             "plot": "hybridflow.utils.plot:main_plot", "export": "hybridflow.utils.export:main_export",
             "plan": "hybridflow.planning.cli:main_plan", "prepare": "hybridflow.utils.prepare:main_prepare",
             "mismatch": "hybridflow.utils.mismatch:main_mismatch"}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s] %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="hybridflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn in (("train", cmd_train), ("sft", cmd_sft), ("dpo", lambda a: cmd_train(a, dpo=True)), ("rm", cmd_rm)):
        p = sub.add_parser(name, help=f"{name} from a YAML config plus key=value overrides")
        p.add_argument("config", nargs="?", help="YAML config file")
        p.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. data.train_batch_size=16")
        if name == "train":
            p.add_argument("--parallel-config", metavar="FILE", default=None,
                           help="parallel config YAML (model/data parallel sizes, FSDP, resharding), e.g. configs/parallel_dp2_tp2.yaml; "
                                "put it before CONFIG or after the overrides")
        p.set_defaults(fn=fn)
    p = sub.add_parser("demo", help="the main job: data, tiny model, SFT warm start, GRPO on 2 workers (or another --recipe)")
    p.add_argument("--output-dir", default="runs/demo")
    p.add_argument("--recipe", default="grpo", choices=["grpo", "dpo", "rm-grpo", "online-dpo", "tool", "guess", "distill", "agent", "code", "vision"],
                   help="grpo (default): rule-reward GRPO; dpo: offline DPO on preference pairs; rm-grpo: train a reward "
                        "model on the pairs, then GRPO with it as the only reward; online-dpo: sample, rank by the rule, DPO; "
                        "tool: 3-digit multiplication with a calculator tool, multi-turn GRPO; guess: a number-guessing environment; "
                        "distill: on-policy distillation from a larger SFT-trained teacher, no reward; agent: the tool recipe's task played "
                        "by a black-box agent (examples/openai_agent/agent.py) through the OpenAI-compatible endpoint; code: the digit_max "
                        "triples with a program as the answer, GRPO with the sandboxed code reward; vision: a tiny Qwen2-VL names the colour "
                        "of a drawn circle, SFT on wrong-rule demonstrations, then GRPO")
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument("--rl-steps", type=int, default=None)
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "llama", "qwen3_moe", "mixtral", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"],
                   help="the tiny model's architecture (make-model --arch); the MoE ones have 4 experts, 2 per token")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the task data, the tiny model's initialisation, the SFT and the RL run (default: the recipe's own)")
    p.add_argument("--sft-model", default=None, metavar="DIR",
                   help="start the recipe from this SFT checkpoint instead of training one (the task data is still written)")
    p.add_argument("overrides", nargs="*", help="dotlist overrides for the GRPO config")
    p.set_defaults(fn=lambda a: _run_reporting(__import__("hybridflow.demo", fromlist=["main"]).main, a))
    for name, target in FORWARDED.items():
        p = sub.add_parser(name, help=f"{name.replace('-', ' ')} (offline), see `hybridflow {name} -h`", add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(fn=lambda a, target=target: _forward(target, a.rest))
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in FORWARDED:  # their own parsers see every argument (REMAINDER drops leading --options)
        return _forward(FORWARDED[argv[0]], argv[1:]) or 0
    args = parser.parse_args(argv)
    config = getattr(args, "config", None)
    if config and "=" in config and not os.path.isfile(config):  # no YAML file: `hybridflow train key=value ...`
        args.overrides.insert(0, config)
        args.config = None
    return args.fn(args) or 0


def _forward(target: str, argv: list[str]) -> int:
    module, fn = target.split(":")
    return getattr(__import__(module, fromlist=[fn]), fn)(argv)


if __name__ == "__main__":
    sys.exit(main())
