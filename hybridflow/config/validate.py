"""Driver-side config checks, run BEFORE Ray or any worker starts.

Every problem is collected and reported at once, each with its key and what to change, so a user
fixes a config in one round instead of one crash per worker start-up.

Here: the run's checks (trainer, resource pools, data, algorithm, features that do not combine)
and the helpers every check uses (`Problems`). Each role's spec checks itself (its layout against
its pool and the model, its batch shapes, its section's values: `hybridflow.run_plan`, the
"role_specs" check); other checks that need a component's knowledge (the rollout backends, the
registries of advantage estimators and policy losses, a model's parameter names, the tools) live
with that component, which registers them here on import (`register_check`). The validator imports the modules named in
CHECK_MODULES -- by name, when it runs -- so hybridflow.config imports nothing above it (config is
the bottom layer: docs/architecture.md, "Layers and imports") and this tuple is the one place that
names them.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Callable, Literal

from hybridflow.config.derive import derive_defaults, derive_rm_defaults, derive_sft_defaults, positive_int, resolve_mixed_precision
from hybridflow.config.loader import ConfigError, literal_choices
from hybridflow.config.pools import pool_problems, run_roles
from hybridflow.config.schema import (GROUP_ESTIMATORS, LORA_TARGETS, MODEL_DTYPES, AsyncTrainingConfig, DPOConfig, HybridFlowConfig, ModelConfig,
                                      OptimConfig, RewardTrainConfig, SFTConfig, TrainerConfig)

A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"

# ---------------------------------------------------------------- checks registered by components
CHECK_MODULES = (
    "hybridflow.run_plan",  # role_specs
    "hybridflow.algorithms",  # adv_estimators, policy_losses
    "hybridflow.planning.arch",  # freeze_modules
    "hybridflow.agent.tools",  # tool_config
    "hybridflow.rollout.base",  # rollout_backend
    "hybridflow.agent.openai_agent",  # black_box_agent
    "hybridflow.models.routing",  # router_replay
    "hybridflow.models.vlm_checks",  # vision_model
)
# name -> what the function registered under it takes and returns
CHECKS = {
    "role_specs": "(cfg, kind) -> problems: every role's spec checks itself (run_plan.RunPlan.problems), the pools known",
    "adv_estimators": "() -> the registered advantage estimators' names",
    "policy_losses": "() -> the registered policy losses' names",
    "freeze_modules": "(model_path, patterns) -> problems: actor.freeze_modules against the model's parameter names",
    "tool_config": "(path) -> problems: the multi-turn tool YAML loads, with every tool's options (e.g. sandbox limits)",
    "black_box_agent": "(function, command, multi_turn_enabled, sandbox, sandbox_paths) -> problems: actor_rollout_ref.rollout.agent "
                       "loads (a function) or names a program (a command), sandboxed if asked, with the extra paths it sees",
    "router_replay": "(mode, model_path, rollout_name, exact, pipeline_stages, multi_turn_or_agent) -> problems: actor.router_replay "
                     "against the model (MoE), the rollout backend (records the experts) and the layout",
    "rollout_backend": "(name, spec) -> problems: rollout.name names a registered (or importable) backend, and the backend's own checks of its RolloutSpec",
    "vision_model": "(model_path, freeze_vision_tower, rollout_name, continuous_batching, exact, gen_tp, pipeline_stages, async_rollout, "
                    "black_box_agent, adv_estimator) -> problems: what a vision-language policy runs with (and freeze_vision_tower needs one)",
}
_REGISTERED: dict[str, Callable] = {}


def register_check(name: str) -> Callable[[Callable], Callable]:
    """Decorator: the function answers the validator's check `name` (one of CHECKS)."""
    if name not in CHECKS:
        raise ValueError(f"unknown config check {name!r}; the validator asks for {sorted(CHECKS)}")

    def deco(fn: Callable) -> Callable:
        old = _REGISTERED.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (fn.__module__, fn.__qualname__):
            raise ValueError(f"config check {name!r} is already registered by {old.__module__}.{old.__qualname__}")
        _REGISTERED[name] = fn
        return fn

    return deco


