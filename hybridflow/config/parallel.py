"""The user-facing *parallel config file* and its mapping onto the run config.

A parallel config describes how HybridFlow lays the models out on the workers::

    model_parallel_size: 2        # training tensor-parallel size (DTensor TP x FSDP2)
    pipeline_parallel_size: 1     # training pipeline stages (torch.distributed.pipelining)
    data_parallel_size: 2         # FSDP ranks per TP x PP group: pp x tp x dp = the actor's workers
    generation_tensor_parallel_size: null   # the rollout's TP; null = model_parallel_size
    fsdp_enabled: true            # false = the actor is replicated (NO_SHARD)
    fsdp_config:
      mixed_precision: false      # or bf16 / fp16 / true or amp (the device's preferred low precision)
      offload_params: false
      sharding_strategy: FULL_SHARD   # FULL_SHARD | SHARD_GRAD_OP | NO_SHARD
    enable_resharding_opt: true
    resharding_overlap_with_compute: false   # true: the driver prepares the next batch while the workers reshard

    cfg = load_config("configs/grpo_tiny.yaml")
    cfg = apply_parallel_config(cfg, load_parallel_config("configs/parallel_dp2_tp2.yaml"))

It is loaded with the same loader as the run config (typed, unknown keys get a "did you mean").
:func:`apply_parallel_config` writes into ``HybridFlowConfig`` only the keys the file (or dict, or
``ParallelConfig``) sets: every field defaults to None = "not set, keep the run config's value",
so a file that names only ``model_parallel_size`` leaves a YAML's ``mixed_precision`` as written.
``validate_config`` then checks the result as usual. :func:`apply_engine_kwargs` is the Python-API equivalent for the hybrid-engine
switches (``RLTrainer(cfg, enable_resharding_opt=False)``).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from hybridflow.config.derive import resolve_mixed_precision
from hybridflow.config.loader import ConfigError, from_dict, load_config
from hybridflow.config.schema import FSDPConfig, HybridFlowConfig

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
ENGINE_KWARGS = ("enable_resharding_opt", "resharding_overlap_with_compute", "resharding_buffer_percent", "granularity")


@dataclass
class ParallelFSDPConfig:
    # None = not set (the run config's value stays)
    mixed_precision: Any = None  # false | true / "amp" (the device's preferred low precision) | bf16 | fp16
    offload_params: Optional[bool] = None
    sharding_strategy: Optional[str] = None  # FULL_SHARD | SHARD_GRAD_OP | NO_SHARD


@dataclass
class ParallelConfig:
    """Every field None = not set: applying it keeps the run config's value."""

    model_parallel_size: Optional[int] = None  # training tensor-parallel size
    pipeline_parallel_size: Optional[int] = None  # training pipeline stages
    data_parallel_size: Optional[int] = None  # checked: pp x tp x dp = the actor's workers
    generation_tensor_parallel_size: Optional[int] = None  # the rollout's TP; None = model_parallel_size when that is set
    fsdp_enabled: Optional[bool] = None  # False = replicated actor (NO_SHARD)
    fsdp_config: ParallelFSDPConfig = field(default_factory=ParallelFSDPConfig)
    enable_resharding_opt: Optional[bool] = None
    # True: while the workers reshard, the driver prepares the next batch (data loading + collation);
    # not an overlap with model compute.
    resharding_overlap_with_compute: Optional[bool] = None
    # -> actor_rollout_ref.hybrid_engine.resharding_buffer_percent: the layer-wise switch's staging budget,
    # a fraction 0 < p <= 1 of the generation weights' memory (how many layers are in flight at once).
    resharding_buffer_percent: Optional[float] = None


def load_parallel_config(path: str, overrides: Iterable[str] = ()) -> ParallelConfig:
    """Read a parallel config file (+ dotlist overrides); errors name the file and the key."""
    try:
        return load_config(path, overrides, schema=ParallelConfig)
    except ConfigError as e:
        raise ConfigError(f"parallel config {path}: {e}") from None


def as_parallel_config(value: "str | os.PathLike | dict | ParallelConfig") -> ParallelConfig:
    """A parallel config given as a file path, a dict (the file's keys) or a ParallelConfig."""
    if isinstance(value, ParallelConfig):
        return value
    if isinstance(value, dict):
        try:
            return from_dict(ParallelConfig, value)
        except ConfigError as e:
            raise ConfigError(f"parallel_config: {e}") from None
    if isinstance(value, (str, os.PathLike)):
        return load_parallel_config(os.fspath(value))
    raise ConfigError(f"parallel_config must be a file path, a dict or a ParallelConfig, got {type(value).__name__}")


def _fsdp_configs(cfg: HybridFlowConfig) -> list[FSDPConfig]:
    arr = cfg.actor_rollout_ref
    return [arr.actor.fsdp_config, arr.ref.fsdp_config, cfg.critic.fsdp_config]


