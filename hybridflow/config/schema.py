"""Typed configuration, one dataclass per component, with verl's key names.

The tree mirrors verl's ``ppo_trainer.yaml`` so that a verl user's dotlist overrides work here:
``actor_rollout_ref.rollout.n=8``, ``data.train_batch_size=16``, ``algorithm.adv_estimator=grpo``.

Batch-size semantics (a classic source of confusion, stated plainly):
- ``data.train_batch_size``: number of PROMPTS per RL step, global (all workers together).
- ``actor_rollout_ref.rollout.n``: samples per prompt, so a step trains on train_batch_size * n
  sequences.
- ``actor_rollout_ref.actor.ppo_mini_batch_size``: PROMPTS per optimizer step, global; it is
  multiplied by ``rollout.n`` internally (as in verl).
- ``*_micro_batch_size_per_gpu``: SEQUENCES per forward/backward on ONE worker (gradient
  accumulation happens across micro-batches).

Sizes that the layout constrains (mini- and micro-batches) default to None = not set: the run derives
them from the layout (``config/derive.py``, logged once), so a default never fails validation; only a
value the user set can be refused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Literal, Optional, Union


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    train_batch_size: int = 8  # prompts per step, global
    val_batch_size: Optional[int] = None  # None = the whole validation set in one batch
    max_prompt_length: int = 64  # tokens, after the chat template
    max_response_length: int = 16  # tokens generated at most
    # What to do with a prompt longer than max_prompt_length:
    # filter_overlong_prompts=True drops it (and counts it); otherwise `truncation` applies:
    # "error" fails naming file and row, "left" keeps the last tokens, "right" keeps the first.
    filter_overlong_prompts: bool = True
    truncation: str = "error"
    # Prompt width of a batch: left-padded to max_prompt_length, or only to the batch's longest
    # prompt ("longest": fewer padded positions in generation and every forward; same results).
    prompt_padding: Literal["max_length", "longest"] = "max_length"
    shuffle: bool = True
    seed: int = 1
    # Preference parquet (`hybridflow dpo` / `hybridflow rm`): the chosen and rejected columns.
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"


# Accepted spellings of a model's dtype (models/hf.py maps them to torch dtypes).
MODEL_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
# How a per-token loss [B, T] becomes a scalar (algorithms/losses.py agg_loss); verl's names.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Upper bounds of the sizes a run derives when they are not set (config/derive.py): the largest
# divisor of what one worker gets, up to these (the fixed defaults these fields had before).
MINI_BATCH_CAP = 8  # actor.ppo_mini_batch_size: prompts per optimizer step
MICRO_BATCH_CAP = 8  # actor / critic ppo_micro_batch_size_per_gpu: sequences per forward/backward
SFT_MICRO_BATCH_CAP = 32  # SFTConfig / RewardTrainConfig micro_batch_size_per_gpu
# Advantage estimators whose baseline is the other samples of the prompt (they need rollout.n >= 2), and
# the rollout.n a run derives for them when it is not set (TRL's default num_generations).
GROUP_ESTIMATORS = ("grpo", "rloo")
GROUP_N = 8
# LoRA targets: peft's "all-linear" (every linear layer but the output head), or the decoder's projections.
LORA_TARGETS = ("all-linear", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ModelConfig:
    path: str = ""  # a local HF checkpoint directory
    tokenizer_path: Optional[str] = None  # defaults to `path`
    dtype: str = "float32"  # float32 on CPU (bf16 matmuls are slower there)
    enable_gradient_checkpointing: bool = False
    # Forwards without padding: a micro-batch's valid tokens packed into one row with per-sequence
    # position ids (transformers masks across the packed sequences); same log-probs, less work.
    use_remove_padding: bool = False
    # Token log-probs and entropy from the last hidden states through the LM head in chunks of
    # fused_kernel_chunk_size tokens (engine/fused_logprobs.py): at most [chunk, vocab] logits at once
    # instead of [tokens, vocab], the same numbers within rounding; false = the plain logits pass.
    use_fused_kernels: bool = True
    fused_kernel_chunk_size: int = 1024
    # LoRA (models/lora.py): adapters of rank lora_rank on target_modules, the base frozen; 0 = full fine-tuning.
    lora_rank: int = 0
    lora_alpha: float = 16.0  # the adapter's output is scaled by lora_alpha / lora_rank
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])  # "all-linear", or module names (q_proj, ...)
    lora_dropout: float = 0.0
    # Mixture-of-experts models (models/moe.py): weight of the router's load-balancing loss added to the
    # actor's (and SFT's) loss; 0 = off: an HF model adds its config's own coefficient only when a forward
    # is given labels, which log-prob passes never are, so off is what training through HF forwards does.
    router_aux_loss_coef: float = 0.0
    # verl's key. A vision-language model's vision tower (`model.visual.*`) kept frozen in the actor: no gradient or
    # optimizer state, and the weight switch moves it once (as actor.freeze_modules does); a text model has none.
    freeze_vision_tower: bool = False

    def logprob_chunk(self) -> int | None:
        """Tokens per chunk of the chunked log-prob pass, None = the plain logits pass."""
        return self.fused_kernel_chunk_size if self.use_fused_kernels else None

    def tokenizer_source(self) -> str:
        """Where the tokenizer loads from: tokenizer_path, else the model's own directory."""
        return self.tokenizer_path or self.path


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = -1  # < 0: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler_type: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr
    total_training_steps: int = -1  # filled in by the trainer when < 0