def component_check(name: str) -> Callable:
    """The function registered as check `name`, after importing CHECK_MODULES (they register on import)."""
    for module in CHECK_MODULES:
        importlib.import_module(module)
    if name not in _REGISTERED:
        raise RuntimeError(f"no component registered the config check {name!r} ({CHECKS[name]}); the modules in "
                           f"hybridflow.config.validate.CHECK_MODULES register them on import")
    return _REGISTERED[name]


KL_TYPES = ["kl", "k1", "k2", "mse", "k3", "low_var_kl", "abs"]
_PER_WORKER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class Problems(list):
    def enum(self, key, value, allowed, extra=""):
        if value not in allowed:
            self.append(f"{key} must be one of {list(allowed)}, got {value!r}{extra}")

    def positive(self, key, value):
        if not (isinstance(value, int) and value > 0):
            self.append(f"{key} must be a positive integer, got {value!r}")
            return False
        return True

    def exists(self, key, path, what="file"):
        if not os.path.exists(path):
            self.append(f"{key}: {what} {path!r} does not exist")

    def model(self, key, m: ModelConfig, lora_refused: str | None = "for this model") -> int | None:
        """Check a model dir, its dtype and LoRA keys; return its max_position_embeddings when known.
        lora_refused: why lora_rank > 0 is refused here (None: LoRA is wired for this model)."""
        self.enum(f"{key}.dtype", m.dtype, MODEL_DTYPES)
        self.positive(f"{key}.fused_kernel_chunk_size", m.fused_kernel_chunk_size)
        self.lora(key, m, lora_refused)
        if not (isinstance(m.router_aux_loss_coef, (int, float)) and m.router_aux_loss_coef >= 0):
            self.append(f"{key}.router_aux_loss_coef must be a number >= 0 (0 = no load-balancing loss), got {m.router_aux_loss_coef!r}")
        cfg_file = os.path.join(m.path, "config.json")
        if not m.path or not os.path.isfile(cfg_file):
            self.append(f"{key}.path: {m.path!r} is not a directory containing config.json; point it at "
                        f"a local HF checkpoint or create a tiny one with `hybridflow make-model "
                        f"{m.path or 'PATH'}`")
            return None
        if m.tokenizer_path:
            self.exists(f"{key}.tokenizer_path", m.tokenizer_path, "directory")
        try:
            with open(cfg_file) as f:
                return json.load(f).get("max_position_embeddings")
        except (OSError, ValueError) as e:
            self.append(f"{key}.path: cannot read {cfg_file}: {e}")
            return None

    def lora(self, key, m: ModelConfig, refused: str | None) -> None:
        if not isinstance(m.lora_rank, int) or m.lora_rank < 0:
            self.append(f"{key}.lora_rank must be an integer >= 0 (0 = full fine-tuning), got {m.lora_rank!r}")
            return
        if m.lora_rank == 0:
            return
        if refused:
            self.append(f"{key}.lora_rank={m.lora_rank}: LoRA is not supported {refused} yet; set {key}.lora_rank=0")
            return
        if not m.lora_alpha > 0:
            self.append(f"{key}.lora_alpha must be > 0 (adapters are scaled by lora_alpha / lora_rank), got {m.lora_alpha!r}")
        if not 0.0 <= m.lora_dropout < 1.0:
            self.append(f"{key}.lora_dropout must be in [0, 1), got {m.lora_dropout!r}")
        targets = list(m.target_modules)
        bad = [t for t in targets if t not in LORA_TARGETS]
        if not targets or bad or ("all-linear" in targets and len(targets) > 1):
            self.append(f"{key}.target_modules must be [all-linear] or a list of {list(LORA_TARGETS[1:])}, got {targets}")

    def tokenizer(self, key, m: ModelConfig):
        """A reward model's tokenizer pads batches and renders prompts: it needs a pad token and a chat template."""
        path = m.tokenizer_source()
        try:
            with open(os.path.join(path, "tokenizer_config.json")) as f:
                tc = json.load(f)
        except (OSError, ValueError):
            return  # not a saved HF tokenizer: loading it reports the problem
        if not tc.get("pad_token"):
            self.append(f"{key}.tokenizer_path: the tokenizer in {path!r} has no pad token; set one (tokenizer.pad_token = ...) and save it")
        if not tc.get("chat_template") and not os.path.isfile(os.path.join(path, "chat_template.jinja")):
            self.append(f"{key}.tokenizer_path: the tokenizer in {path!r} has no chat template; prompts are rendered with it")

    def token_budget(self, key: str, on: bool, budget, seq_len) -> None:
        """A dynamic batch size's token budget per micro-batch must hold one whole sequence."""
        if on and isinstance(budget, int) and isinstance(seq_len, int) and budget < seq_len:
            self.append(f"{key} ({budget}) must hold one whole sequence: at least data.max_prompt_length + data.max_response_length = {seq_len}")

    def data_files(self, train_key: str, train: list, val_key: str, val: list, what: str = "parquet files"):
        if not train:
            self.append(f"{train_key} is empty; set it to one or more {what}")
        for key, files in [(train_key, train), (val_key, val)]:
            for f in files:
                self.exists(key, f)

    def fsdp(self, key: str, fc, device: str):
        self.enum(f"{key}.sharding_strategy", fc.sharding_strategy, [None, "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
        try:  # a spelling (false / true / amp / bf16 / fp16) on trainer.device
            resolve_mixed_precision(fc.mixed_precision, device, f"{key}.mixed_precision")
        except ConfigError as e:
            self.append(str(e))

    def optim(self, key, o: OptimConfig):
        self.enum(f"{key}.lr_scheduler_type", o.lr_scheduler_type, ["constant", "cosine"])
        if not o.lr > 0:
            self.append(f"{key}.lr must be > 0, got {o.lr}")

    def trainer(self, t: TrainerConfig) -> int:
        n_workers = t.nnodes * t.n_gpus_per_node
        if n_workers < 1:
            self.append(f"trainer.nnodes * trainer.n_gpus_per_node must be >= 1 (got {t.nnodes} * "
                        f"{t.n_gpus_per_node}); set trainer.n_gpus_per_node to the workers per node")
        self.enum("trainer.device", t.device, ["auto", "cpu", "cuda"])
        if t.memory_budget_gib is not None and not t.memory_budget_gib > 0:
            self.append(f"trainer.memory_budget_gib must be > 0 (GiB per worker) or null (the device's memory), got {t.memory_budget_gib}")
        self.enum("trainer.resume_mode", t.resume_mode, ["auto", "disable", "resume_path"])
        if t.resume_mode == "resume_path":
            if not t.resume_from_path:
                self.append("trainer.resume_from_path must name a global_step_<k> directory when trainer.resume_mode=resume_path")
            else:
                self.exists("trainer.resume_from_path", t.resume_from_path, "directory")
        for item in t.logger:
            self.enum("trainer.logger", item, ["console", "jsonl", "tensorboard", "wandb"])
        port = t.prometheus.port
        if port is not None and not (isinstance(port, int) and 0 <= port <= 65535):
            self.append(f"trainer.prometheus.port must be in [0, 65535] (0 = any free port) or null, got {port!r}")
        if t.max_ckpt_to_keep is not None and not (isinstance(t.max_ckpt_to_keep, int) and t.max_ckpt_to_keep >= 1):
            self.append(f"trainer.max_ckpt_to_keep must be >= 1 or null (keep all), got {t.max_ckpt_to_keep!r}")
        if not (isinstance(t.collective_timeout_s, (int, float)) and t.collective_timeout_s > 0):
            self.append(f"trainer.collective_timeout_s must be > 0 seconds, got {t.collective_timeout_s!r}")
        self.enum("trainer.launcher", t.launcher, literal_choices(TrainerConfig, "launcher"))
        if not (isinstance(t.max_nonfinite_steps, int) and t.max_nonfinite_steps >= 1):
            self.append(f"trainer.max_nonfinite_steps must be a positive integer, got {t.max_nonfinite_steps!r}")
        if not isinstance(t.worker_env, dict):
            self.append(f"trainer.worker_env must be a mapping of environment variables to string values, got {t.worker_env!r}")
        for k, v in (t.worker_env if isinstance(t.worker_env, dict) else {}).items():
            if not (isinstance(k, str) and k and "=" not in k and isinstance(v, str)):
                self.append(f"trainer.worker_env: {k!r}: {v!r} is not an environment variable; names are non-empty strings "
                            f"without '=', values are strings (quote numbers: OMP_NUM_THREADS: \"4\")")
            elif k in _PER_WORKER_ENV:
                self.append(f"trainer.worker_env.{k}: set per worker by the worker group (one of {list(_PER_WORKER_ENV)}); remove it")
        return n_workers

    def raise_if_any(self, what: str):
        if self:
            lines = "\n".join(f"  - {p}" for p in self)
            raise ConfigError(f"invalid {what} config ({len(self)} problem{'s' * (len(self) > 1)}):\n{lines}")


def model_json(path: str) -> dict:
    """The model's config.json as a dict ({} when missing or unreadable: `Problems.model` reports that)."""
    if not path:
        return {}
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def batch_checks(p: Problems, who: str, mini: int, micro: int, train_bs: int, n: int, n_workers: int, unit: str = "workers"):
    """Mini-batch (prompts, global) vs train batch, workers and micro-batch (sequences, per worker).
    n_workers: the data-parallel ranks (`unit` names them: with TP/PP training, the dp groups).
    None: not set and not derivable from the layout (`derive.py`), whose own problem is reported."""
    mini_key, micro_key = f"{who}.ppo_mini_batch_size", f"{who}.ppo_micro_batch_size_per_gpu"
    if not ((mini is None or p.positive(mini_key, mini)) & (micro is None or p.positive(micro_key, micro))) or mini is None:
        return
    if mini > train_bs:
        p.append(f"{mini_key} ({mini}) must be <= data.train_batch_size ({train_bs}); lower it")
    elif train_bs % mini:
        p.append(f"data.train_batch_size ({train_bs}) must be a multiple of {mini_key} ({mini})")
    if (mini * n) % n_workers:
        p.append(f"{mini_key} * {R}.n ({mini}*{n}={mini * n}) must be divisible by the {n_workers} "
                 f"{unit}; set {mini_key} so that the product is a multiple of {n_workers}")
        return
    per_worker = mini * n // n_workers
    if micro is None:
        return
    if micro > per_worker:
        p.append(f"{micro_key} ({micro}) is larger than the per-worker mini-batch ({mini_key} * {R}.n / "
                 f"n_workers = {per_worker} sequences); lower {micro_key} to a divisor of {per_worker}")
    elif per_worker % micro:
        p.append(f"per-worker mini-batch ({per_worker} sequences) must be divisible by {micro_key} ({micro}); "
                 f"set it to a divisor of {per_worker}")


def _async_problems(p: Problems, cfg: HybridFlowConfig) -> None:
    """async_training: the staleness bound and partial rollout, which need a rollout pool of its own."""
    t, a = cfg.trainer, cfg.async_training
    k = a.max_staleness
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
        p.append(f"async_training.max_staleness must be an integer >= 0 (policy versions a trained batch may lag; 0 = always the "
                 f"latest weights), got {k!r}")
    elif k != 1 and not t.async_rollout:
        p.append(f"async_training.max_staleness={k} applies to trainer.async_rollout=true (a rollout pool generating ahead of "
                 f"training, resource_pool.mapping.rollout on a pool of its own); the colocated rollout always generates with the "
                 f"latest weights: remove it or set trainer.async_rollout=true")
    if not (isinstance(a.max_replica_restarts, int) and not isinstance(a.max_replica_restarts, bool) and a.max_replica_restarts >= 0):
        p.append(f"async_training.max_replica_restarts must be an integer >= 0 (restarts of one rollout replica before the run "
                 f"stops; 0 = never restart), got {a.max_replica_restarts!r}")
    chunk, budget = a.partial_rollout_chunk, cfg.data.max_response_length
    if a.partial_rollout and not t.async_rollout:
        p.append("async_training.partial_rollout=true pauses running requests for the weight updates that reach a rollout pool "
                 "of its own (trainer.async_rollout=true); the colocated rollout's weights never change during generation: "
                 "remove it or set trainer.async_rollout=true")
    if not positive_int(chunk):
        p.append(f"async_training.partial_rollout_chunk must be a positive number of tokens (a request's segment), got {chunk!r}")
    elif not a.partial_rollout and chunk != AsyncTrainingConfig.partial_rollout_chunk:
        p.append(f"async_training.partial_rollout_chunk={chunk} applies to async_training.partial_rollout=true: remove it or set that")
    elif a.partial_rollout and positive_int(budget) and chunk >= budget:
        p.append(f"async_training.partial_rollout_chunk={chunk} >= data.max_response_length={budget}: no response would ever pause "
                 f"for a weight update; set it below (e.g. {max(1, budget // 4)})")
    if a.partial_rollout and cfg.actor_rollout_ref.rollout.exact:
        # A segment continues from the prefix re-sent as a prompt: its log-probs are computed on other
        # shapes than the trainer's one-sequence pass, so exact's promise (zero difference) would not hold.
        p.append("actor_rollout_ref.rollout.exact=true samples each response in one pass; async_training.partial_rollout=true "
                 "splits responses into segments sampled on other shapes than the trainer's (the difference is no longer 0): "
                 "set one of them to false")


def _dpo_problems(p: Problems, cfg: HybridFlowConfig) -> None:
    """The DPO section: the loss parameters, and online sampling (its pairs per step: ActorSpec)."""
    dpo = cfg.dpo
    p.enum("dpo.loss_type", dpo.loss_type, literal_choices(DPOConfig, "loss_type"))
    if not dpo.beta > 0:
        p.append(f"dpo.beta must be > 0, got {dpo.beta}")
    if not 0 <= dpo.label_smoothing < 0.5:
        p.append(f"dpo.label_smoothing must be in [0, 0.5), got {dpo.label_smoothing}")
    elif dpo.label_smoothing and dpo.loss_type != "sigmoid":
        p.append(f"dpo.label_smoothing (conservative DPO) applies to dpo.loss_type=sigmoid, got {dpo.loss_type}")
    if dpo.online and dpo.precompute_ref_log_probs:
        p.append("dpo.precompute_ref_log_probs=true needs fixed pairs; online DPO samples new ones every step: set it to false")
    if dpo.online and not (isinstance(cfg.actor_rollout_ref.rollout.n, int) and cfg.actor_rollout_ref.rollout.n >= 2):
        p.append(f"{R}.n must be >= 2 with dpo.online=true (best vs worst of n samples per prompt), got {cfg.actor_rollout_ref.rollout.n}")
    if cfg.trainer.async_rollout:
        p.append("trainer.async_rollout applies to `hybridflow train`; DPO samples (online) with the colocated rollout: set it to false")


def validate_config(cfg: HybridFlowConfig, kind: Literal["rl", "dpo"] = "rl") -> None:
    """Raise one ConfigError listing every problem in ``cfg`` (no-op when it is fine).
    kind: "rl" (`hybridflow train`) or "dpo" (`hybridflow dpo`, offline or online).
    Checks `cfg` as it runs: the batch sizes left unset (None) derived from the layout first
    (`derive.derive_defaults`), so only values the user set can be refused. The run's checks are
    here (trainer, pools, data, algorithm, roles that do not combine); each role's spec checks
    itself (`hybridflow.run_plan`, the "role_specs" check) once the pools are known."""
    cfg = derive_defaults(cfg, kind)
    p = Problems()
    d, arr, alg, t = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    roll = arr.rollout
    what = "RL" if kind == "rl" else "DPO"
    p.trainer(t)
    if t.launcher == "torchrun":
        if cfg.resource_pool.pools or cfg.resource_pool.mapping:
            p.append("trainer.launcher=torchrun runs every role in the torchrun processes (one pool); remove resource_pool.pools/mapping "
                     "or launch with Ray (trainer.launcher=ray)")
        if t.async_rollout:
            p.append("trainer.async_rollout needs a rollout pool of its own: it runs under trainer.launcher=ray only")
    pool_errors = pool_problems(cfg, run_roles(cfg, kind))  # config/pools.py: unknown roles or pools, empty pools, layouts a pool cannot hold
    p.extend(pool_errors)
    if pool_errors:
        p.raise_if_any(what)

    p.positive("data.train_batch_size", d.train_batch_size)
    p.positive(f"{R}.n", roll.n)
    for key, v in [("data.max_prompt_length", d.max_prompt_length), ("data.max_response_length", d.max_response_length)]:
        p.positive(key, v)
    if d.val_batch_size is not None:
        p.positive("data.val_batch_size", d.val_batch_size)
    p.enum("data.truncation", d.truncation, ["error", "left", "right"])
    p.data_files("data.train_files", d.train_files, "data.val_files", d.val_files)
    if kind == "dpo":
        _dpo_problems(p, cfg)
    p.extend(component_check("role_specs")(cfg, kind))  # hybridflow.run_plan: every role's spec checks itself
    arr = cfg.actor_rollout_ref  # hybridflow.models.routing: an MoE model, a backend that records the experts, the layout
    p.extend(component_check("router_replay")(arr.actor.router_replay.mode, arr.model.path, arr.rollout.name, arr.rollout.exact,
                                              arr.actor.pipeline_model_parallel_size,
                                              bool(arr.rollout.multi_turn.enable or arr.rollout.agent.function or arr.rollout.agent.command)))
    p.extend(component_check("vision_model")(arr.model.path, arr.model.freeze_vision_tower, roll.name, roll.continuous_batching, roll.exact,
                                             roll.tensor_model_parallel_size, arr.actor.pipeline_model_parallel_size, t.async_rollout,
                                             bool(roll.agent.function or roll.agent.command), alg.adv_estimator))

    # Roles and features that do not combine in one run.
    if t.async_rollout and alg.adv_estimator == "remax":
        p.append("algorithm.adv_estimator=remax needs a greedy baseline generated by the current policy in the step; "
                 "it does not combine with trainer.async_rollout=true (use grpo, rloo, reinforce_plus_plus or gae)")
    if t.async_rollout and roll.name == "vllm" and roll.tensor_model_parallel_size > 1:
        p.append(f"trainer.async_rollout=true with {R}.name=vllm runs one vLLM engine per rollout worker; {R}.tensor_model_parallel_size="
                 f"{roll.tensor_model_parallel_size} (vLLM's external launcher over the rollout pool) is not supported there: set it to 1, "
                 f"or use {R}.name=hf")
    _async_problems(p, cfg)
    if not (isinstance(roll.request_timeout_s, (int, float)) and roll.request_timeout_s > 0):
        p.append(f"{R}.request_timeout_s must be > 0 seconds, got {roll.request_timeout_s!r}")
    if kind == "rl" and not arr.actor.recompute_old_log_prob:
        actor = arr.actor
        single = actor.ppo_epochs == 1 and actor.ppo_mini_batch_size in (None, d.train_batch_size)  # None: derived as train_batch_size
        if not single or alg.use_kl_in_reward or t.async_rollout:
            p.append(f"{A}.recompute_old_log_prob=false needs the update to be one on-policy pass: {A}.ppo_epochs=1, "
                     f"{A}.ppo_mini_batch_size = data.train_batch_size, algorithm.use_kl_in_reward=false (it reads the old "
                     f"log-probs) and trainer.async_rollout=false (off-policy); got ppo_epochs={actor.ppo_epochs}, "
                     f"ppo_mini_batch_size={actor.ppo_mini_batch_size}, train_batch_size={d.train_batch_size}")
    if cfg.reward_model.enable and kind == "rl" and alg.adv_estimator == "remax":
        p.append("algorithm.adv_estimator=remax scores its greedy baseline with the rule reward only; it does not combine "
                 "with reward_model.enable=true (use grpo, rloo, reinforce_plus_plus or gae)")

    if kind == "rl":
        _algorithm_problems(p, cfg)
    if cfg.custom_reward_function.path:
        p.exists("custom_reward_function.path", cfg.custom_reward_function.path)
    ob = cfg.reward_model.overlong_buffer
    if ob.enable and not (isinstance(ob.len, int) and 0 < ob.len <= d.max_response_length):
        p.append(f"reward_model.overlong_buffer.len must be in [1, data.max_response_length ({d.max_response_length})] "
                 f"with overlong_buffer.enable=true, got {ob.len!r}")
    if ob.enable and not ob.penalty_factor >= 0:
        p.append(f"reward_model.overlong_buffer.penalty_factor must be >= 0, got {ob.penalty_factor!r}")
    timeout = cfg.custom_reward_function.timeout_s
    if timeout is not None and not timeout > 0:
        p.append(f"custom_reward_function.timeout_s must be > 0 seconds or null (no limit), got {timeout}")
    rw = cfg.reward_model.num_workers
    if rw is not None and not (isinstance(rw, int) and not isinstance(rw, bool) and rw >= 0):
        p.append(f"reward_model.num_workers must be an integer >= 0 (0 = the reward on the driver; null = chosen from the machine), got {rw!r}")
    elif rw and t.launcher == "torchrun":
        p.append(f"reward_model.num_workers={rw}: reward workers are Ray actors and trainer.launcher=torchrun runs without Ray; "
                 f"set it to 0 or null (the reward is scored in each driver process)")
    p.raise_if_any(what)


def _algorithm_problems(p: Problems, cfg: HybridFlowConfig) -> None:
    """The algorithm section: estimators, KL, dynamic sampling and rollout correction
    (algorithm.filter_groups / rollout_correction), distillation's teacher (its model: TeacherSpec)."""
    alg, roll = cfg.algorithm, cfg.actor_rollout_ref.rollout
    p.enum("algorithm.kl_penalty", alg.kl_penalty, KL_TYPES)
    p.enum("algorithm.kl_ctrl.type", alg.kl_ctrl.type, ["fixed", "adaptive"])
    p.enum("algorithm.adv_estimator", alg.adv_estimator, component_check("adv_estimators")())
    if alg.adv_estimator in GROUP_ESTIMATORS and isinstance(roll.n, int) and 0 < roll.n < 2:
        p.append(f"{R}.n must be >= 2 for algorithm.adv_estimator={alg.adv_estimator} (the group baseline "
                 f"needs several samples per prompt), got {roll.n}")
    distill = alg.adv_estimator == "on_policy_distill"
    if distill and not cfg.teacher.enable:
        p.append("algorithm.adv_estimator=on_policy_distill learns from a teacher: set teacher.enable=true and teacher.model.path")
    if cfg.teacher.enable and not distill:
        p.append(f"teacher.enable=true is used by algorithm.adv_estimator=on_policy_distill only (got {alg.adv_estimator!r})")
    fg, rc = cfg.algorithm.filter_groups, cfg.algorithm.rollout_correction
    if fg.enable:
        if not (isinstance(fg.max_num_gen_batches, int) and fg.max_num_gen_batches >= 0):
            p.append(f"algorithm.filter_groups.max_num_gen_batches must be >= 0 (0 = no limit), got {fg.max_num_gen_batches!r}")
        if cfg.actor_rollout_ref.rollout.n < 2:
            p.append("algorithm.filter_groups.enable=true keeps groups whose samples' rewards differ, which needs "
                     f"actor_rollout_ref.rollout.n >= 2 samples per prompt (got {cfg.actor_rollout_ref.rollout.n})")
        if cfg.trainer.async_rollout:
            p.append("algorithm.filter_groups.enable=true does not combine with trainer.async_rollout (the rollout pool "
                     "generates one fixed batch ahead); turn one of them off")
        if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
            p.append("algorithm.filter_groups.metric=seq_final_reward (rewards after the KL penalty) is not available: the "
                     "groups are filtered before the KL term is computed; use metric=seq_reward or use_kl_in_reward=false")
    key = "algorithm.rollout_correction"
    if not rc.rollout_is_threshold > 0:
        p.append(f"{key}.rollout_is_threshold must be > 0, got {rc.rollout_is_threshold!r}")
    lower, upper = rc.rs_bounds()
    if rc.rollout_rs and not 0 < lower < upper:
        p.append(f"{key}: rejection needs 0 < rollout_rs_threshold_lower < rollout_rs_threshold, got {lower!r} and {upper!r}")
    veto = rc.rollout_token_veto_threshold
    if veto is not None and not 0 < veto < 1:
        p.append(f"{key}.rollout_token_veto_threshold must be in (0, 1) (e.g. 1e-4) or null, got {veto!r}")


def validate_sft_config(cfg: SFTConfig) -> None:
    """The SFT analogue of :func:`validate_config` (an unset micro_batch_size_per_gpu derived first)."""
    cfg = derive_sft_defaults(cfg)
    p = Problems()
    n_workers = p.trainer(cfg.trainer)
    micro = cfg.micro_batch_size_per_gpu
    ok = p.positive("train_batch_size", cfg.train_batch_size) & (micro is None or p.positive("micro_batch_size_per_gpu", micro))
    if ok and n_workers >= 1:
        per = (micro or 1) * n_workers
        if cfg.train_batch_size % n_workers:
            p.append(f"train_batch_size ({cfg.train_batch_size}) must be divisible by n_workers ({n_workers}); "
                     f"set it to a multiple of {n_workers}")
        elif cfg.train_batch_size % per:
            p.append(f"train_batch_size ({cfg.train_batch_size}) must be divisible by micro_batch_size_per_gpu * "
                     f"n_workers ({cfg.micro_batch_size_per_gpu}*{n_workers}={per}); lower micro_batch_size_per_gpu")
    p.positive("max_length", cfg.max_length)
    p.positive("total_steps", cfg.total_steps)
    p.optim("optim", cfg.optim)
    max_pos = p.model("model", cfg.model, "by hybridflow sft")
    if max_pos is not None and cfg.max_length > max_pos:
        p.append(f"max_length ({cfg.max_length}) exceeds the model's max_position_embeddings ({max_pos}); lower it")
    p.data_files("train_files", cfg.train_files, "val_files", cfg.val_files)
    p.raise_if_any("SFT")


def validate_rm_config(cfg: RewardTrainConfig) -> None:
    """`hybridflow rm`: pairs per step and per forward, the starting model, the data files (an unset
    micro_batch_size_per_gpu derived first)."""
    cfg = derive_rm_defaults(cfg)
    p = Problems()
    n_workers = p.trainer(cfg.trainer)
    micro = cfg.micro_batch_size_per_gpu
    if p.positive("train_batch_size", cfg.train_batch_size) & (micro is None or p.positive("micro_batch_size_per_gpu", micro)) and n_workers >= 1:
        per_worker = 2 * cfg.train_batch_size // n_workers
        if cfg.train_batch_size % n_workers:
            p.append(f"train_batch_size ({cfg.train_batch_size} pairs) must be divisible by the {n_workers} workers")
        elif micro is not None and (micro % 2 or per_worker % micro):
            p.append(f"micro_batch_size_per_gpu ({cfg.micro_batch_size_per_gpu}) must be even and divide the {per_worker} "
                     f"sequences (both sides of {per_worker // 2} pairs) each worker gets per step")
    for key in ("max_prompt_length", "max_response_length", "total_steps"):
        p.positive(key, getattr(cfg, key))
    p.optim("optim", cfg.optim)
    p.fsdp("fsdp_config", cfg.fsdp_config, cfg.trainer.device)
    p.tokenizer("model", cfg.model)
    mj = model_json(cfg.model.path)
    max_pos = p.model("model", cfg.model, "by hybridflow rm")
    archs = mj.get("architectures") or []
    if archs and not any(a.endswith(("ForSequenceClassification", "ForCausalLM")) for a in archs):
        p.append(f"model.path: {cfg.model.path!r} ({archs}) is neither a sequence classifier nor a causal LM to start one from")
    if max_pos is not None and cfg.max_prompt_length + cfg.max_response_length > max_pos:
        p.append(f"max_prompt_length + max_response_length exceeds the model's max_position_embeddings ({max_pos})")
    p.data_files("train_files", cfg.train_files, "val_files", cfg.val_files, "preference parquet files")
    p.raise_if_any("reward-model training")
