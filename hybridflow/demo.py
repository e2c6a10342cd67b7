"""The demo (main job): RL fixing what SFT taught wrong, end to end on 2 FSDP2 workers.

1. Write the `digit_max` task ("max 3 8 1" -> "8"); val triples are held out from SFT and RL;
   SFT demonstrations follow the wrong rule (the minimum) 75% of the time.
2. Build a tiny Qwen2 checkpoint and char tokenizer offline.
3. SFT warm start: the model learns the answer format and both rules, preferring the wrong one,
   so its greedy accuracy is near 0.
4. GRPO with the exact-answer reward on 2 workers: the verifiable reward is the only source of
   the right rule's preference; held-out accuracy climbs because the rule, not a fact, changed.
5. Write `summary.json`: val_acc_after_sft, val_acc_final, steps, wall_seconds (and more).

Other recipes (`--recipe`) replace step 4, from the same SFT model and the same held-out scoring:
- dpo: offline DPO on the task's preference pairs (chosen = the maximum, rejected = another digit).
- rm-grpo: train a reward model on those pairs (from the SFT model's backbone; its held-out
  pairwise accuracy is `rm_val_pair_acc`), then GRPO with the reward model as the only reward.
- online-dpo: sample 4 answers per prompt, rank them with the rule scorer, DPO on best vs worst.
"""

from __future__ import annotations

import json
import os
import time

from hybridflow.config import HybridFlowConfig, RewardTrainConfig, SFTConfig, load_config

DATA_SOURCE = "digit_max"
VAL_KEY = f"val-core/{DATA_SOURCE}/acc/mean@1"
SFT_STEPS = 300
RL_STEPS = 60
RECIPE_STEPS = {"grpo": RL_STEPS, "dpo": 40, "rm-grpo": 40, "online-dpo": 40}
RM_STEPS = 100


def _policy_run(train, val, model_dir: str, out_dir: str, steps: int, prompts: int, micro: int, *extra: str) -> HybridFlowConfig:
    """What the demo's policy runs share: the task's files and lengths, the model, lr 5e-4, one
    optimizer step per step (mini-batch = the step's batch), validation every 10 steps, a fresh run."""
    return load_config(None, [
        f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"data.train_batch_size={prompts}", "data.max_prompt_length=32", "data.max_response_length=4",
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}", f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.optim.lr=5e-4", f"trainer.total_training_steps={steps}", "trainer.test_freq=10",
        f"trainer.default_local_dir={out_dir}", "trainer.resume_mode=disable", *extra,
    ], schema=HybridFlowConfig)


def demo_rl_config(files: dict, model_dir: str, out_dir: str, steps: int, *overrides: str) -> HybridFlowConfig:
    """The demo's GRPO run (8 prompts x 8 samples, 2 workers) on `files` from `make_max_task`."""
    return _policy_run(files["train"], files["val"], model_dir, out_dir, steps, 8, 32, "actor_rollout_ref.rollout.n=8",
                       "actor_rollout_ref.rollout.temperature=1.0", "algorithm.adv_estimator=grpo", *overrides)


def demo_sft_config(sft_file: str, base_model: str, out: str, steps: int = SFT_STEPS) -> SFTConfig:
    """The demo's SFT warm start on biased demonstrations."""
    return load_config(None, [
        f"train_files=[{sft_file}]", "max_length=32", "train_batch_size=64", "micro_batch_size_per_gpu=32",
        f"total_steps={steps}", f"model.path={base_model}", "optim.lr=1e-3",
        f"save_dir={out}/sft_model", f"trainer.default_local_dir={out}/sft", "trainer.logger=[console,jsonl]",
    ], schema=SFTConfig)


def demo_dpo_config(files: dict, model_dir: str, out_dir: str, steps: int, *overrides: str) -> HybridFlowConfig:
    """Offline DPO on the preference pairs: 32 pairs per step, held-out greedy accuracy every 10 steps."""
    return _policy_run(files["pref_train"], files["val"], model_dir, out_dir, steps, 32, 32, "dpo.beta=0.1", *overrides)


def demo_online_dpo_config(files: dict, model_dir: str, out_dir: str, steps: int, *overrides: str) -> HybridFlowConfig:
    """Online DPO: 16 prompts x 4 samples per step, ranked by the rule scorer, best vs worst."""
    return _policy_run(files["train"], files["val"], model_dir, out_dir, steps, 16, 16, "actor_rollout_ref.rollout.n=4",
                       "actor_rollout_ref.rollout.temperature=1.0", "dpo.online=true", "dpo.beta=0.1", *overrides)


def demo_rm_config(files: dict, model_dir: str, out_dir: str, steps: int = RM_STEPS, *overrides: str) -> RewardTrainConfig:
    """The reward model: the SFT model's backbone + a new score head, Bradley-Terry on the pairs."""
    return load_config(None, [
        f"train_files=[{files['pref_train']}]", f"val_files=[{files['pref_val']}]",
        "max_prompt_length=32", "max_response_length=4", "train_batch_size=32", "micro_batch_size_per_gpu=32",
        f"total_steps={steps}", f"model.path={model_dir}", "optim.lr=5e-4", "trainer.test_freq=20",
        f"save_dir={out_dir}/reward_model", f"trainer.default_local_dir={out_dir}/rm", "trainer.logger=[console,jsonl]", *overrides,
    ], schema=RewardTrainConfig)