def apply_parallel_config(cfg: HybridFlowConfig, pcfg: ParallelConfig) -> HybridFlowConfig:
    """Return a copy of ``cfg`` with the keys ``pcfg`` sets applied (``cfg`` itself is not
    modified; a None field is not set and leaves ``cfg``'s value).

    - ``model_parallel_size`` -> ``actor_rollout_ref.actor.tensor_model_parallel_size`` (training TP).
    - ``pipeline_parallel_size`` -> ``actor_rollout_ref.actor.pipeline_model_parallel_size``.
    - ``data_parallel_size``: pp x tp x dp must equal ``trainer.nnodes * trainer.n_gpus_per_node``
      (the actor's workers; pp and tp as set here or in ``cfg``).
    - ``generation_tensor_parallel_size`` -> ``actor_rollout_ref.rollout.tensor_model_parallel_size``
      (not set: ``model_parallel_size`` when that is set).
    - ``fsdp_enabled: false`` means the actor (and ref / critic) are *replicated*: sharding strategy
      NO_SHARD (every rank holds the whole model, gradients are all-reduced), whatever
      ``fsdp_config.sharding_strategy`` says.
    - ``fsdp_config.{sharding_strategy, mixed_precision, offload_params}`` ->
      ``{actor_rollout_ref.actor, actor_rollout_ref.ref, critic}.fsdp_config.{sharding_strategy,
      mixed_precision, param_offload}``; mixed_precision false -> None (fp32), true / "amp" -> the
      device's preferred low precision for ``cfg.trainer.device`` (bf16 on CPU and on GPUs that
      compute it, else fp16: ``derive.resolve_mixed_precision``, logged once).
    - ``enable_resharding_opt``, ``resharding_overlap_with_compute`` (the driver prepares the next
      batch -- data loading + collation -- while the workers reshard; not an overlap with model
      compute), ``resharding_buffer_percent`` (the layer-wise switch's staging budget as a fraction
      0 < p <= 1 of the generation weights' memory: how many layers are in flight at once; checked
      by ``validate_config``) -> ``actor_rollout_ref.hybrid_engine.*``.
    """
    for key in ("model_parallel_size", "pipeline_parallel_size", "generation_tensor_parallel_size"):
        v = getattr(pcfg, key)
        if v is not None and not (isinstance(v, int) and v >= 1):
            raise ConfigError(f"{key} must be a positive integer, got {v!r}")
    a = cfg.actor_rollout_ref.actor
    tp = a.tensor_model_parallel_size if pcfg.model_parallel_size is None else pcfg.model_parallel_size
    pp = a.pipeline_model_parallel_size if pcfg.pipeline_parallel_size is None else pcfg.pipeline_parallel_size
    t = cfg.trainer
    world = t.nnodes * t.n_gpus_per_node
    if pcfg.data_parallel_size is not None and pcfg.data_parallel_size * tp * pp != world:
        raise ConfigError(
            f"pipeline_parallel_size x model_parallel_size x data_parallel_size = {pp} x {tp} x {pcfg.data_parallel_size} = "
            f"{pp * tp * pcfg.data_parallel_size} does not match the actor's workers trainer.nnodes * trainer.n_gpus_per_node = "
            f"{t.nnodes} * {t.n_gpus_per_node} = {world}; set trainer.n_gpus_per_node so that trainer.nnodes * "
            f"trainer.n_gpus_per_node = {pp * tp * pcfg.data_parallel_size}, or data_parallel_size: "
            f"{world // (pp * tp) if world % (pp * tp) == 0 else 'null'} accordingly")
    fcfg = pcfg.fsdp_config
    strategy = "NO_SHARD" if pcfg.fsdp_enabled is False else fcfg.sharding_strategy
    if strategy is not None and strategy not in SHARDING_STRATEGIES:
        raise ConfigError(f"fsdp_config.sharding_strategy must be one of {list(SHARDING_STRATEGIES)}, got {strategy!r}")
    mp = resolve_mixed_precision(fcfg.mixed_precision, cfg.trainer.device, "fsdp_config.mixed_precision")

    cfg = copy.deepcopy(cfg)
    actor = cfg.actor_rollout_ref.actor
    actor.tensor_model_parallel_size, actor.pipeline_model_parallel_size = tp, pp
    gen_tp = pcfg.generation_tensor_parallel_size if pcfg.generation_tensor_parallel_size is not None else pcfg.model_parallel_size
    if gen_tp is not None:
        cfg.actor_rollout_ref.rollout.tensor_model_parallel_size = gen_tp
    for fc in _fsdp_configs(cfg):
        if strategy is not None:
            fc.sharding_strategy = strategy
            fc.reshard_after_forward = strategy == "FULL_SHARD"  # kept consistent for readers of the old field
        if fcfg.mixed_precision is not None:
            fc.mixed_precision = mp
        if fcfg.offload_params is not None:
            fc.param_offload = fcfg.offload_params
    he = cfg.actor_rollout_ref.hybrid_engine
    for key in ("enable_resharding_opt", "resharding_overlap_with_compute", "resharding_buffer_percent"):
        if getattr(pcfg, key) is not None:
            setattr(he, key, getattr(pcfg, key))
    return cfg


def apply_engine_kwargs(cfg: HybridFlowConfig, **kwargs: Any) -> HybridFlowConfig:
    """Return a copy of ``cfg`` with hybrid-engine switches set from keyword arguments.

    Accepted: ``enable_resharding_opt`` (bool), ``resharding_overlap_with_compute`` (bool: the
    driver prepares the next batch -- data loading + collation -- while the workers reshard),
    ``resharding_buffer_percent`` (0 < p <= 1: the layer-wise switch's staging budget as a fraction
    of the generation weights' memory), ``granularity`` ("layer" | "full"); they go to
    ``actor_rollout_ref.hybrid_engine.*`` and are checked by ``validate_config``.
    """
    unknown = sorted(set(kwargs) - set(ENGINE_KWARGS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; valid hybrid-engine keyword arguments: "
                        f"{list(ENGINE_KWARGS)}")
    types = {"enable_resharding_opt": bool, "resharding_overlap_with_compute": bool, "resharding_buffer_percent": object,
             "granularity": str}  # resharding_buffer_percent: its type and range are validate_config's (one message for every route)
    for k, v in kwargs.items():
        if not isinstance(v, types[k]):
            raise ConfigError(f"actor_rollout_ref.hybrid_engine.{k}: bad value {v!r} ({type(v).__name__})")
    cfg = copy.deepcopy(cfg)
    he = cfg.actor_rollout_ref.hybrid_engine
    for k, v in kwargs.items():
        setattr(he, k, v)
    return cfg
