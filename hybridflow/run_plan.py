"""The run plan: the config resolved ONCE on the driver into one frozen spec per role.

    plan = resolve(cfg)              # after derive_defaults + validate_config, before any worker starts
    ActorRolloutRefWorker(plan.actor, role=...)      CriticWorker(plan.critic)      RolloutWorker(plan.rollout)
    make_rollout(spec.name, RolloutContext(spec, ...))

A worker, its engines and its rollout backend read only their spec: the slices of config they need,
with the values derived from other sections computed here (the critic's model and mini-batch when
unset, the generation dtype, the rollout's longest sequence), never the root config. How an update
walks its rows (`UpdatePlan`, per data-parallel rank) is the spec's, so the training engine
(`TrainEngine.train`) owns the loop and no worker computes "rows per rank".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hybridflow.config.schema import (
    ActorConfig,
    CriticConfig,
    DPOConfig,
    HybridEngineConfig,
    HybridFlowConfig,
    ModelConfig,
    RefConfig,
    RolloutConfig,
)
from hybridflow.config.validate import A, model_json, register_check
from hybridflow.parallel.dims import TP_KEY, ParallelDims, _heads_problems, _size_ok, divisors, layout_choices, validate_gen_tp
from hybridflow.protocol import SamplingParams


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


@dataclass(frozen=True)
class RolloutSpec:
    """The generation backend's: which one (name), the policy model, the sampling section, the
    generation weights' dtype and the longest sequence it must hold (prompt + response)."""

    name: str
    model: ModelConfig
    rollout: RolloutConfig  # actor_rollout_ref.rollout
    generation_dtype: str
    max_new_tokens: int  # data.max_response_length
    max_model_len: int  # data.max_prompt_length + data.max_response_length
    process: ProcessSpec

    def sampling_params(self, greedy: bool = False, seed: int = 0) -> SamplingParams:
        """How one generation call samples: rollout.* (or rollout.val_kwargs when greedy)."""
        r = self.rollout
        s = r.val_kwargs if greedy else r
        return SamplingParams(self.max_new_tokens, s.do_sample, s.temperature, s.top_p, s.top_k, tuple(r.stop), tuple(r.stop_token_ids), seed)


@dataclass(frozen=True)
class ActorSpec:
    """The policy worker's (actor, its colocated rollout and reference): the model, the actor, ref and
    hybrid-engine sections, the rollout's spec, DPO's settings, and the PPO update's shape
    (ppo_mini_batch_size prompts x n samples per optimizer step)."""

    process: ProcessSpec
    model: ModelConfig
    actor: ActorConfig
    ref: RefConfig
    hybrid_engine: HybridEngineConfig
    rollout: RolloutSpec
    dpo: DPOConfig
    samples_per_prompt: Optional[int]  # rollout.n (None outside RL)

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


@dataclass(frozen=True)
class CriticSpec:
    """The critic's: its section, its model (the actor's when critic.model.path is unset) and its
    mini-batch in prompts (the actor's when unset)."""

    process: ProcessSpec
    model: ModelConfig
    critic: CriticConfig
    mini_batch_prompts: Optional[int]
    samples_per_prompt: Optional[int]

    def update_plan(self, dp: int) -> UpdatePlan:
        c = self.critic
        return UpdatePlan(micro_rows=c.ppo_micro_batch_size_per_gpu, mini_rows=self.mini_batch_prompts * self.samples_per_prompt // dp,
                          epochs=c.ppo_epochs, metric_prefix="critic")


@dataclass(frozen=True)
class RunPlan:
    actor: ActorSpec
    critic: CriticSpec
    rollout: RolloutSpec


def resolve(cfg: HybridFlowConfig) -> RunPlan:
    """Every role's spec from the (derived, validated) config: outside config/, the only reader of the role sections."""
    arr, t = cfg.actor_rollout_ref, cfg.trainer
    process = ProcessSpec(t.device, t.seed, t.collective_timeout_s)
    rollout = RolloutSpec(arr.rollout.name, arr.model, arr.rollout, arr.generation_dtype(), cfg.data.max_response_length,
                          cfg.data.max_prompt_length + cfg.data.max_response_length, process)
    actor = ActorSpec(process, arr.model, arr.actor, arr.ref, arr.hybrid_engine, rollout, cfg.dpo, arr.rollout.n)
    c = cfg.critic
    critic = CriticSpec(process, c.model if c.model.path else arr.model, c, c.ppo_mini_batch_size or arr.actor.ppo_mini_batch_size, arr.rollout.n)
    return RunPlan(actor, critic, rollout)


# ---------------------------------------------------------------- the config validator's checks
# Registered with hybridflow.config.validate (which names this module in CHECK_MODULES): the same
# rules as ParallelDims (parallel/dims.py), with messages that name the config keys and say what to set.

register_check("gen_tp")(validate_gen_tp)  # parallel/dims.py: the generation TP against its ranks and the heads


@register_check("actor_layout")
def actor_layout_problems(cfg, n_workers: int) -> tuple[list[str], int | None]:
    """The actor's pp x tp x dp (tp, pp >= 1 and not both 1) against its `n_workers`, the model
    (heads, layers, tied embeddings) and the generation TP: (problems, dp or None when pp x tp does
    not divide the workers)."""
    arr = cfg.actor_rollout_ref
    tp, pp, gen_tp = arr.actor.tensor_model_parallel_size, arr.actor.pipeline_model_parallel_size, arr.rollout.tensor_model_parallel_size
    tp_key, pp_key = f"{A}.tensor_model_parallel_size", f"{A}.pipeline_model_parallel_size"
    if n_workers % (tp * pp):
        return [f"pp x tp x dp must equal the actor's {n_workers} workers (trainer.nnodes * trainer.n_gpus_per_node): "
                f"{pp_key} ({pp}) x {tp_key} ({tp}) = {pp * tp} does not divide {n_workers}; use (pp, tp) such as "
                f"{layout_choices(n_workers)[:4]}"], None
    dims = ParallelDims.for_world(n_workers, pp=pp, tp=tp)
    mj = model_json(arr.model.path)
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


@register_check("critic_layout")
def critic_layout_problems(cfg, n_workers: int) -> tuple[list[str], int | None]:
    """critic.tensor_model_parallel_size (> 1) x dp against the critic's workers and its model's heads."""
    tp, key = cfg.critic.tensor_model_parallel_size, "critic.tensor_model_parallel_size"
    if n_workers % tp:
        return [f"{key} ({tp}) must divide the critic's {n_workers} workers; set it to one of {divisors(n_workers)}"], None
    mj = model_json(cfg.critic.model.path or cfg.actor_rollout_ref.model.path)
    heads = mj.get("num_attention_heads") or 0
    return _heads_problems(key, tp, heads, mj.get("num_key_value_heads") or heads, whose="the critic model's"), ParallelDims.for_world(n_workers, tp=tp).dp
