"""The pre-flight memory check `hybridflow train` runs before Ray or any worker starts.

Per pool, every role placed on it keeps its resident state (parameters; optimizer state when it
trains) for the whole run, and the phases take turns: the actor's update (gradients, activations,
FSDP's unsharded layers), the actor's generation (generation weights, KV cache), the critic's
update, the forward-only roles' log-prob passes (the logits term is [tokens, vocab], or [chunk,
vocab] under model.use_fused_kernels; the attention kernel is the engine's: eager, with its
[heads, s, s] probabilities, for bf16 on CPU). Pool peak = resident + the largest phase, from the same
cost model as `hybridflow plan` (cost.py). The budget per worker: `trainer.memory_budget_gib`
when set; else the GPU's memory on CUDA; else, on CPU, this machine's RAM shared by every worker.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from hybridflow.config.loader import ConfigError
from hybridflow.config.derive import rollout_n
from hybridflow.run_plan import resolve
from hybridflow.config.schema import MICRO_BATCH_CAP, FSDPConfig, HybridFlowConfig
from hybridflow.config import pools as rp
from hybridflow.parallel.dims import ParallelDims
from hybridflow.planning.arch import Arch, load_arch
from hybridflow.planning.cost import DTYPE_BYTES, GIB, MemoryInputs, human, logprob_pass_bytes, plan_for, worst_memory

log = logging.getLogger(__name__)
BUDGET_KEY = "trainer.memory_budget_gib"


def _strategy(fc: FSDPConfig) -> str:
    return fc.sharding_strategy or ("FULL_SHARD" if fc.reshard_after_forward else "SHARD_GRAD_OP")


def _attention(cfg: HybridFlowConfig, fc: FSDPConfig, exact: bool) -> str:
    """The attention kernel a role's engine runs outside Ulysses: eager for bf16 compute on CPU
    (`engine/cpu_kernels.py`, not in the exact mode), else SDPA (Ulysses, sp > 1, is the layout's)."""
    if fc.mixed_precision not in ("bf16", "bfloat16") or exact or cfg.trainer.device == "cuda":
        return "sdpa"
    import torch

    return "eager" if cfg.trainer.device == "cpu" or not torch.cuda.is_available() else "sdpa"


def _role_memory(arch: Arch, layout: ParallelDims, gen_tp: int, fc: FSDPConfig, m: MemoryInputs, trains: bool,
                 log_prob: MemoryInputs | None = None) -> dict[str, int]:
    """The worst rank's memory plan of one role in its training `layout` (pp x tp x dp workers);
    log_prob: the inputs of its no-grad log-prob micro-batch (the actor's old log-probs, with entropy)."""
    mem = worst_memory(plan_for(arch, layout, gen_tp, m.gen_bytes, m.strategy, lora_rank=m.lora_rank), arch, layout, m)
    if not trains:  # forward only: no gradients, optimizer state or generation
        mem = dict(mem, grads=0, optimizer=0, gen_weights=0, kv_cache=0, activations=logprob_pass_bytes(arch, m, entropy=False, sp=layout.sp))
    elif log_prob is not None:  # a phase of its own: the larger of the update's and the log-prob pass's activations
        mem = dict(mem, activations=max(mem["activations"], logprob_pass_bytes(arch, log_prob, entropy=True, sp=layout.sp)))
    return mem


def pool_memory(cfg: HybridFlowConfig, roles: list[rp.Role] | None = None) -> dict[str, dict]:
    """{pool: {"peak": bytes per worker, "parts": {role: memory plan}}} for the roles this run starts
    (`roles`: default the RL roles, `rp.active_roles`)."""
    plan, d = resolve(cfg), cfg.data
    arr, critic = plan.actor, plan.critic.critic  # the policy's spec (model, actor, ref, rollout), the critic's section
    arch = load_arch(arr.model.path)
    seq = d.max_prompt_length + d.max_response_length
    per_role = {}
    for role, pool in rp.role_pools(cfg, roles).items():
        n = rp.role_world_size(cfg, role, roles)
        fc = {rp.Role.CRITIC: critic.fsdp_config, rp.Role.REF: arr.ref.fsdp_config, rp.Role.REWARD_MODEL: cfg.reward_model.fsdp_config,
              rp.Role.TEACHER: cfg.teacher.fsdp_config}.get(role, arr.actor.fsdp_config)
        compute = DTYPE_BYTES.get(fc.mixed_precision or "fp32", 4)
        gen = DTYPE_BYTES[arr.rollout.generation_dtype]  # the rollout's weights: bf16 under bf16 mixed precision
        # the role's micro-batch: the update's for the trained roles, the log-prob pass's for the forward-only ones (unset: at most the cap)
        micro = {rp.Role.REF: arr.ref.log_prob_micro_batch_size_per_gpu, rp.Role.TEACHER: cfg.teacher.log_prob_micro_batch_size_per_gpu,
                 }.get(role, arr.actor.ppo_micro_batch_size_per_gpu) or MICRO_BATCH_CAP
        chunk = {rp.Role.CRITIC: None, rp.Role.REWARD_MODEL: cfg.reward_model.model.logprob_chunk(),
                 rp.Role.TEACHER: cfg.teacher.model.logprob_chunk()}.get(role, arr.model.logprob_chunk())
        mcfg = {rp.Role.CRITIC: critic.model, rp.Role.REWARD_MODEL: cfg.reward_model.model, rp.Role.TEACHER: cfg.teacher.model}.get(role, arr.model)
        exact = role in (rp.Role.ACTOR_ROLLOUT, rp.Role.REF) and arr.rollout.rollout.exact
        m = MemoryInputs(param_bytes=4, compute_bytes=compute, gen_bytes=gen, strategy=_strategy(fc), seq_len=seq, response_len=d.max_response_length,
                         logits_chunk=chunk, micro_batch=micro, attention=_attention(cfg, fc, exact), packed=bool(getattr(mcfg, "use_remove_padding", False)),
                         rollout_seqs=d.train_batch_size * rollout_n(cfg),
                         gradient_checkpointing=arr.model.enable_gradient_checkpointing, param_offload=fc.param_offload,
                         lora_rank={rp.Role.ACTOR_ROLLOUT: arr.model.lora_rank, rp.Role.CRITIC: critic.model.lora_rank}.get(role, 0))
        role_arch = load_arch(critic.model.path) if role == rp.Role.CRITIC and critic.model.path else arch
        if role in (rp.Role.REWARD_MODEL, rp.Role.TEACHER):
            role_arch = load_arch((cfg.reward_model if role == rp.Role.REWARD_MODEL else cfg.teacher).model.path)
        rollout_tp = arr.rollout.rollout.tensor_model_parallel_size
        gen_tp = rollout_tp if role in (rp.Role.ACTOR_ROLLOUT, rp.Role.ROLLOUT) and n % rollout_tp == 0 else 1
        trains = role in (rp.Role.ACTOR_ROLLOUT, rp.Role.CRITIC)
        a = arr.actor  # the actor's 3D layout; other roles train or score with FSDP
        pp, tp = (a.pipeline_model_parallel_size, a.tensor_model_parallel_size) if role == rp.Role.ACTOR_ROLLOUT else (1, 1)
        sp = a.ulysses_sequence_parallel_size if role == rp.Role.ACTOR_ROLLOUT and pp == tp == 1 and n % a.ulysses_sequence_parallel_size == 0 else 1
        ep = a.expert_parallel_size if role == rp.Role.ACTOR_ROLLOUT and pp == tp == 1 and sp == 1 and n % a.expert_parallel_size == 0 else 1
        layout = ParallelDims(pp, tp, n // (pp * tp), sp=sp, ep=ep) if n % (pp * tp) == 0 else ParallelDims(dp=n)
        log_prob = None
        if role == rp.Role.ACTOR_ROLLOUT:  # the old-log-prob pass runs rollout.log_prob_micro_batch_size_per_gpu sequences
            log_prob = dataclasses.replace(m, micro_batch=arr.rollout.rollout.log_prob_micro_batch_size_per_gpu or MICRO_BATCH_CAP)
        mem = _role_memory(role_arch, layout, gen_tp, fc, m, trains, log_prob)
        if role == rp.Role.ROLLOUT:  # generation only: no optimizer, no update
            mem = dict(mem, grads=0, optimizer=0, activations=0, fsdp_unshard=0)
        per_role.setdefault(pool, {})[role.value] = mem
    out = {}
    for pool, roles in per_role.items():
        resident = sum(m["params"] + m["optimizer"] for m in roles.values())
        phases = [m["grads"] + m["activations"] + m["fsdp_unshard"] for m in roles.values()]
        phases += [m["gen_weights"] + m["kv_cache"] for m in roles.values()]
        out[pool] = {"peak": resident + max(phases), "resident": resident, "parts": roles}
    return out


def budget_bytes(cfg: HybridFlowConfig) -> tuple[float, str]:
    """(bytes per worker, where the number comes from)."""
    t = cfg.trainer
    if t.memory_budget_gib is not None:
        return t.memory_budget_gib * GIB, BUDGET_KEY
    import torch

    if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()):
        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory), "the GPU's memory"
        return float("inf"), f"unknown: the driver sees no GPU; set {BUDGET_KEY}"
    workers = sum(rp.world_size(spec) for spec in rp.pool_specs(cfg).values())
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / max(1, workers), f"this machine's RAM / {workers} workers"