def _fit(trainer) -> dict:
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


def run_recipe(recipe: str, files: dict, sft_dir: str, out: str, steps: int, *overrides: str) -> dict:
    """One recipe from the SFT model: {val_curve [(step, acc)], steps, history, **recipe keys}."""
    from hybridflow.trainer.dpo import DPOTrainer
    from hybridflow.trainer.rl import RLTrainer

    extra: dict = {}
    if recipe == "grpo":
        cfg = demo_rl_config(files, sft_dir, f"{out}/grpo", steps, *overrides)
        print(f"[demo] GRPO: {steps} steps, {cfg.data.train_batch_size} prompts x {cfg.actor_rollout_ref.rollout.n} samples, {_workers(cfg)}", flush=True)
        result = _fit(RLTrainer(cfg))
    elif recipe == "dpo":
        cfg = demo_dpo_config(files, sft_dir, f"{out}/dpo", steps, *overrides)
        print(f"[demo] offline DPO: {steps} steps of {cfg.data.train_batch_size} preference pairs, 2 FSDP2 workers", flush=True)
        result = _fit(DPOTrainer(cfg))
    elif recipe == "online-dpo":
        cfg = demo_online_dpo_config(files, sft_dir, f"{out}/online_dpo", steps, *overrides)
        print(f"[demo] online DPO: {steps} steps, {cfg.data.train_batch_size} prompts x {cfg.actor_rollout_ref.rollout.n} samples ranked by the rule", flush=True)
        result = _fit(DPOTrainer(cfg))
    elif recipe == "rm-grpo":
        from hybridflow.trainer.reward_model import run_rm

        rm_cfg = demo_rm_config(files, sft_dir, out)
        print(f"[demo] reward model: {rm_cfg.total_steps} Bradley-Terry steps on preference pairs", flush=True)
        rm = run_rm(rm_cfg)
        extra = {"rm_val_pair_acc": rm["val_pair_acc"], "rm_final_loss": rm["final_loss"]}
        cfg = demo_rl_config(files, sft_dir, f"{out}/rm_grpo", steps, "reward_model.enable=true",
                             f"reward_model.model.path={out}/reward_model", *overrides)
        print(f"[demo] GRPO with the reward model as the only reward: {steps} steps", flush=True)
        result = _fit(RLTrainer(cfg))
    else:
        raise ValueError(f"unknown recipe {recipe!r}; expected one of {sorted(RECIPE_STEPS)}")
    history = result["history"]
    return {"val_curve": [(h["step"], h[VAL_KEY]) for h in history if VAL_KEY in h], "steps": result["steps"], "history": history, **extra}


def _workers(cfg) -> str:
    """"2 FSDP2 workers", or the 3D layout when the overrides set one ("4 workers: PP 1 x TP 2 x FSDP2 2")."""
    a, n = cfg.actor_rollout_ref.actor, cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    pp, tp = a.pipeline_model_parallel_size, a.tensor_model_parallel_size
    return f"{n} FSDP2 workers" if pp == tp == 1 else f"{n} workers: PP {pp} x TP {tp} x FSDP2 {n // (pp * tp)}"


def main(args) -> int:
    from hybridflow.data.tasks import make_max_task
    from hybridflow.models.tiny import make_tiny_model
    from hybridflow.trainer.sft import run_sft

    start = time.time()
    recipe = getattr(args, "recipe", "grpo")
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    files = make_max_task(os.path.join(out, "data"))
    base = make_tiny_model(os.path.join(out, "tiny_model"), hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    print(f"[demo] task data in {out}/data, tiny model in {base}", flush=True)

    sft_cfg = demo_sft_config(files["sft"], base, out, args.sft_steps or SFT_STEPS)
    print(f"[demo] SFT warm start: {sft_cfg.total_steps} steps on biased demonstrations", flush=True)
    sft = run_sft(sft_cfg)

    run = run_recipe(recipe, files, f"{out}/sft_model", out, args.rl_steps or RECIPE_STEPS[recipe], *args.overrides)
    history, val_curve = run.pop("history"), run.pop("val_curve")
    score_key = "critic/score/mean"
    summary = {
        "recipe": recipe,
        "val_acc_after_sft": val_curve[0][1],
        "val_acc_final": val_curve[-1][1],
        "steps": run.pop("steps"),
        "wall_seconds": round(time.time() - start, 1),
        "sft_steps": sft["steps"],
        "sft_final_loss": sft["final_loss"],
        "val_curve": val_curve,
        "train_score_first": history[1].get(score_key) if len(history) > 1 else None,
        "train_score_last": history[-1].get(score_key),
        **run,
        "output_dir": out,
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    from hybridflow.utils.plot import plot_metrics

    plot_metrics(history, os.path.join(out, "curves.png"), title=f"demo: {recipe}")
    print("\n[demo] summary")
    for k in ("recipe", "val_acc_after_sft", "val_acc_final", "steps", "wall_seconds", "train_score_first", "train_score_last", *run):
        v = summary[k]
        print(f"  {k:<20} {v:.3f}" if isinstance(v, float) else f"  {k:<20} {v}")
    print(f"  written to {out}/summary.json (curves: {out}/curves.png)")
    return 0
