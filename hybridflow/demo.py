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
- code: the same triples with a program as the answer ("max 3 8 1" -> `f=lambda:max(3,8,1)`, the
  wrong rule's `f=lambda:min(3,8,1)` in 75% of the SFT demonstrations), GRPO with the built-in code
  reward (data_source "code": the program runs in the sandbox against `assert f() == 8`); its
  held-out pass rate is `val-core/code/acc/mean@1`.
- vision: a tiny Qwen2-VL on PIL-drawn circles ("which colour is the circle?"), SFT demonstrations naming the
  next colour of the cycle 75% of the time, then GRPO with the exact-answer reward (`data/vision_task.py`).
- distill: on-policy distillation without any reward: a larger tiny model (3 layers, hidden 192)
  trained by SFT on correct answers is the teacher; the student samples, the teacher scores each
  sampled token, and the student's per-token advantage is teacher - student log-prob.
"""

from __future__ import annotations

import json
import os
import time

from hybridflow.config import HybridFlowConfig, RewardTrainConfig, SFTConfig, load_config
from hybridflow.run_plan import resolve

DATA_SOURCE = "digit_max"
# The data_source of a recipe's held-out accuracy (tool, guess, agent and code have their own tasks; the others share digit_max).
RECIPE_TASK = {"tool": "multiply", "guess": "guess", "agent": "agent", "code": "code", "vision": "vision_colour"}


def val_key(recipe: str) -> str:
    return f"val-core/{RECIPE_TASK.get(recipe, DATA_SOURCE)}/acc/mean@1"


VAL_KEY = val_key("grpo")


SFT_STEPS = 300
RL_STEPS = 60
RECIPE_STEPS = {"grpo": RL_STEPS, "dpo": 40, "rm-grpo": 40, "online-dpo": 40, "tool": 20, "guess": 40, "distill": 40, "agent": 10, "code": 30,
                "vision": 40}
RM_STEPS = 100
# the tool recipe's SFT in two stages from the random model: the copy stage (every call exact) then the biased mix
TOOL_COPY_STEPS, TOOL_SFT_STEPS, TOOL_LAYERS = 450, 250, 2
GUESS_SFT_STEPS = 300
GUESS_MAX_PROMPT, GUESS_MAX_RESPONSE = 56, 448  # the prompt is 48 tokens; 10 guesses and 9 replies of <= 45 tokens
# the agent recipe's black-box agent (a plain openai program; the repo's examples/)
EXAMPLE_AGENT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "openai_agent", "agent.py")
CODE_MAX_RESPONSE = 24  # f=lambda:max(3,8,1) is 19 tokens, then <|im_end|>
CODE_SFT_MAX_LENGTH = 56  # the 28-token prompt and the program
TOOL_MAX_PROMPT, TOOL_MAX_RESPONSE = 160, 160  # the compact tool prompt is 147 tokens; call (78) + result (34) + answer (22) = 134
# the vision recipe: the prompt is 52 tokens (4 of them the image's), "yellow" + <|im_end|> is 7
VISION_MAX_PROMPT, VISION_MAX_RESPONSE, VISION_SFT_STEPS = 64, 8, 300


def _policy_run(train, val, model_dir: str, out_dir: str, steps: int, prompts: int, micro: int, *extra: str) -> HybridFlowConfig:
    """What the demo's policy runs share: the task's files and lengths, the model, lr 5e-4, one
    optimizer step per step (mini-batch = the step's batch), validation every 10 steps, a fresh run
    whose final checkpoint is kept (`<out_dir>/global_step_<steps>`, for `hybridflow export`)."""
    return load_config(None, [
        f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        f"data.train_batch_size={prompts}", "data.max_prompt_length=32", "data.max_response_length=4",
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}", f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.actor.optim.lr=5e-4", f"trainer.total_training_steps={steps}", "trainer.test_freq=10",
        f"trainer.default_local_dir={out_dir}", "trainer.resume_mode=disable", f"trainer.save_freq={steps}", *extra,
    ], schema=HybridFlowConfig)


def demo_rl_config(files: dict, model_dir: str, out_dir: str, steps: int, *overrides: str) -> HybridFlowConfig:
    """The demo's GRPO run (8 prompts x 8 samples, 2 workers) on `files` from `make_max_task`."""
    return _policy_run(files["train"], files["val"], model_dir, out_dir, steps, 8, 32, "actor_rollout_ref.rollout.n=8",
                       "actor_rollout_ref.rollout.temperature=1.0", "algorithm.adv_estimator=grpo", *overrides)


def demo_sft_config(sft_file: str, base_model: str, out: str, steps: int = SFT_STEPS, max_length: int = 32) -> SFTConfig:
    """The demo's SFT warm start on biased demonstrations."""
    return load_config(None, [
        f"train_files=[{sft_file}]", f"max_length={max_length}", "train_batch_size=64", "micro_batch_size_per_gpu=32",
        f"total_steps={steps}", f"model.path={base_model}", "optim.lr=1e-3",
        f"save_dir={out}/sft_model", f"trainer.default_local_dir={out}/sft", "trainer.logger=[console,jsonl]",
    ], schema=SFTConfig)


def demo_code_rl_config(files: dict, model_dir: str, out_dir: str, steps: int, *overrides: str) -> HybridFlowConfig:
    """The demo's GRPO run on the code task (`make_code_task`): responses up to CODE_MAX_RESPONSE tokens,
    scored by the built-in code reward (one sandbox run per sample and check)."""
    return demo_rl_config(files, model_dir, out_dir, steps, f"data.max_response_length={CODE_MAX_RESPONSE}", *overrides)


def demo_vision_rl_config(files: dict, model_dir: str, out_dir: str, steps: int, *overrides: str) -> HybridFlowConfig:
    """The vision recipe's GRPO run (`data/vision_task.py`: which colour is the circle): 8 image prompts x 8 samples on
    2 workers, the vision tower trained too (the wrong rule lives in the language model's answer, not in what it sees)."""
    return demo_rl_config(files, model_dir, out_dir, steps, f"data.max_prompt_length={VISION_MAX_PROMPT}",
                          f"data.max_response_length={VISION_MAX_RESPONSE}", *overrides)


def demo_multi_turn_sft_config(sft_file, base_model: str, out: str, steps: int, max_length: int, name: str = "sft") -> SFTConfig:
    """SFT on a multi-turn task's conversations (loss on the assistant turns only), saved to `<out>/<name>_model`."""
    return load_config(None, [
        f"train_files=[{sft_file}]", "multiturn.enable=true", f"max_length={max_length}",
        "train_batch_size=32", "micro_batch_size_per_gpu=16", f"total_steps={steps}", f"model.path={base_model}", "optim.lr=2e-3",
        "optim.lr_scheduler_type=cosine", "optim.lr_warmup_steps_ratio=0.05", "optim.min_lr_ratio=0.1",
        f"save_dir={out}/{name}_model", f"trainer.default_local_dir={out}/{name}", "trainer.logger=[console,jsonl]",
    ], schema=SFTConfig)


def demo_tool_rl_config(files: dict, model_dir: str, out_dir: str, steps: int, *overrides: str) -> HybridFlowConfig:
    """Multi-turn GRPO with the calculator: 8 prompts x 8 trajectories, at most 2 assistant turns, lr 2e-4
    (measured held-out on every seed: docs/agents.md)."""
    return _policy_run(files["train"], files["val"], model_dir, out_dir, steps, 8, 16, "actor_rollout_ref.rollout.n=8",
                       "actor_rollout_ref.rollout.temperature=1.0", "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.optim.lr=2e-4",
                       f"data.max_prompt_length={TOOL_MAX_PROMPT}", f"data.max_response_length={TOOL_MAX_RESPONSE}",
                       "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
                       f"actor_rollout_ref.rollout.multi_turn.tool_config_path={files['tool_config']}", *overrides)


def demo_guess_rl_config(files: dict, model_dir: str, out_dir: str, steps: int, *overrides: str) -> HybridFlowConfig:
    """Multi-turn GRPO against the guess environment: 8 prompts x 8 games, up to 10 guesses each, lr 2e-4
    (5e-4 left 1 seed of 5 under the bar: docs/agents.md)."""
    return _policy_run(files["train"], files["val"], model_dir, out_dir, steps, 8, 16, "actor_rollout_ref.rollout.n=8",
                       "actor_rollout_ref.rollout.temperature=1.0", "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.optim.lr=2e-4",
                       f"data.max_prompt_length={GUESS_MAX_PROMPT}", f"data.max_response_length={GUESS_MAX_RESPONSE}",
                       "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=10",
                       *overrides)


def demo_distill_config(files: dict, model_dir: str, teacher_dir: str, out_dir: str, steps: int, *overrides: str) -> HybridFlowConfig:
    """On-policy distillation from `teacher_dir`: the demo's GRPO run with the teacher's per-token
    advantage instead of the reward's (the rule reward is still computed, for the train metrics)."""
    return demo_rl_config(files, model_dir, out_dir, steps, "algorithm.adv_estimator=on_policy_distill", "teacher.enable=true",
                          f"teacher.model.path={teacher_dir}", *overrides)


def train_teacher(out: str, layers: int = 3, hidden: int = 192, steps: int = SFT_STEPS) -> str:
    """The distillation teacher: a larger tiny model (the same tokenizer) after SFT on the task's
    correct answers (the same train / held-out split as the student's data). Returns its directory."""
    from hybridflow.data.tasks import make_max_task
    from hybridflow.models.tiny import make_tiny_model
    from hybridflow.trainer.sft import run_sft

    files = make_max_task(os.path.join(out, "teacher_data"), bias_prob=0.0)  # every demonstration right
    base = make_tiny_model(os.path.join(out, "teacher_base"), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers)
    cfg = demo_sft_config(files["sft"], str(base), os.path.join(out, "teacher"), steps)
    run_sft(cfg)
    return cfg.save_dir


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
        print(f"[demo] GRPO: {steps} steps, {cfg.data.train_batch_size} prompts x {resolve(cfg).rollout.rollout.n} samples, {_workers(cfg)}", flush=True)
        result = _fit(RLTrainer(cfg))
    elif recipe == "code":
        cfg = demo_code_rl_config(files, sft_dir, f"{out}/code_grpo", steps, *overrides)
        print(f"[demo] GRPO with the code reward (programs run in the sandbox against an assert): {steps} steps, "
              f"{cfg.data.train_batch_size} prompts x {resolve(cfg).rollout.rollout.n} samples, {_workers(cfg)}", flush=True)
        result = _fit(RLTrainer(cfg))
    elif recipe == "vision":
        cfg = demo_vision_rl_config(files, sft_dir, f"{out}/vision_grpo", steps, *overrides)
        print(f"[demo] GRPO on image prompts (a tiny Qwen2-VL): {steps} steps, {cfg.data.train_batch_size} prompts x "
              f"{resolve(cfg).rollout.rollout.n} samples, {_workers(cfg)}", flush=True)
        result = _fit(RLTrainer(cfg))
    elif recipe == "dpo":
        cfg = demo_dpo_config(files, sft_dir, f"{out}/dpo", steps, *overrides)
        print(f"[demo] offline DPO: {steps} steps of {cfg.data.train_batch_size} preference pairs, 2 FSDP2 workers", flush=True)
        result = _fit(DPOTrainer(cfg))
    elif recipe == "online-dpo":
        cfg = demo_online_dpo_config(files, sft_dir, f"{out}/online_dpo", steps, *overrides)
        print(f"[demo] online DPO: {steps} steps, {cfg.data.train_batch_size} prompts x {resolve(cfg).rollout.rollout.n} samples ranked by the rule",
              flush=True)
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
    elif recipe == "distill":
        print(f"[demo] teacher: SFT of a 3-layer tiny model on correct answers ({SFT_STEPS} steps)", flush=True)
        teacher = train_teacher(out)
        cfg = demo_distill_config(files, sft_dir, teacher, f"{out}/distill", steps, *overrides)
        print(f"[demo] on-policy distillation (no reward in the update): {steps} steps, {cfg.data.train_batch_size} prompts x "
              f"{resolve(cfg).rollout.rollout.n} samples scored token by token by the teacher, {_workers(cfg)}", flush=True)
        result = _fit(RLTrainer(cfg))
    elif recipe in ("tool", "guess", "agent"):
        make = demo_guess_rl_config if recipe == "guess" else demo_tool_rl_config
        if recipe == "agent":  # the tool recipe's task played by a black-box agent through the OpenAI-compatible endpoint
            overrides = (f"actor_rollout_ref.rollout.agent.function={EXAMPLE_AGENT}:rollout", *overrides)
        cfg = make(files, sft_dir, f"{out}/{recipe}_grpo", steps, *overrides)
        what = {"tool": "the calculator", "guess": "the guessing environment",
                "agent": f"a black-box agent ({os.path.relpath(EXAMPLE_AGENT)}: openai client, its own calculator and score)"}[recipe]
        print(f"[demo] multi-turn GRPO with {what}: {steps} steps, {cfg.data.train_batch_size} prompts x "
              f"{resolve(cfg).rollout.rollout.n} trajectories, {_workers(cfg)}", flush=True)
        result = _fit(RLTrainer(cfg))
        extra = _agent_summary(result["history"])
    else:
        raise ValueError(f"unknown recipe {recipe!r}; expected one of {sorted(RECIPE_STEPS)}")
    history = result["history"]
    key = val_key(recipe)
    return {"val_curve": [(h["step"], h[key]) for h in history if key in h], "steps": result["steps"], "history": history, **extra}


def _agent_summary(history: list[dict]) -> dict:
    """Held-out (greedy) turns, turns per solved game and tool calls per trajectory, after SFT and at the end."""
    out = {}
    for name, key in (("num_turns/mean", "val_turns"), ("num_turns/solved_mean", "val_turns_per_solved"), ("tool_calls/mean", "val_tool_calls")):
        vals = [h[f"val-aux/agent/{name}"] for h in history if f"val-aux/agent/{name}" in h]
        if vals:
            out[f"{key}_after_sft"], out[f"{key}_final"] = vals[0], vals[-1]
    return out


def _sft_record(sft_model: str) -> dict:
    """What a warm start made elsewhere says about its SFT (``sft_record.json`` beside the weights, as
    ``scripts/build_recipe_fixtures.py`` writes it); {} when there is none."""
    path = os.path.join(sft_model, "sft_record.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _workers(cfg) -> str:
    """"2 FSDP2 workers", or the 3D layout when the overrides set one ("4 workers: PP 1 x TP 2 x FSDP2 2")."""
    a, n = resolve(cfg).actor.actor, cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    pp, tp = a.pipeline_model_parallel_size, a.tensor_model_parallel_size
    return f"{n} FSDP2 workers" if pp == tp == 1 else f"{n} workers: PP {pp} x TP {tp} x FSDP2 {n // (pp * tp)}"


def prepare_recipe(recipe: str, out: str, seed: int | None = None, sft_steps: int | None = None,
                   arch: str = "qwen2") -> tuple[dict, str, list[SFTConfig]]:
    """The recipe's task files, its tiny base model and its SFT stages (configs, not run yet; each stage
    starts from the one before, the last saves `<out>/sft_model`), all under `out`. `seed` (None: the
    defaults, 0 for data and model, 1 for the trainers) seeds the data, the model's initialisation and
    the SFT's batches; `sft_steps` replaces the last stage's step count; `arch` is the tiny model's
    (`make_tiny_model`: qwen2, llama, or a mixture of experts such as qwen3_moe, 4 experts, 2 per token)."""
    from hybridflow.agent.tasks import make_guess_task
    from hybridflow.data.tasks import make_code_task, make_max_task, make_multiply_task
    from hybridflow.models.tiny import make_tiny_model

    data_seed = {} if seed is None else {"seed": seed}
    model_kw = {**data_seed, "arch": arch}
    if recipe in ("tool", "agent"):  # its own task: 3-digit products, a calculator, conversations of ~300 tokens
        files = make_multiply_task(os.path.join(out, "data"), **data_seed, **({"data_source": "agent"} if recipe == "agent" else {}))
        base = make_tiny_model(os.path.join(out, "tiny_model"), hidden_size=128, intermediate_size=256, num_hidden_layers=TOOL_LAYERS,
                               max_position_embeddings=512, tools_template=True, **model_kw)
        max_length = TOOL_MAX_PROMPT + TOOL_MAX_RESPONSE
        copy = demo_multi_turn_sft_config(files["sft_copy"], base, out, TOOL_COPY_STEPS, max_length, name="copy")
        stages = [copy, demo_multi_turn_sft_config(files["sft"], copy.save_dir, out, sft_steps or TOOL_SFT_STEPS, max_length)]
    elif recipe == "guess":  # its own task: games against the guess environment
        files = make_guess_task(os.path.join(out, "data"), **data_seed)
        base = make_tiny_model(os.path.join(out, "tiny_model"), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                               max_position_embeddings=1024, **model_kw)
        stages = [demo_multi_turn_sft_config(files["sft"], base, out, sft_steps or GUESS_SFT_STEPS, GUESS_MAX_PROMPT + GUESS_MAX_RESPONSE)]
    elif recipe == "vision":  # its own task: PIL-drawn circles, "which colour is the circle?", a tiny VLM
        from hybridflow.data.vision_task import make_vision_task

        files = make_vision_task(os.path.join(out, "data"), **data_seed)
        base = make_tiny_model(os.path.join(out, "tiny_model"), **{**model_kw, "arch": arch if arch in ("qwen2_vl", "qwen2_5_vl") else "qwen2_vl"})
        stages = [demo_sft_config(files["sft"], base, out, sft_steps or VISION_SFT_STEPS, VISION_MAX_PROMPT + VISION_MAX_RESPONSE)]
    elif recipe == "code":  # digit_max's triples and split, a program as the answer
        files = make_code_task(os.path.join(out, "data"), **data_seed)
        base = make_tiny_model(os.path.join(out, "tiny_model"), hidden_size=128, intermediate_size=256, num_hidden_layers=2, **model_kw)
        stages = [demo_sft_config(files["sft"], base, out, sft_steps or SFT_STEPS, CODE_SFT_MAX_LENGTH)]
    else:
        files = make_max_task(os.path.join(out, "data"), **data_seed)
        base = make_tiny_model(os.path.join(out, "tiny_model"), hidden_size=128, intermediate_size=256, num_hidden_layers=2, **model_kw)
        stages = [demo_sft_config(files["sft"], base, out, sft_steps or SFT_STEPS)]
    if seed is not None:
        for cfg in stages:
            cfg.trainer.seed = seed
    return files, base, stages


def run_sft_stages(stages: list[SFTConfig]) -> dict:
    """Run the SFT stages in order: the last stage's result, with `stages` (each stage's name, steps,
    first 5 losses and final loss) and `steps` (all stages' steps)."""
    from hybridflow.trainer.sft import run_sft

    results = []
    for cfg in stages:
        print(f"[demo] SFT stage {os.path.basename(cfg.save_dir)}: {cfg.total_steps} steps from {cfg.model.path}", flush=True)
        results.append(run_sft(cfg))
    stage_info = [{"name": os.path.basename(cfg.save_dir), "steps": r["steps"], "first_losses": r["losses"][:5],
                   "final_loss": r["final_loss"]}
                  for cfg, r in zip(stages, results)]
    return {**results[-1], "steps": sum(r["steps"] for r in results), "stages": stage_info}


def main(args) -> int:
    start = time.time()
    recipe = getattr(args, "recipe", "grpo")
    seed = getattr(args, "seed", None)
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    arch = getattr(args, "arch", "qwen2")
    if recipe == "vision" and arch not in ("qwen2_vl", "qwen2_5_vl"):
        arch = "qwen2_vl"  # the vision recipe's model is a VLM (what prepare_recipe builds; the summary says so)
    files, base, sft_stages = prepare_recipe(recipe, out, seed, args.sft_steps, arch)
    print(f"[demo] task data in {out}/data, tiny model in {base}", flush=True)
    sft_model = getattr(args, "sft_model", None)
    if sft_model:  # a warm start made before (e.g. tests/fixtures/recipes): the SFT is skipped
        sft_model = os.path.abspath(sft_model)
        print(f"[demo] SFT warm start from {sft_model} (not trained here)", flush=True)
        sft = _sft_record(sft_model)
    else:
        print(f"[demo] SFT warm start: {' then '.join(str(c.total_steps) for c in sft_stages)} steps", flush=True)
        sft = run_sft_stages(sft_stages)
        sft_model = f"{out}/sft_model"
    seeded = () if seed is None else (f"trainer.seed={seed}", f"data.seed={seed}")
    run = run_recipe(recipe, files, sft_model, out, args.rl_steps or RECIPE_STEPS[recipe], *seeded, *args.overrides)
    history, val_curve = run.pop("history"), run.pop("val_curve")
    score_key = "critic/score/mean"
    summary = {
        "recipe": recipe,
        "arch": arch,
        "seed": seed,
        "val_acc_after_sft": val_curve[0][1],
        "val_acc_final": val_curve[-1][1],
        "steps": run.pop("steps"),
        "wall_seconds": round(time.time() - start, 1),
        "sft_steps": sft.get("steps"),
        "sft_final_loss": sft.get("final_loss"),
        "sft_stages": sft.get("stages"),
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