def check_memory(cfg: HybridFlowConfig, roles: list[rp.Role] | None = None) -> dict[str, dict]:
    """Log the per-worker estimate of every pool; raise ConfigError naming the budget and the keys
    to change when one does not fit. Skipped (returns {}) when the model's config.json is unreadable
    or of a family the planner does not know (the validator reports a missing model). Also resolves
    `actor_rollout_ref.hybrid_engine.keep_generation_buffers: null` (keep when they fit)."""
    try:
        pools = pool_memory(cfg, roles)
    except (ValueError, KeyError, OSError) as e:
        log.info("memory pre-flight check skipped: %s", e)
        return {}
    budget, source = budget_bytes(cfg)
    for pool, est in pools.items():
        parts = {k: sum(m[k] for m in est["parts"].values()) for k in ("params", "grads", "optimizer", "activations", "gen_weights", "kv_cache")}
        text = ", ".join(f"{k} {human(v)}" for k, v in parts.items())
        log.info("memory plan per worker of pool %s (%s): %s; peak %s of budget %s (%s)", pool, "+".join(est["parts"]),
                 text, human(est["peak"]), human(budget), source)
        if est["peak"] > budget:
            raise ConfigError(
                f"memory: the estimated peak per worker of pool {pool} ({'+'.join(est['parts'])}) is {human(est['peak'])} ({text}) "
                f"but the budget is {human(budget)} ({source}); add workers (trainer.n_gpus_per_node / trainer.nnodes), lower "
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu or data.max_response_length, raise "
                f"actor_rollout_ref.rollout.tensor_model_parallel_size, set actor_rollout_ref.model.enable_gradient_checkpointing=true, "
                f"or raise {BUDGET_KEY}")
    he = resolve(cfg).actor.hybrid_engine
    if he.keep_generation_buffers is None:  # derived once here, passed to the workers in the config
        actor = pools.get(rp.role_pools(cfg, roles).get(rp.Role.ACTOR_ROLLOUT), {})
        kept = actor.get("parts", {}).get(rp.Role.ACTOR_ROLLOUT.value, {}).get("gen_weights", 0)
        he.keep_generation_buffers = bool(actor) and actor["peak"] + kept <= budget
        log.info("generation buffers %s between steps (actor_rollout_ref.hybrid_engine.keep_generation_buffers=%s, memory plan)",
                 "kept" if he.keep_generation_buffers else "released", he.keep_generation_buffers)
    return pools