@dataclass
class FSDPConfig:
    param_offload: bool = False
    reshard_after_forward: bool = True  # FULL_SHARD; False = SHARD_GRAD_OP
    # PyTorch's meaning: FULL_SHARD (params, grads, optimizer state sharded; params re-gathered
    # per forward/backward), SHARD_GRAD_OP (params kept gathered between forward and backward),
    # NO_SHARD (replicated, gradients all-reduced). None = from reshard_after_forward.
    sharding_strategy: Optional[str] = None
    # None / false = off (the parameters' fp32); "bf16" / "fp16": compute (param) dtype, fp32 reduce;
    # true / "amp": the device's preferred low precision (bf16 where it computes it, else fp16 on CUDA),
    # resolved for trainer.device before validation (config/derive.py) and logged once.
    mixed_precision: Union[bool, str, None] = None


@dataclass
class PolicyLossConfig:
    # verl's key: the registered policy loss (`algorithms/losses.py` POLICY_LOSSES) the actor's
    # update calls; "vanilla" = PPO's clipped surrogate with clip-higher and dual clip.
    loss_mode: str = "vanilla"


@dataclass
class RouterReplayConfig:
    # verl's key. R3: the rollout records each token's experts (batch key routed_experts) and the actor's
    # log-prob and update forwards use them instead of their own top-k (models/routing.py); MoE + hf rollout only.
    mode: Literal["disabled", "R3"] = "disabled"


