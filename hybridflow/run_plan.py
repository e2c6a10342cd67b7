"""The run plan: the config resolved ONCE on the driver into one frozen spec per role.

    plan = resolve(cfg, kind)        # after derive_defaults, before any worker starts
    plan.problems()                  # every role's own checks (the config validator collects them)
    ActorRolloutRefWorker(plan.actor, role=...)      CriticWorker(plan.critic)      RolloutWorker(plan.rollout)
    RewardModelWorker(plan.reward_model)             TeacherWorker(plan.teacher)
    make_rollout(spec.name, RolloutContext(spec, ...))

A worker, its engines and its rollout backend read only their spec: the slices of config they need,
with the values derived from other sections computed here (the critic's model and mini-batch when
unset, the generation dtype, the rollout's longest sequence, each role's ranks and layout), never
the root config. How an update walks its rows (`UpdatePlan`, per data-parallel rank) is the
spec's, so the training engine (`TrainEngine.train`) owns the loop and no worker computes "rows
per rank". Each spec checks itself (`problems()`, messages naming the config keys); what spans
roles or the run (the trainer, the pools, the algorithm, data files) stays in
`hybridflow.config.validate`, which asks the plan for the rest (the "role_specs" check).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

from hybridflow.config import pools as rp
from hybridflow.config.schema import (
    LOSS_AGG_MODES,
    ActorConfig,
    AgentConfig,
    CriticConfig,
    DPOConfig,
    FSDPConfig,
    HybridEngineConfig,
    HybridFlowConfig,
    ModelConfig,
    OptimConfig,
    RefConfig,
    RewardTrainConfig,
    RolloutConfig,
)
from hybridflow.config.derive import positive_int
from hybridflow.config.loader import literal_choices
from hybridflow.config.validate import A, KL_TYPES, R, Problems, batch_checks, component_check, model_json, register_check
from hybridflow.parallel.dims import TP_KEY, ParallelDims, _heads_problems, _size_ok, divisors, layout_choices, validate_gen_tp
from hybridflow.protocol import SamplingParams

# Causal-LM checkpoints: config.json "architectures" of a model with a language-modelling head.
LM_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


@dataclass(frozen=True)
class UpdatePlan:
    """micro_rows: rows per forward/backward (or max_tokens: a token budget per micro-batch instead,
    dynamic batch size); mini_rows: rows per optimizer step on this rank (None: the whole call is one
    step); epochs: passes over the call's rows; metric_prefix: where grad_norm / lr are reported."""

    micro_rows: int
    mini_rows: Optional[int] = None
    epochs: int = 1
    max_tokens: Optional[int] = None
    metric_prefix: str = "actor"

    def __post_init__(self):
        for name in ("micro_rows", "epochs") + (("mini_rows",) if self.mini_rows is not None else ()):
            if getattr(self, name) < 1:
                raise ValueError(f"UpdatePlan.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ProcessSpec:
    """What every worker process of a run needs from trainer.*: its device, seed and collective timeout."""

    device: str = "auto"
    seed: int = 1
    collective_timeout_s: float = 600.0

    def uses_cuda(self) -> bool:
        if self.device != "auto":
            return self.device == "cuda"
        try:
            import torch

            return torch.cuda.is_available()
        except ImportError:
            return False


def _mesh(world: int, pp: int = 1, tp: int = 1, procs_per_node: int | None = None, ep: int = 1, sp: int = 1) -> ParallelDims:
    """A role's training layout over its `world` ranks (checked by the role's `problems()` first)."""
    return ParallelDims.for_world(world, pp=pp, tp=tp, procs_per_node=procs_per_node, ep=ep, sp=sp)


@dataclass(frozen=True)
class RolloutSpec:
    """The generation backend's: which one (name), the policy model, the sampling section, the
    generation weights' dtype (and the key that sets it), the longest sequence it must hold
    (prompt + response), how many ranks generate and whether it keeps its buffers between steps."""

    name: str
    model: ModelConfig
    rollout: RolloutConfig  # actor_rollout_ref.rollout
    generation_dtype: str
    dtype_source: str  # the key that sets generation_dtype, as `key=value` (messages)
    max_new_tokens: int  # data.max_response_length
    max_model_len: int  # data.max_prompt_length + data.max_response_length
    process: ProcessSpec
    world: int = 1  # the ranks that generate: the rollout pool (async), else the actor's
    keep_generation_buffers: bool = True  # actor_rollout_ref.hybrid_engine.keep_generation_buffers (derived by the memory plan)
    record_routes: bool = False  # MoE: record each token's experts (actor.router_replay.mode != disabled; models/routing.py)

    def sampling_params(self, greedy: bool = False, seed: int = 0) -> SamplingParams:
        """How one generation call samples: rollout.* (or rollout.val_kwargs when greedy)."""
        r = self.rollout
        s = r.val_kwargs if greedy else r
        return SamplingParams(self.max_new_tokens, s.do_sample, s.temperature, s.top_p, s.top_k, tuple(r.stop), tuple(r.stop_token_ids), seed)

    def problems(self) -> list[str]:
        p, r = Problems(), self.rollout
        p.positive(f"{R}.log_prob_micro_batch_size_per_gpu", r.log_prob_micro_batch_size_per_gpu)
        for key, s in [(R, r), (f"{R}.val_kwargs", r.val_kwargs)]:
            if not s.temperature >= 0:
                p.append(f"{key}.temperature must be >= 0, got {s.temperature}")
            if not 0 < s.top_p <= 1:
                p.append(f"{key}.top_p must be in (0, 1], got {s.top_p}")
        p.extend(component_check("rollout_backend")(r.name, self))  # hybridflow.rollout.base: the registry, and the backend's own checks
        mt = r.multi_turn
        if mt.enable:
            if mt.max_assistant_turns < 1:
                p.append(f"{R}.multi_turn.max_assistant_turns must be >= 1, got {mt.max_assistant_turns}")
            if mt.tool_config_path and not os.path.isfile(mt.tool_config_path):
                p.append(f"{R}.multi_turn.tool_config_path: file not found: {mt.tool_config_path}")
            elif mt.tool_config_path:  # the tools' own options (e.g. the python tool's sandbox limits), before any worker
                p.extend(component_check("tool_config")(mt.tool_config_path))  # hybridflow.agent.tools
        p.enum(f"{R}.multi_turn.format", mt.format, literal_choices(type(mt), "format"))
        a = r.agent
        p.extend(component_check("black_box_agent")(a.function, a.command, mt.enable, a.sandbox, a.sandbox_paths))  # hybridflow.agent.openai_agent
        if a.function or a.command:
            if not a.timeout_s > 0:
                p.append(f"{R}.agent.timeout_s must be > 0 (seconds one trajectory's agent may run), got {a.timeout_s}")
            p.positive(f"{R}.agent.max_request_bytes", a.max_request_bytes)
            p.positive(f"{R}.agent.max_messages", a.max_messages)
            for key in ("max_session_concurrency", "max_session_requests", "max_session_segments"):
                p.positive(f"{R}.agent.{key}", getattr(a, key))
            if not (isinstance(a.max_session_tokens, int) and a.max_session_tokens >= 0):
                p.append(f"{R}.agent.max_session_tokens must be an integer >= 0 (0 = 4 x data.max_response_length), "
                         f"got {a.max_session_tokens!r}")
            if not 0 <= a.port < 65536:
                p.append(f"{R}.agent.port must be in [0, 65535] (0 = a free port), got {a.port}")
        p.token_budget(f"{R}.log_prob_max_token_len_per_gpu", r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu, self.max_model_len)
        mj = model_json(self.model.path)
        heads = mj.get("num_attention_heads") or 0
        p.extend(validate_gen_tp(r.tensor_model_parallel_size, max(self.world, 1), heads, mj.get("num_key_value_heads") or heads))
        return p


MANAGERS_KEY = "actor_rollout_ref.rollout.agent.num_workers"


def manager_count(agent: AgentConfig, multi_turn: bool, async_rollout: bool, gen_tp: int, cpus: int | None = None) -> int:
    """How many rollout managers a run starts: the key's value; None = one per 8 CPUs (at least 1, at
    most 8: a manager is one event loop, and the replicas are the limit long before 8); 0 where they
    do not apply (single-turn, the colocated rollout, or replicas of several processes)."""
    if not (multi_turn and async_rollout and gen_tp == 1):
        return 0
    if agent.num_workers is not None:
        return agent.num_workers
    return max(1, min(8, (cpus or os.cpu_count() or 1) // 8))


def manager_problems(agent: AgentConfig, multi_turn: bool, async_rollout: bool, gen_tp: int) -> list[str]:
    """The key's problems, one line each (before any worker starts)."""
    n = agent.num_workers
    if n is None:
        return []
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
        return [f"{MANAGERS_KEY} must be an integer >= 0 (0 = the agent loops on the driver; null = chosen from the machine), got {n!r}"]
    if n > 0 and not (multi_turn and async_rollout and gen_tp == 1):
        return [f"{MANAGERS_KEY}={n}: rollout managers run multi-turn rollouts on a rollout pool of one-process replicas; they need "
                f"actor_rollout_ref.rollout.multi_turn.enable=true, trainer.async_rollout=true and "
                f"actor_rollout_ref.rollout.tensor_model_parallel_size=1 (or set {MANAGERS_KEY}=0)"]
    return []


@dataclass(frozen=True)
class RefSpec:
    """The frozen reference's: actor_rollout_ref.ref's keys, and its ranks (its own pool, else the actor's)."""

    log_prob_micro_batch_size_per_gpu: int
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int
    fsdp_config: FSDPConfig
    world: int = 1
    use_torch_compile: bool = False  # ref.use_torch_compile, None resolved to the actor's

    @classmethod
    def of(cls, ref: RefConfig, world: int, actor_compile: bool = False) -> "RefSpec":
        compile_ = actor_compile if ref.use_torch_compile is None else ref.use_torch_compile
        return cls(ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu, ref.fsdp_config, world,
                   bool(compile_))

    @cached_property
    def layout(self) -> ParallelDims:
        return _mesh(self.world)  # FSDP over its own pool (colocated: the actor's layout)

    def problems(self, max_model_len: int, device: str) -> list[str]:
        p, key = Problems(), "actor_rollout_ref.ref"
        p.positive(f"{key}.log_prob_micro_batch_size_per_gpu", self.log_prob_micro_batch_size_per_gpu)
        p.token_budget(f"{key}.log_prob_max_token_len_per_gpu", self.log_prob_use_dynamic_bsz, self.log_prob_max_token_len_per_gpu, max_model_len)
        p.fsdp(f"{key}.fsdp_config", self.fsdp_config, device)
        return p


@dataclass(frozen=True)
class ActorSpec:
    """The policy worker's (actor, its colocated rollout and reference): the model, the actor, ref and
    hybrid-engine sections, the rollout's spec, DPO's settings, the PPO update's shape
    (ppo_mini_batch_size prompts x n samples per optimizer step) and its pool's layout."""

    process: ProcessSpec
    model: ModelConfig
    actor: ActorConfig
    ref: RefSpec
    hybrid_engine: HybridEngineConfig
    rollout: RolloutSpec
    dpo: DPOConfig
    samples_per_prompt: Optional[int]  # rollout.n (None outside RL)
    kind: str = "rl"  # "rl" (`hybridflow train`), "dpo" (`hybridflow dpo`)
    prompts_per_step: Optional[int] = None  # data.train_batch_size (pairs with DPO)
    world: int = 1  # the actor's pool
    procs_per_node: Optional[int] = None  # its ranks per node (the hybrid engine's node boundary)
    async_rollout: bool = False  # the rollout generates on a pool of its own (trainer.async_rollout)
    ref_pool: bool = False  # the reference has a pool of its own (resource_pool.mapping.ref)
    save_hf_model: bool = False  # trainer.save_hf_model: the actor writes an HF checkpoint at the end

    @cached_property
    def layout(self) -> ParallelDims:
        """pp x tp x dp over the actor's pool (FSDP over dp; the colocated reference shares it)."""
        a = self.actor
        return _mesh(self.world, a.pipeline_model_parallel_size, a.tensor_model_parallel_size, self.procs_per_node, a.expert_parallel_size,
                     a.ulysses_sequence_parallel_size)

    def update_plan(self, dp: int) -> UpdatePlan:
        """The PPO update over dp data-parallel ranks."""
        a = self.actor
        return UpdatePlan(micro_rows=a.ppo_micro_batch_size_per_gpu, mini_rows=a.ppo_mini_batch_size * self.samples_per_prompt // dp,
                          epochs=a.ppo_epochs, max_tokens=a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None, metric_prefix="actor")

    def dpo_plan(self, world: int) -> UpdatePlan:
        """DPO: actor.ppo_mini_batch_size PAIRS (2 rows each) per optimizer step over the group."""
        return UpdatePlan(micro_rows=self.actor.ppo_micro_batch_size_per_gpu, mini_rows=2 * self.actor.ppo_mini_batch_size // world)

    def sft_plan(self) -> UpdatePlan:
        """SFT on the actor worker: one optimizer step per call."""
        return UpdatePlan(micro_rows=self.actor.ppo_micro_batch_size_per_gpu, metric_prefix="train")

    # ------------------------------------------------------------------ its own checks
    def problems(self) -> list[str]:
        p, a = Problems(), self.actor
        dp = self._layout_problems(p)
        if self.kind == "dpo":
            self._dpo_batch_problems(p)
        else:
            self._ppo_batch_problems(p, dp)
        p.positive(f"{A}.ppo_epochs", a.ppo_epochs)
        for key, v in [(f"{A}.clip_ratio", a.clip_ratio), (f"{A}.clip_ratio_low", a.clip_ratio_low), (f"{A}.clip_ratio_high", a.clip_ratio_high)]:
            if v is not None and not v > 0:
                p.append(f"{key} must be > 0, got {v}")
        if not a.clip_ratio_c > 1:
            p.append(f"{A}.clip_ratio_c must be > 1 (dual-clip bound), got {a.clip_ratio_c}")
        if a.fsdp_config.param_offload and self.process.uses_cuda():
            p.append(f"{A}.fsdp_config.param_offload is not supported with CUDA yet: the weight sync gathers the "
                     f"shards with NCCL on the GPU; set it to false")
        p.enum(f"{A}.loss_agg_mode", a.loss_agg_mode, LOSS_AGG_MODES)
        p.enum(f"{A}.policy_loss.loss_mode", a.policy_loss.loss_mode, component_check("policy_losses")())
        p.enum(f"{A}.kl_loss_type", a.kl_loss_type, KL_TYPES)
        p.optim(f"{A}.optim", a.optim)
        if a.freeze_modules:
            p.extend(component_check("freeze_modules")(self.model.path, a.freeze_modules))  # hybridflow.planning.arch
        p.token_budget(f"{A}.ppo_max_token_len_per_gpu", a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu, self.rollout.max_model_len)
        p.extend(self.ref.problems(self.rollout.max_model_len, self.process.device))
        he = self.hybrid_engine
        # The run config's key, the parallel config's key and the RLTrainer / PPOTrainer keyword all land here.
        bp = he.resharding_buffer_percent
        if bp is not None and not (isinstance(bp, (int, float)) and not isinstance(bp, bool) and 0 < bp <= 1):
            p.append(f"actor_rollout_ref.hybrid_engine.resharding_buffer_percent must be a fraction in (0, 1] (the layer-wise switch's "
                     f"staging budget as a fraction of the generation weights' memory; null = two layers in flight), got {bp!r}")
        p.enum("actor_rollout_ref.hybrid_engine.granularity", he.granularity, ["layer", "full"])
        if he.delta_sync and not self.async_rollout and (he.granularity != "layer" or not he.enable_resharding_opt):
            p.append("actor_rollout_ref.hybrid_engine.delta_sync=true needs the layer-wise optimized switch for the colocated "
                     "rollout (granularity=layer, enable_resharding_opt=true), or the cross-pool sync (trainer.async_rollout=true)")
        if he.delta_full_every < 0:
            p.append(f"actor_rollout_ref.hybrid_engine.delta_full_every must be >= 0 (0: only the first sync is full), got {he.delta_full_every}")
        p.fsdp(f"{A}.fsdp_config", a.fsdp_config, self.process.device)
        if (a.use_torch_compile or self.ref.use_torch_compile) and (a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                                                                     a.ulysses_sequence_parallel_size, a.expert_parallel_size) != (1, 1, 1, 1):
            key = f"{A}.use_torch_compile" if a.use_torch_compile else "actor_rollout_ref.ref.use_torch_compile"
            p.append(f"{key}=true compiles decoder layers under plain FSDP only (engine/compile.py); this layout has "
                     f"tp={a.tensor_model_parallel_size}, pp={a.pipeline_model_parallel_size}, sp={a.ulysses_sequence_parallel_size}, "
                     f"ep={a.expert_parallel_size}: set it to false")
        if a.use_torch_compile and self.rollout.rollout.exact:
            p.append(f"{A}.use_torch_compile=true with {R}.exact=true: the exact mode needs the trainer's log-probs bitwise the "
                     f"sampler's, and compiled layers fuse differently; set one of them to false")
        self._model_problems(p)
        if self.rollout.rollout.exact:
            p.extend(self.exact_refused())
        agent = self.rollout.rollout.agent
        r = self.rollout.rollout
        p.extend(manager_problems(agent, r.multi_turn.enable, self.async_rollout, r.tensor_model_parallel_size))
        managers = manager_count(agent, r.multi_turn.enable, self.async_rollout, r.tensor_model_parallel_size)
        if self.async_rollout and (agent.function or agent.command) and agent.port and not managers:
            p.append(f"{R}.agent.port={agent.port} with trainer.async_rollout=true: each batch in flight (up to "
                     f"async_training.max_staleness + 1) and validation serve an endpoint of their own, and only one "
                     f"can bind a fixed port; set {R}.agent.port=0 (a free port each), or run the agents on rollout managers "
                     f"({R}.agent.num_workers >= 1 with {R}.tensor_model_parallel_size=1: manager i listens on port + i)")
        return p

    def exact_refused(self) -> list[str]:
        """actor_rollout_ref.rollout.exact=true holds for: the hf backend at gen_tp 1 (with an actor without TP)
        or gen_tp = the actor's workers (colocated: it samples with the training engine), single-turn
        rollouts, one pipeline stage, padded (not packed) sequences. Each miss is one line naming its key."""
        r, key = self.rollout.rollout, f"{R}.exact=true"
        reasons = [(r.name != "hf", f"{key} needs {R}.name=hf: vLLM's kernels are not the trainer's (its mismatch per layer: "
                                    f"`hybridflow mismatch`); got {r.name!r}"),
                   (r.tensor_model_parallel_size not in (1, self.world), f"{key} needs {R}.tensor_model_parallel_size=1 or the actor's "
                                                                         f"{self.world} workers (one replica: it samples with the training "
                                                                         f"engine's own module), got {r.tensor_model_parallel_size}"),
                   (self.async_rollout and r.tensor_model_parallel_size > 1, f"{key} with trainer.async_rollout needs "
                                                                            f"{R}.tensor_model_parallel_size=1 (the rollout pool holds no "
                                                                            f"training engine to sample with)"),
                   (r.tensor_model_parallel_size == 1 and self.actor.tensor_model_parallel_size > 1,
                    f"{key} at {R}.tensor_model_parallel_size=1 needs {A}.tensor_model_parallel_size=1 (the trainer's TP splits its sums; "
                    f"or set {R}.tensor_model_parallel_size={self.world} to sample with the training engine itself)"),
                   (r.multi_turn.enable, f"{key} is for single-turn rollouts: set {R}.multi_turn.enable=false"),
                   (self.actor.pipeline_model_parallel_size > 1, f"{key} needs {A}.pipeline_model_parallel_size=1"),
                   (self.model.use_remove_padding, f"{key} runs each sequence alone: set actor_rollout_ref.model.use_remove_padding=false")]
        return [why for bad, why in reasons if bad]

    def lora_refused(self) -> str | None:
        """Why the policy cannot train LoRA adapters in this run (None: it can). Wired: FSDP2 (x TP) training,
        the colocated hf or vllm rollout with the adapters synced alone, the reference as the adapter-free actor."""
        a, gen_tp = self.actor, self.rollout.rollout.tensor_model_parallel_size
        reasons = [(self.kind == "dpo", "by hybridflow dpo"),
                   (a.pipeline_model_parallel_size > 1, f"with pipeline parallelism ({A}.pipeline_model_parallel_size must be 1)"),
                   ((a.tensor_model_parallel_size > 1 or gen_tp > 1) and self.model.lora_dropout > 0,
                    "with dropout under tensor parallelism (TP ranks would draw different masks: set actor_rollout_ref.model.lora_dropout=0)"),
                   (self.async_rollout, "with trainer.async_rollout (the rollout pool's sync is full-model)"),
                   (bool(a.freeze_modules), f"together with {A}.freeze_modules (LoRA freezes the whole base already)"),
                   (self.ref_pool, "with a reference pool (resource_pool.mapping.ref): the reference is the "
                                   "actor with its adapters off, so remove the mapping")]
        return next((why for bad, why in reasons if bad), None)

    def _layout_problems(self, p: Problems) -> int:
        """The actor's 3D training layout (pp x tp x dp) against its workers, the model and the
        generation TP; returns dp (the data-parallel ranks the batch is split over)."""
        a, roll, n_workers = self.actor, self.rollout.rollout, self.world
        tp_key, pp_key = f"{A}.tensor_model_parallel_size", f"{A}.pipeline_model_parallel_size"
        tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
        if not (p.positive(tp_key, tp) & p.positive(pp_key, pp)) or n_workers < 1:
            return n_workers
        if p.positive(f"{A}.expert_parallel_size", a.expert_parallel_size) and a.expert_parallel_size > 1:
            p.extend(expert_parallel_problems(self))
        sp = a.ulysses_sequence_parallel_size
        if p.positive(f"{A}.ulysses_sequence_parallel_size", sp) and sp > 1:
            problems = sequence_parallel_problems(self)
            p.extend(problems)
            if not problems:
                return n_workers // sp  # the sp workers of a group share their rows
        if tp == pp == 1:
            return n_workers
        problems, dp = actor_layout_problems(self)
        p.extend(problems)
        if dp is None:
            return n_workers
        if a.fsdp_config.sharding_strategy == "NO_SHARD" or self.ref.fsdp_config.sharding_strategy == "NO_SHARD":
            p.append(f"fsdp_config.sharding_strategy=NO_SHARD is not supported with {tp_key} or {pp_key} > 1: use FULL_SHARD or SHARD_GRAD_OP")
        unsupported = [(roll.name == "vllm", f"{R}.name=vllm (the vLLM weight sync reads the FSDP layout; use the hf backend)"),
                       (self.async_rollout, "trainer.async_rollout (the rollout pool receives FSDP shards)"),
                       (self.kind == "dpo", "DPO (hybridflow dpo trains with FSDP)")]
        if pp > 1:
            unsupported += [(self.save_hf_model, "trainer.save_hf_model (each stage holds part of the model; write the HF "
                                                 "checkpoint from a saved checkpoint with `hybridflow export CHECKPOINT_DIR OUT_DIR`)"),
                            (a.use_dynamic_bsz or roll.log_prob_use_dynamic_bsz or self.ref.log_prob_use_dynamic_bsz,
                             "dynamic batch sizes (use_dynamic_bsz / log_prob_use_dynamic_bsz: pipeline micro-batches have one shape)"),
                            (self.model.use_remove_padding, "actor_rollout_ref.model.use_remove_padding (pipeline stages run padded micro-batches)")]
        for bad, what in unsupported:
            if bad:
                p.append(f"{tp_key}={tp}, {pp_key}={pp}: not supported with {what}")
        return dp

    def _ppo_batch_problems(self, p: Problems, dp: int) -> None:
        """The generation batch over the actor's workers, and the PPO mini/micro-batches over dp."""
        a, bs, n, n_workers = self.actor, self.prompts_per_step, self.samples_per_prompt, self.world
        if not (positive_int(bs) and positive_int(n) and n_workers >= 1):
            return  # reported by the validator (data.train_batch_size, rollout.n) or the pools check
        if (bs * n) % n_workers:
            p.append(f"data.train_batch_size * {R}.n ({bs}*{n}) must be divisible by "
                     f"n_workers = trainer.nnodes * trainer.n_gpus_per_node = {n_workers}; set "
                     f"data.train_batch_size to a multiple of {n_workers}")
        batch_checks(p, A, a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, bs, n, dp,
                     "workers" if dp == n_workers else "data-parallel groups (workers / (pp x tp))")

    def _dpo_batch_problems(self, p: Problems) -> None:
        """DPO: pairs per step / per optimizer step / per forward over the actor's workers."""
        a, bs, n_workers = self.actor, self.prompts_per_step, self.world
        if not (isinstance(bs, int) and bs > 0 and n_workers >= 1):
            return
        if bs % n_workers:
            p.append(f"data.train_batch_size ({bs} pairs) must be divisible by the {n_workers} workers, so that "
                     f"every worker holds whole pairs; set it to a multiple of {n_workers}")
        if isinstance(a.ppo_mini_batch_size, int) and a.ppo_mini_batch_size > 0 and a.ppo_mini_batch_size % n_workers:
            p.append(f"{A}.ppo_mini_batch_size ({a.ppo_mini_batch_size} pairs per optimizer step) must be divisible by the {n_workers} workers")
        if isinstance(a.ppo_micro_batch_size_per_gpu, int) and a.ppo_micro_batch_size_per_gpu % 2:
            p.append(f"{A}.ppo_micro_batch_size_per_gpu ({a.ppo_micro_batch_size_per_gpu}) must be even with DPO: "
                     f"a forward holds both sides of its pairs")
        batch_checks(p, A, a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, bs, 2, n_workers)

    def _model_problems(self, p: Problems) -> None:
        """The policy checkpoint: a causal LM whose positions hold prompt + response, LoRA where wired."""
        m, key = self.model, "actor_rollout_ref.model"
        max_pos = p.model(key, m, lora_refused=self.lora_refused())
        mj = model_json(m.path)
        archs = mj.get("architectures")
        archs = [str(x) for x in archs] if isinstance(archs, list) else []
        if archs and not any(x.endswith(LM_HEADS) for x in archs):
            p.append(f"{key}.path: {m.path!r} is a {', '.join(archs)} checkpoint, not a causal LM; the "
                     f"policy needs a causal-LM checkpoint (architectures ...ForCausalLM) to generate and train; a reward model "
                     f"belongs in reward_model.model.path")
        response = self.rollout.max_new_tokens
        prompt = self.rollout.max_model_len - response
        if max_pos is not None and self.rollout.max_model_len > max_pos:
            p.append(f"data.max_prompt_length + data.max_response_length ({prompt}+"
                     f"{response}) exceeds the model's max_position_embeddings ({max_pos}); lower them")


@dataclass(frozen=True)
class CriticSpec:
    """The critic's: its section, its model (the actor's when critic.model.path is unset), its
    mini-batch in prompts (the actor's when unset), its pool's ranks, and whether it runs (GAE)."""

    process: ProcessSpec
    model: ModelConfig
    critic: CriticConfig
    mini_batch_prompts: Optional[int]
    samples_per_prompt: Optional[int]
    prompts_per_step: Optional[int] = None  # data.train_batch_size
    world: int = 1  # the critic's pool
    active: bool = False  # the run trains a critic (algorithm.adv_estimator=gae)

    @cached_property
    def layout(self) -> ParallelDims:
        """critic.tensor_model_parallel_size x FSDP over the critic's pool."""
        return _mesh(self.world, tp=self.critic.tensor_model_parallel_size)

    def update_plan(self, dp: int) -> UpdatePlan:
        c = self.critic
        return UpdatePlan(micro_rows=c.ppo_micro_batch_size_per_gpu, mini_rows=self.mini_batch_prompts * self.samples_per_prompt // dp,
                          epochs=c.ppo_epochs, metric_prefix="critic")

    def problems(self) -> list[str]:
        p, c = Problems(), self.critic
        bs, n, n_workers = self.prompts_per_step, self.samples_per_prompt, self.world
        if self.active and positive_int(bs) and positive_int(n) and n_workers >= 1:
            dp = self._tp_problems(p)
            batch_checks(p, "critic", self.mini_batch_prompts, c.ppo_micro_batch_size_per_gpu, bs, n, dp,
                         "workers" if dp == n_workers else "critic data-parallel groups (workers / tp)")
        p.positive("critic.ppo_epochs", c.ppo_epochs)
        if c.cliprange_value is not None and not c.cliprange_value > 0:
            p.append(f"critic.cliprange_value must be > 0, got {c.cliprange_value}")
        p.enum("critic.loss_agg_mode", c.loss_agg_mode, LOSS_AGG_MODES)
        p.optim("critic.optim", c.optim)
        p.fsdp("critic.fsdp_config", c.fsdp_config, self.process.device)
        lora_refused = ("with dropout under tensor parallelism (TP ranks would draw different masks: set critic.model.lora_dropout=0)"
                        if c.tensor_model_parallel_size > 1 and c.model.lora_dropout > 0 else None)
        if c.model.path:
            p.model("critic.model", c.model, lora_refused)
        else:
            p.lora("critic.model", c.model, lora_refused)
        return p

    def _tp_problems(self, p: Problems) -> int:
        """critic.tensor_model_parallel_size against the critic's workers and its model's heads; returns its dp."""
        tp, key, n_workers = self.critic.tensor_model_parallel_size, "critic.tensor_model_parallel_size", self.world
        if not p.positive(key, tp) or tp == 1 or n_workers < 1:
            return n_workers
        problems, dp = critic_layout_problems(self)
        p.extend(problems)
        return n_workers if dp is None else dp


@dataclass(frozen=True)
class RewardModelSpec:
    """The reward model's: a one-label sequence classifier, its micro-batch and pool; in RL the policy's
    tokenizer (responses are decoded with it), for `hybridflow rm` the optimizer and the margin."""

    process: ProcessSpec
    model: ModelConfig
    fsdp: FSDPConfig
    micro_batch_size: int
    policy_tokenizer: Optional[str] = None  # RL: the policy's tokenizer path
    score_weight: float = 1.0
    rule_weight: float = 0.0
    world: int = 1
    optim: Optional[OptimConfig] = None  # set: it trains (`hybridflow rm`)
    grad_clip: float = 1.0
    margin: float = 0.0

    @classmethod
    def for_training(cls, cfg: RewardTrainConfig) -> "RewardModelSpec":
        """`hybridflow rm`: the model it starts from, trained with Bradley-Terry over the run's workers."""
        t = cfg.trainer
        return cls(ProcessSpec(t.device, t.seed, t.collective_timeout_s), cfg.model, cfg.fsdp_config, cfg.micro_batch_size_per_gpu,
                   world=t.nnodes * t.n_gpus_per_node, optim=cfg.optim, grad_clip=cfg.grad_clip, margin=cfg.margin)

    @cached_property
    def layout(self) -> ParallelDims:
        return _mesh(self.world)  # FSDP over its pool

    def problems(self) -> list[str]:
        """The reward model must be a one-label sequence classifier (checked from its config.json)."""
        p, m = Problems(), self.model
        p.positive("reward_model.micro_batch_size_per_gpu", self.micro_batch_size)
        if self.score_weight == 0 and self.rule_weight == 0:
            p.append("reward_model.score_weight and reward_model.rule_weight are both 0: every reward would be 0; set one of them")
        p.fsdp("reward_model.fsdp_config", self.fsdp, self.process.device)
        if p.model("reward_model.model", m, "for the reward model") is None and not os.path.isfile(os.path.join(m.path, "config.json")):
            return p
        p.tokenizer("reward_model.model", m)
        mj = model_json(m.path)
        archs = mj.get("architectures") or []
        if not any(x.endswith("ForSequenceClassification") for x in archs):
            p.append(f"reward_model.model.path: {m.path!r} is not a sequence classifier (architectures {archs}); "
                     f"train one with `hybridflow rm` or build a tiny one with `hybridflow make-model --reward PATH`")
        elif len(mj.get("id2label") or {0: ""}) != 1:
            p.append(f"reward_model.model.path: {m.path!r} has {len(mj['id2label'])} labels; a reward model has one (num_labels=1)")
        return p


@dataclass(frozen=True)
class TeacherSpec:
    """On-policy distillation's teacher: a frozen causal LM with the student's vocabulary, its
    micro-batch and pool."""

    process: ProcessSpec
    model: ModelConfig
    fsdp: FSDPConfig
    micro_batch_size: int
    student_model: ModelConfig  # the policy's: the teacher scores its token ids as they are
    remove_padding: bool = False
    world: int = 1

    @cached_property
    def layout(self) -> ParallelDims:
        return _mesh(self.world)  # FSDP over its pool

    def problems(self) -> list[str]:
        p = Problems()
        p.positive("teacher.log_prob_micro_batch_size_per_gpu", self.micro_batch_size)
        if p.model("teacher.model", self.model, "for the teacher") is None:
            return p
        teacher, student = model_json(self.model.path), model_json(self.student_model.path)
        if not any(str(x).endswith(LM_HEADS) for x in teacher.get("architectures") or []):
            p.append(f"teacher.model.path: {self.model.path!r} is not a causal LM (architectures {teacher.get('architectures')})")
        if student and teacher.get("vocab_size") != student.get("vocab_size"):
            p.append(f"teacher.model.path: the teacher's vocab_size ({teacher.get('vocab_size')}) differs from the student's "
                     f"({student.get('vocab_size')}); on-policy distillation scores the student's token ids, so both need one tokenizer")
        return p


@dataclass(frozen=True)
class RunPlan:
    actor: ActorSpec
    critic: CriticSpec
    rollout: RolloutSpec
    reward_model: Optional[RewardModelSpec] = None  # None: the run scores without one
    teacher: Optional[TeacherSpec] = None  # None: no distillation teacher

    def problems(self) -> list[str]:
        """Every role's own checks, in one list (the validator adds the run's)."""
        out = self.actor.problems() + self.rollout.problems() + self.critic.problems()
        for spec in (self.reward_model, self.teacher):
            if spec is not None:
                out += spec.problems()
        return out


def resolve(cfg: HybridFlowConfig, kind: str = "rl") -> RunPlan:
    """Every role's spec from the (derived) config: outside config/, the only reader of the role
    sections. kind: "rl" (`hybridflow train`) or "dpo" (`hybridflow dpo`): which roles run, on which pools."""
    arr, t, d = cfg.actor_rollout_ref, cfg.trainer, cfg.data
    roles = rp.run_roles(cfg, kind)
    pools, placed = rp.pool_specs(cfg), rp.role_pools(cfg, roles)

    def world(role: rp.Role) -> int:
        return rp.role_world_size(cfg, role, roles)

    process = ProcessSpec(t.device, t.seed, t.collective_timeout_s)
    mp = arr.actor.fsdp_config.mixed_precision
    dtype_source = f"{A}.fsdp_config.mixed_precision={mp}" if mp else f"actor_rollout_ref.model.dtype={arr.model.dtype}"
    gen_role = rp.Role.ROLLOUT if t.async_rollout else rp.Role.ACTOR_ROLLOUT
    # A generation-only pool keeps its weights (nothing else needs the memory); colocated, the memory plan decides.
    keep = True if t.async_rollout or arr.hybrid_engine.keep_generation_buffers is None else arr.hybrid_engine.keep_generation_buffers
    rollout = RolloutSpec(arr.rollout.name, arr.model, arr.rollout, arr.generation_dtype(), dtype_source, d.max_response_length,
                          d.max_prompt_length + d.max_response_length, process, world(gen_role), keep,
                          arr.actor.router_replay.mode != "disabled")
    actor_pool = pools.get(placed.get(rp.Role.ACTOR_ROLLOUT, rp.DEFAULT_POOL))
    ref = RefSpec.of(arr.ref, world(rp.Role.REF) if rp.Role.REF in roles else world(rp.Role.ACTOR_ROLLOUT), arr.actor.use_torch_compile)
    actor = ActorSpec(process, arr.model, arr.actor, ref, arr.hybrid_engine, rollout, cfg.dpo, arr.rollout.n, kind, d.train_batch_size,
                      world(rp.Role.ACTOR_ROLLOUT), actor_pool.workers_per_node if actor_pool else None, t.async_rollout,
                      "ref" in cfg.resource_pool.mapping, t.save_hf_model)
    c = cfg.critic
    critic_mini = arr.actor.ppo_mini_batch_size if c.ppo_mini_batch_size is None else c.ppo_mini_batch_size
    critic = CriticSpec(process, c.model if c.model.path else arr.model, c, critic_mini, arr.rollout.n, d.train_batch_size,
                        world(rp.Role.CRITIC), rp.Role.CRITIC in roles)
    rm = cfg.reward_model
    reward_model = (RewardModelSpec(process, rm.model, rm.fsdp_config, rm.micro_batch_size_per_gpu, arr.model.tokenizer_source(),
                                    rm.score_weight, rm.rule_weight, world(rp.Role.REWARD_MODEL))
                    if rm.enable and (kind == "rl" or cfg.dpo.online) else None)
    tc = cfg.teacher
    teacher = (TeacherSpec(process, tc.model, tc.fsdp_config, tc.log_prob_micro_batch_size_per_gpu, arr.model, arr.model.use_remove_padding,
                           world(rp.Role.TEACHER)) if tc.enable and kind == "rl" else None)
    return RunPlan(actor, critic, rollout, reward_model, teacher)


# ---------------------------------------------------------------- the config validator's checks
# Registered with hybridflow.config.validate (which names this module in CHECK_MODULES): every
# role's spec checks itself; the layouts with the same rules as ParallelDims (parallel/dims.py),
# with messages that name the config keys and say what to set.


@register_check("role_specs")
def role_spec_problems(cfg: HybridFlowConfig, kind: str) -> list[str]:
    return resolve(cfg, kind).problems()


def actor_layout_problems(spec: ActorSpec) -> tuple[list[str], int | None]:
    """The actor's pp x tp x dp (tp, pp >= 1 and not both 1) against its pool's workers, the model
    (heads, layers, tied embeddings) and the generation TP: (problems, dp or None when pp x tp does
    not divide the workers)."""
    tp, pp, n_workers = spec.actor.tensor_model_parallel_size, spec.actor.pipeline_model_parallel_size, spec.world
    gen_tp = spec.rollout.rollout.tensor_model_parallel_size
    tp_key, pp_key = f"{A}.tensor_model_parallel_size", f"{A}.pipeline_model_parallel_size"
    if n_workers % (tp * pp):
        return [f"pp x tp x dp must equal the actor's {n_workers} workers (trainer.nnodes * trainer.n_gpus_per_node): "
                f"{pp_key} ({pp}) x {tp_key} ({tp}) = {pp * tp} does not divide {n_workers}; use (pp, tp) such as "
                f"{layout_choices(n_workers)[:4]}"], None
    dims = ParallelDims.for_world(n_workers, pp=pp, tp=tp)
    mj = model_json(spec.model.path)
    heads = mj.get("num_attention_heads") or 0
    layers = mj.get("num_hidden_layers") or 0
    out = _heads_problems(tp_key, tp, heads, mj.get("num_key_value_heads") or heads)
    if layers and layers % pp:
        out.append(f"{pp_key} ({pp}) must divide the model's num_hidden_layers ({layers}): stages hold equal blocks of "
                   f"decoder layers; set it to one of {divisors(layers)}")
    if pp > 1 and mj.get("tie_word_embeddings"):
        out.append(f"{pp_key} ({pp}) > 1 needs untied embeddings: the model ties lm_head to embed_tokens, which live on "
                   f"the first and the last stage; use {pp_key}=1 or a model with tie_word_embeddings=false")
    if _size_ok(gen_tp) and not dims.fits_gen_tp(gen_tp):
        out.append(dims.gen_tp_problem(gen_tp, TP_KEY))
    return out, dims.dp


def sequence_parallel_problems(spec: ActorSpec) -> list[str]:
    """actor.ulysses_sequence_parallel_size (> 1) against the workers, the model's heads and what Ulysses is wired with."""
    a, key, n_workers = spec.actor, f"{A}.ulysses_sequence_parallel_size", spec.world
    sp, mj = a.ulysses_sequence_parallel_size, model_json(spec.model.path)
    heads = mj.get("num_attention_heads") or 0
    archs = [str(x) for x in mj.get("architectures") or []]
    reasons = [(n_workers % sp, f"must divide the actor's {n_workers} workers (trainer.nnodes * trainer.n_gpus_per_node; sp groups are sp "
                                f"consecutive workers); set it to one of {divisors(n_workers)}"),
               *[(n and n % sp, f"must divide the model's {what} ({n}): after the all-to-all each rank attends with whole heads; "
                                f"set it to one of {divisors(n)}") for what, n in (("num_attention_heads", heads),
                                                                                  ("num_key_value_heads", mj.get("num_key_value_heads") or heads))],
               (a.tensor_model_parallel_size > 1 or a.pipeline_model_parallel_size > 1,
                f"needs {A}.tensor_model_parallel_size=1 and {A}.pipeline_model_parallel_size=1 (Ulysses is built on the FSDP layout)"),
               (a.expert_parallel_size > 1, f"is not combined with {A}.expert_parallel_size yet"),
               (spec.rollout.rollout.exact, f"is not combined with {R}.exact (its log-probs run one sequence at a time)"),
               (a.router_replay.mode != "disabled", f"is not combined with {A}.router_replay (the recorded experts are per padded row)"),
               (any(x.endswith("ForConditionalGeneration") for x in archs), "is not wired for vision-language models (M-RoPE position ids)"),
               (spec.kind == "dpo", "is not wired into hybridflow dpo")]
    return [f"{key}={sp} {why}" for bad, why in reasons if bad]


def expert_parallel_problems(spec: ActorSpec) -> list[str]:
    """actor.expert_parallel_size (> 1) against the model (MoE, its experts), the workers and what EP is wired with."""
    a, key, n_workers = spec.actor, f"{A}.expert_parallel_size", spec.world
    from hybridflow.models.moe import moe_shape

    ep, mj = a.expert_parallel_size, model_json(spec.model.path)
    shape = moe_shape(mj)
    experts = shape[0] if shape else None
    if mj and shape is None:
        return [f"{key}={ep} needs a mixture-of-experts model; {spec.model.path!r} is dense: set it to 1"]
    reasons = [(bool(experts) and experts % ep, f"must divide the model's {experts} experts (each EP rank holds experts / ep whole); "
                                                f"set it to one of {divisors(experts or 1)}"),
               (n_workers % ep, f"must divide the actor's {n_workers} workers (EP groups are ep consecutive workers); set it to one of {divisors(n_workers)}"),
               (a.tensor_model_parallel_size > 1 or a.pipeline_model_parallel_size > 1,
                f"needs {A}.tensor_model_parallel_size=1 and {A}.pipeline_model_parallel_size=1 (EP is built on the FSDP layout)"),
               ("NO_SHARD" in (a.fsdp_config.sharding_strategy, spec.ref.fsdp_config.sharding_strategy),
                "needs fsdp_config.sharding_strategy FULL_SHARD or SHARD_GRAD_OP"),
               (spec.kind == "dpo", "is not wired into hybridflow dpo"),
               (spec.async_rollout, "is not supported with trainer.async_rollout (the rollout pool receives FSDP shards)"),
               (spec.rollout.rollout.exact, f"is not combined with {R}.exact (its log-probs run one sequence at a time)"),
               (a.use_dynamic_bsz or spec.rollout.rollout.log_prob_use_dynamic_bsz or spec.ref.log_prob_use_dynamic_bsz,
                "needs fixed micro-batches (use_dynamic_bsz / log_prob_use_dynamic_bsz false): every MoE layer's all-to-all needs "
                "each rank of an EP group to run the same number of forwards")]
    return [f"{key}={ep} {why}" for bad, why in reasons if bad]


def critic_layout_problems(spec: CriticSpec) -> tuple[list[str], int | None]:
    """critic.tensor_model_parallel_size (> 1) x dp against the critic's workers and its model's heads."""
    tp, key, n_workers = spec.critic.tensor_model_parallel_size, "critic.tensor_model_parallel_size", spec.world
    if n_workers % tp:
        return [f"{key} ({tp}) must divide the critic's {n_workers} workers; set it to one of {divisors(n_workers)}"], None
    mj = model_json(spec.model.path)
    heads = mj.get("num_attention_heads") or 0
    return _heads_problems(key, tp, heads, mj.get("num_key_value_heads") or heads, whose="the critic model's"), ParallelDims.for_world(n_workers, tp=tp).dp