@dataclass
class ActorConfig:
    # Training is FSDP2 (verl's `strategy: fsdp | fsdp2` is accepted as a verl key: config/verl_compat.py).
    # prompts per optimizer step, global (x rollout.n inside). None = derived: the largest divisor of
    # data.train_batch_size up to MINI_BATCH_CAP (8) whose sequences split evenly over the data-parallel ranks.
    ppo_mini_batch_size: Optional[int] = None
    # sequences per forward/backward per worker. None = derived: the largest divisor of the per-worker
    # mini-batch (ppo_mini_batch_size * rollout.n / data-parallel ranks) up to MICRO_BATCH_CAP (8).
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    # Micro-batches by token budget instead of by count: consecutive sequences while their valid
    # tokens fit ppo_max_token_len_per_gpu (the gradient is the same: losses are weighted by their
    # share of the mini-batch's sequences or, for token-mean, tokens).
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    # Parameters (fnmatch patterns over FQNs, e.g. "*embed_tokens*") kept frozen: no gradient or
    # optimizer state, and the weight switch moves them once, then skips them (0 bytes).
    freeze_modules: list[str] = field(default_factory=list)
    # verl's key. torch.compile each decoder layer's forward (engine/compile.py: inductor's C++ backend on CPU,
    # Triton on CUDA) for the update and the log-prob passes; FSDP2's hooks stay eager around it. Plain FSDP
    # layouts only (no TP / PP / SP / EP). Off by default: the first step pays the compile (docs/performance.md).
    use_torch_compile: bool = False
    # 3D training layout (pp x dp x tp = the actor's workers; dp is what is left): TP = DTensor
    # Colwise/Rowwise on the decoder layers (the parallel config's model_parallel_size sets it),
    # PP = torch.distributed.pipelining stages of whole decoder layers. The colocated reference
    # policy uses the same layout (it shares the actor's workers and their data split).
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Expert parallelism for MoE models (verl's VeOmni-engine key; parallel/expert_parallel.py): each group of
    # this many data-parallel workers splits the experts (each holds num_experts / ep of them whole) and trades
    # tokens by all-to-all; FSDP2 shards the experts over the workers / ep that hold the same ones. 1 = off.
    expert_parallel_size: int = 1
    # Ulysses sequence parallelism (verl's key; parallel/ulysses.py): each group of this many consecutive workers
    # trains on the same rows with every packed micro-batch's sequence split between them (attention by all-to-all
    # over heads; must divide the workers and the model's attention and KV heads); FSDP2 still shards over all
    # workers, mini/micro-batch sizes count per group (workers / sp data-parallel ranks). The colocated reference
    # scores in the same layout. 1 = off.
    ulysses_sequence_parallel_size: int = 1
    pipeline_schedule: Literal["gpipe", "1f1b"] = "1f1b"
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # None = clip_ratio
    clip_ratio_high: Optional[float] = None  # None = clip_ratio; > low gives DAPO clip-higher
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # k1 | k2 | k3 (low_var_kl = clamped k3)
    grad_clip: float = 1.0
    # false: skip the separate old-log-prob forward when the update is one on-policy pass (ppo_epochs 1,
    # one mini-batch): the detached current log-prob is the old one (ratio 1, ppo_kl 0), as TRL does.
    recompute_old_log_prob: bool = True
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False
    n: int = 1


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools or environments (hybridflow/agent/, docs/agents.md); verl's keys."""

    enable: bool = False
    max_assistant_turns: int = 5  # model turns per trajectory
    max_tool_response_length: int = 256  # characters of one tool / environment message (middle cut)
    tool_config_path: Optional[str] = None  # verl's tool YAML: tools: [{class_name, config, tool_schema}]
    format: Literal["hermes"] = "hermes"  # how tool calls are written: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    default_agent: Optional[str] = None  # rows without agent_name: tool_agent | env_agent | single_turn_agent (None: by the row)
    # One tool call or environment turn: past it the tool's answer is an error the model reads (an environment's
    # trajectory ends), counted in agent/tool_timeouts. Bounds a tool or environment with no deadline of its own.
    tool_timeout_s: float = 120.0


@dataclass
class AgentConfig:
    """A black-box agent (docs/agents.md "Black-box agents"): written against an OpenAI-compatible URL,
    served per trajectory by the run's endpoint (hybridflow/agent/openai_server.py); verl's section name."""

    # `module:function` or `/path/file.py:function`: `async def rollout(client: openai.AsyncOpenAI, row) -> float | dict`
    function: Optional[str] = None
    # A command run per trajectory (split like a shell, no shell) with OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL
    # set for its session and the row as JSON on stdin; its last stdout line is the reward (a number or {"reward": x}).
    command: Optional[str] = None
    timeout_s: float = 300.0  # one trajectory's agent; past it the agent is stopped and its trajectory scored 0 (counted)
    # Run the command in the OS sandbox (docs/agents.md "Black-box agents"): no network but its session's endpoint,
    # a read-only view of its program's installation and of the files its arguments name, limits per trajectory.
    sandbox: bool = False
    # More host paths the sandboxed command sees, read-only (absolute, existing): e.g. the directory of the
    # modules its script imports. Nothing else next to its files is shown.
    sandbox_paths: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"  # where the endpoint listens (another address is the user's explicit choice)
    port: int = 0  # 0 = a free port per step
    max_request_bytes: int = 1_048_576  # a larger body gets 413
    max_messages: int = 256  # a longer conversation gets 400
    # Per session (one trajectory's agent): requests in flight at once (more get 429), requests in all (429),
    # segments (a rewritten history opens one; 400 past the limit), and tokens sampled over all its segments
    # (0 = 4 x data.max_response_length; a request's max_tokens is bounded by what is left).
    max_session_concurrency: int = 8
    max_session_requests: int = 256
    max_session_segments: int = 32
    max_session_tokens: int = 0
    # Rollout managers (verl's name): Ray actors that run the agent loops, the endpoint (one per manager, one URL for
    # the whole run), sessions, tools and environments off the driver, each sending its requests to the replicas
    # itself. Used with trainer.async_rollout and replicas of one process (rollout.tensor_model_parallel_size=1);
    # None = chosen from the machine (one per 8 CPUs, at least 1, at most 8); 0 = the agent loops on the driver.
    num_workers: Optional[int] = None


@dataclass
class RolloutConfig:
    name: str = "hf"  # hf | vllm (CPU: scripts/bootstrap_vllm.sh; CUDA: pip install hybridflow[vllm])
    # Samples per prompt. None = not set: GROUP_N for an estimator whose baseline is the prompt's group
    # (GROUP_ESTIMATORS) and for online DPO (best vs worst of n), else 1 (config/derive.py, logged once).
    n: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0 disables top-k
    do_sample: bool = True
    stop: list[str] = field(default_factory=list)  # stop strings (kept in the response)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    # The hf backend batches per decode step (rollout/scheduler.py: requests join and leave the running batch). Off
    # by default: which requests share a step then depends on when they arrive, so generation is no longer the same
    # from run to run when calls overlap (bit-exact resumes and run-to-run comparisons need the per-call batches), and
    # its random streams are not the per-call path's (the same distributions, other draws for the same seed).
    continuous_batching: bool = False
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_use_dynamic_bsz: bool = False  # micro-batches by token budget (see actor.use_dynamic_bsz)
    log_prob_max_token_len_per_gpu: int = 16384
    tensor_model_parallel_size: int = 1
    # Zero train-rollout mismatch (hf, gen_tp 1; docs/hybrid_engine.md "Exact rollout"): the sampler and the
    # trainer's log-probs run one computation per sequence (models/exact.py exact_row_logits), so the
    # rollout's log-probs are the trainer's bit for bit; slower (a full forward per sampled token).
    exact: bool = False
    gpu_memory_utilization: float = 0.5  # vllm on CUDA: share of GPU memory for weights + KV cache
    cpu_kv_cache_gb: float = 1.0  # vllm on CPU: KV cache per worker (VLLM_CPU_KVCACHE_SPACE)
    # trainer.async_rollout: the most a wait on the rollout pool (a batch's generation, a weight sync)
    # may take; past it the run stops with one line naming the pool, its ranks and the batch's step.
    request_timeout_s: float = 600.0
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_use_dynamic_bsz: bool = False  # micro-batches by token budget (see actor.use_dynamic_bsz)
    log_prob_max_token_len_per_gpu: int = 16384
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    use_torch_compile: Optional[bool] = None  # verl's key: the reference's compiled layers (None = actor.use_torch_compile)


@dataclass
class HybridEngineConfig:
    """The 3D-HybridEngine: training (FSDP2) -> generation (TP x DP) resharding every step."""

    enable_resharding_opt: bool = True  # False = the naive baseline (gather full params, slice)
    # True: while the workers reshard, the driver prepares the next batch (data loading + collation),
    # then collects the reshard; it does not overlap the reshard with model compute.
    resharding_overlap_with_compute: bool = False
    # The layer-wise switch's staging budget, a fraction 0 < p <= 1 of the memory this rank's generation
    # weights take: it decides how many layers are in flight at once (hybrid_engine/staging.py; a budget
    # smaller than one layer's staging stages one layer at a time, logged). None = two layers in flight.
    resharding_buffer_percent: Optional[float] = None
    granularity: str = "layer"  # layer (one decoder layer at a time) | full (the whole model at once)
    # True: also run (and time) the naive full gather once, on the first reshard, for the
    # "vs ... baseline" log line and reshard/baseline_seconds. Off by default: that gather holds
    # every full parameter at once, which the pre-flight memory check does not budget.
    measure_baseline: bool = False
    # Keep the generation buffers allocated between steps (no re-allocation and page faults per
    # switch). None = decided by the pre-flight memory plan: kept when they fit next to training.
    keep_generation_buffers: Optional[bool] = None
    # The cross-pool sync (trainer.async_rollout) sends per piece only the elements that changed since the
    # last sync (or the whole piece when that is smaller), checked by CRC-32 of the trainer's tensor; a
    # mismatch is repaired from the whole piece (docs/hybrid_engine.md "Delta weight sync").
    delta_sync: bool = False
    delta_full_every: int = 10  # with delta_sync: every k-th sync sends every piece whole (0: only the first)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)

    def generation_dtype(self) -> str:
        """The rollout's weight dtype: the actor's mixed-precision compute dtype when it has one
        (bf16 training generates in bf16, so the switch moves half the bytes), else model.dtype."""
        return {"bf16": "bfloat16", "fp16": "float16"}.get(self.actor.fsdp_config.mixed_precision or "", self.model.dtype)


@dataclass
class CriticConfig:
    model: ModelConfig = field(default_factory=ModelConfig)  # path "" = the actor's path
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    ppo_mini_batch_size: Optional[int] = None  # None = the actor's
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # None = derived, as the actor's (over the critic's data-parallel ranks)
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    grad_clip: float = 1.0
    # The critic's own training TP (DTensor TP x FSDP2 over its workers; the value head replicated).
    tensor_model_parallel_size: int = 1
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (verl's reward_model.overlong_buffer): a response longer than
    data.max_response_length - len loses (length - (max - len)) / len * penalty_factor, growing
    linearly to penalty_factor at the limit; shorter ones are untouched."""

    enable: bool = False
    len: int = 0  # tokens before the limit where the penalty starts
    penalty_factor: float = 1.0
    log: bool = False  # also log reward/overlong_frac and reward/overlong_penalty/min (the mean is always logged)


@dataclass
class RewardModelConfig:
    """A sequence-classifier reward model (one label) scoring the policy's responses. It has its
    own tokenizer and chat template: responses are decoded, re-templated and re-tokenized.
    token_level_scores = score_weight * rm_score + rule_weight * rule score (rule: the reward
    manager / custom_reward_function; rule_weight 0 skips it). Its pool: resource_pool.mapping.reward_model."""

    enable: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)  # path: an AutoModelForSequenceClassification checkpoint
    micro_batch_size_per_gpu: int = 16  # sequences per forward per worker
    score_weight: float = 1.0
    rule_weight: float = 0.0
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    # Reward workers (verl's name): CPU Ray actors that run the rule reward / custom_reward_function and the code
    # reward's sandboxes in parallel, in chunks of samples (rewards/workers.py). None = chosen from the machine when
    # Ray is up (one per CPU, at most 4), 0 = on the driver, one sample after another (also what torchrun runs).
    num_workers: Optional[int] = None


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher (algorithm.adv_estimator=on_policy_distill): a causal LM with
    the student's tokenizer that scores the student's sampled tokens (teacher_log_prob), on FSDP2
    over its own pool (resource_pool.mapping.teacher; by default colocated on global_pool)."""

    enable: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)  # path: an AutoModelForCausalLM checkpoint
    log_prob_micro_batch_size_per_gpu: int = 16  # sequences per forward per worker
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None  # a .py file defining `name`
    name: str = "compute_score"
    timeout_s: Optional[float] = None  # per-call limit; a call that takes longer scores 0 and counts in reward/timeouts
    # The built-in code reward (data_source "code"): true fails an assert-style check that cannot be graded
    # outside the solution's process (rewards/code.py) instead of grading it in-process (reward/code_inprocess_checks).
    code_strict: bool = False


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): a group (the n samples of one
    prompt) whose `metric` is the same for every sample carries no GRPO signal and is dropped;
    more prompts are generated until data.train_batch_size groups are kept. `metric`: the per-
    sequence sum of the token-level scores (acc / score / seq_reward: the rule or reward-model
    score; seq_final_reward: the same, as KL-in-reward is not allowed here).

    When max_num_gen_batches rounds keep fewer groups than a step needs (a policy that solves nearly
    every prompt), the step trains on the groups kept (a smaller batch: fewer groups split over the
    same data-parallel ranks, each mini-batch's loss a mean over its own tokens / sequences; when
    they do not split evenly the fewest groups needed are dropped), with a warning and the running
    count data/underfilled_batches; none left: the step's update is skipped (train/skipped_updates).
    strict=true stops the run there instead, as verl does."""

    enable: bool = False
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"
    max_num_gen_batches: int = 10  # generation rounds per step before training on the groups kept (0 = no limit)
    strict: bool = False  # true: stop with an error when max_num_gen_batches rounds cannot fill the batch (verl's behaviour)


@dataclass
class RolloutCorrectionConfig:
    """Importance sampling between the policy that sampled (the rollout's behaviour log-probs)
    and the trainer's old policy (verl's algorithm.rollout_correction, decoupled mode), per token
    t with log-ratio d_t = old_log_prob - rollout_log_prob:
    - rollout_is (truncated IS): token: w_t = min(exp(d_t), threshold); sequence:
      w = min(exp(sum_t d_t), threshold) on every token; the policy loss is multiplied by w.
    - rollout_rs (masked IS / rejection): token: drop tokens whose exp(d_t) is outside
      [lower, upper]; sequence: drop sequences whose exp(sum d) is; geometric: exp(mean d).
    - rollout_token_veto_threshold: drop a sequence with any token's exp(d_t) below it.
    "auto" (the default) is token-level IS with trainer.async_rollout and off otherwise."""

    rollout_is: Optional[Literal["auto", "token", "sequence"]] = "auto"
    rollout_is_threshold: float = 2.0
    rollout_rs: Optional[Literal["token", "sequence", "geometric"]] = None
    rollout_rs_threshold: Optional[float] = None  # None: rollout_is_threshold
    rollout_rs_threshold_lower: Optional[float] = None  # None: 1 / the upper threshold
    rollout_token_veto_threshold: Optional[float] = None

    def rs_bounds(self) -> tuple[float, float]:
        """(lower, upper) of the rejection band, the defaults filled in (0 when the upper one is 0)."""
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else (1.0 / upper if upper else 0.0)
        return lower, upper


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # gae | grpo | rloo | reinforce_plus_plus | remax
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # k1 (= kl) | k2 (= mse) | k3 (= low_var_kl) | abs
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class DPOConfig:
    """Preference optimisation (`hybridflow dpo`), TRL's names. Batches count PAIRS:
    data.train_batch_size pairs per step, actor.ppo_mini_batch_size pairs per optimizer step,
    actor.ppo_micro_batch_size_per_gpu SEQUENCES per forward (even: chosen and rejected together)."""

    beta: float = 0.1
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"  # DPO | IPO (length-averaged log-probs, as TRL) | SLiC hinge
    label_smoothing: float = 0.0  # conservative DPO (sigmoid only): the assumed label-flip rate, in [0, 0.5)
    # Offline: the reference log-probs of every pair computed once by the initial policy and cached
    # (kept in checkpoints); no reference model is held in memory.
    precompute_ref_log_probs: bool = False
    # Online DPO: sample actor_rollout_ref.rollout.n >= 2 responses per prompt from the current policy,
    # rank them by the reward (rule / custom function / reward model), learn best vs worst.
    online: bool = False


@dataclass
class PrometheusConfig:
    port: Optional[int] = None  # serve the step metrics on host:port/metrics (0 = any free port); None = off
    host: str = "127.0.0.1"  # loopback by default; 0.0.0.0 to let a Prometheus on another machine scrape


# trainer.worker_env's default, tuned for CPU workers: one BLAS thread per worker (N workers share
# few cores), no hub access, quiet tokenizers and transformers. glibc's own malloc settings: adding
# MALLOC_MMAP_THRESHOLD_=65536 makes every large tensor its own mmap, returned to the OS when freed,
# so the switch's measured peak (utils/memory.py) is exact, but every activation then costs
# fresh zeroed pages: a multi-turn SFT step ran 1.5x slower with it (docs/performance.md).
DEFAULT_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "RAY_USAGE_STATS_ENABLED": "0",
}


@dataclass
class TrainerConfig:
    project_name: str = "hybridflow"
    experiment_name: str = "run"
    device: str = "auto"  # auto | cpu | cuda
    nnodes: int = 1
    n_gpus_per_node: int = 2  # workers per node (processes on CPU)
    total_epochs: int = 1
    total_training_steps: Optional[int] = None  # None = epochs x batches per epoch
    test_freq: int = -1  # validate every k steps (and at the end); <= 0 disables
    val_before_train: bool = True
    # Checkpoint every k steps and at the last step (<= 0: never), so that a killed run resumes with the same
    # command (resume_mode auto). On by default; one checkpoint of a tiny model costs ~0.3 s on CPU.
    save_freq: int = 20
    resume_mode: str = "auto"  # auto (latest in default_local_dir) | disable | resume_path
    resume_from_path: Optional[str] = None  # a global_step_<k> directory, with resume_mode=resume_path
    default_local_dir: str = "checkpoints/hybridflow"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # also tensorboard, wandb (WANDB_MODE=offline: no network)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    log_dir: Optional[str] = None  # JSONL metrics go here; None = default_local_dir
    progress_bar: bool = True
    seed: int = 1
    max_ckpt_to_keep: Optional[int] = None  # keep only the newest k global_step_* checkpoints; None = all
    save_hf_model: bool = False  # at the end, also write the actor as an HF checkpoint to <default_local_dir>/hf_model
    # Reliability: a collective (or rendezvous) that waits longer than this raises in the worker
    # instead of hanging; a step whose gradient norm is inf/nan skips its update, and this many such
    # steps in a row abort the run.
    collective_timeout_s: float = 600.0
    max_nonfinite_steps: int = 3
    # A step whose rollout/logprob_diff_max is over this many times the median of the previous steps'
    # (kept in checkpoints: a jump after a resume counts) is logged as a warning naming the step, and
    # rollout/logprob_diff_alarm=1 (docs/monitoring.md); 0 = off.
    mismatch_alarm_factor: float = 10.0
    # ray: this process is the single controller of Ray worker groups. torchrun: every process
    # started by `torchrun --nproc_per_node=N` runs the driver loop and is one worker (one pool,
    # nnodes x n_gpus_per_node = WORLD_SIZE ranks); the same dataflow, workers and checkpoints.
    launcher: Literal["ray", "torchrun"] = "ray"
    # Pre-flight memory check (hybridflow/planning/preflight.py): the estimated peak per worker must
    # fit this many GiB. None = the GPU's memory on CUDA; on CPU this machine's RAM / all workers.
    memory_budget_gib: Optional[float] = None
    # Debug switch: after every weight sync, check rollout weights == trained weights exactly.
    check_weight_sync: bool = False
    # Off-policy by at most async_training.max_staleness versions: the rollout role on its own pool
    # generates the next batches while the trainer updates (needs resource_pool.mapping.rollout).
    async_rollout: bool = False
    # Environment variables of every Ray worker process (values are strings: quote numbers in YAML).
    # The whole mapping: any value given (even one trainer.worker_env.NAME=... override) replaces the
    # default (DEFAULT_WORKER_ENV above, tuned for CPU), so list every variable you want kept. The
    # group adds RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT per worker. Ray launcher
    # only (torchrun workers inherit torchrun's environment).
    worker_env: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_WORKER_ENV))


@dataclass
class RayInitConfig:
    address: Optional[str] = None  # None = start a local cluster on 127.0.0.1; "auto" or host:port joins one
    num_cpus: Optional[int] = None
    cpus_per_worker: float = 0.5  # fractional, so N workers + the driver never deadlock on few cores
    resources: dict[str, float] = field(default_factory=dict)  # custom resources of the embedded local cluster, e.g. {H100: 2}


ROLES = ("actor_rollout", "rollout", "ref", "critic", "reward_model", "teacher")
DEFAULT_POOL = "global_pool"


@dataclass
class PoolSpec:
    """One named resource pool: `nnodes` x `workers_per_node` worker processes (ranks of a node
    consecutive), each reserving these Ray resources."""

    workers_per_node: int = 2
    nnodes: int = 1
    cpus_per_worker: Optional[float] = None  # None = ray_init.cpus_per_worker
    gpus_per_worker: Optional[float] = None  # None = 1 on CUDA, 0 on CPU
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per worker, e.g. {H100: 1}
    accelerator_type: Optional[str] = None  # Ray accelerator type, e.g. A100 (resource accelerator_type:A100)


@dataclass
class ResourcePoolConfig:
    """Roles placed on pools (verl's ResourcePoolManager): roles mapped to the same pool share its
    processes (colocated, one torch.distributed group); roles on different pools get their own.

    pools {} = one pool `global_pool` of trainer.nnodes x trainer.n_gpus_per_node workers; a role
    missing from `mapping` goes to `global_pool`. Roles: actor_rollout (the trained policy and its
    colocated rollout), rollout (a separate generation pool: trainer.async_rollout), ref, critic.
    """

    pools: dict[str, PoolSpec] = field(default_factory=dict)
    mapping: dict[str, str] = field(default_factory=dict)


@dataclass
class AsyncTrainingConfig:
    """How far the rollout pool generates ahead of training (trainer.async_rollout)."""

    # k: the most policy versions between the weights that sample a batch and the update that trains
    # on it. The pool generates up to k batches ahead; 0 generates each batch with the latest weights
    # (the synchronous schedule on a pool of its own), 1 overlaps one batch with each update.
    max_staleness: int = 1
    # Partial rollout (verl's key): requests run in segments of partial_rollout_chunk tokens, so a
    # weight update reaches running responses at the next segment boundary; their tokens so far are
    # kept with the version that sampled them (`rollout/partial.py`).
    partial_rollout: bool = False
    partial_rollout_chunk: int = 32
    # A rollout replica (one process: rollout.tensor_model_parallel_size=1) that dies or misses
    # rollout.request_timeout_s is restarted with the latest weights and its calls submitted again,
    # at most this many times per replica; then the run stops naming it (`service/replicas.py`).
    max_replica_restarts: int = 3


@dataclass
class HybridFlowConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    resource_pool: ResourcePoolConfig = field(default_factory=ResourcePoolConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)

    def policy_tokenizer_path(self) -> str:
        """The policy's tokenizer (the prompts' and the responses' token ids)."""
        return self.actor_rollout_ref.model.tokenizer_source()

    def with_policy_model(self, path: str) -> "HybridFlowConfig":
        """A deep copy whose policy model is `path` (actor, rollout and reference load it)."""
        out = copy.deepcopy(self)
        out.actor_rollout_ref.model.path = path
        return out


@dataclass
class SFTMultiTurnConfig:
    """verl's ``data.multiturn``: rows are conversations with tool / user turns between the
    assistant's (loss on the assistant turns only), tokenized as the agent loop builds them."""

    enable: bool = False
    messages_key: str = "messages"
    tools_key: str = "tools"  # OpenAI function schemas (a list or its JSON string), rendered into the prompt
    format: Literal["hermes"] = "hermes"  # the tool-call format whose tool prompt the schemas get


@dataclass
class SFTConfig:
    """The SFT trainer's config (``hybridflow sft``): same model/optim/trainer blocks."""

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    response_key: str = "response"
    multiturn: SFTMultiTurnConfig = field(default_factory=SFTMultiTurnConfig)
    max_length: int = 64
    train_batch_size: int = 64  # sequences per optimizer step, global
    # None = derived: the largest divisor of train_batch_size / workers up to SFT_MICRO_BATCH_CAP (32)
    micro_batch_size_per_gpu: Optional[int] = None
    total_steps: int = 300
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    grad_clip: float = 1.0
    save_dir: str = "checkpoints/sft"  # the final HF checkpoint is written here
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)


@dataclass
class RewardTrainConfig:
    """Reward-model training (``hybridflow rm``): Bradley-Terry on preference parquet.

    model.path: a sequence classifier, or a causal LM whose backbone starts the reward model (a new
    1-output score head). Validation: pairwise accuracy on val_files (held-out pairs). Of `trainer`,
    the worker layout, device, seed, logger, log_dir and test_freq apply (a run is minutes: no
    intermediate checkpoints, as with SFT)."""

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    max_prompt_length: int = 64
    max_response_length: int = 16
    train_batch_size: int = 32  # pairs per optimizer step, global
    # sequences per forward per worker (even: both sides of a pair). None = derived: the largest even
    # divisor of the 2 * train_batch_size / workers sequences a worker gets, up to SFT_MICRO_BATCH_CAP (32)
    micro_batch_size_per_gpu: Optional[int] = None
    total_steps: int = 100
    margin: float = 0.0  # loss -log sigma(r_c - r_r - margin); a `margin` column in the data adds per pair
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4))
    grad_clip: float = 1.0
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    save_dir: str = "checkpoints/reward_model"  # the final HF checkpoint is written here
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
