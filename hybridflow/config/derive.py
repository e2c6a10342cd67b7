"""What the user left to the layout or the device, derived before validation (logged once each):
unset batch sizes, ``rollout.n``, and ``mixed_precision: true`` / ``"amp"``.

A size the layout constrains (the actor's mini-batch, the actor's / critic's / SFT's / reward model's
micro-batch) is None in the schema when not set, the convention the parallel config and
``critic.ppo_mini_batch_size`` already use. ``derive_*`` return a copy of the config with every such
None replaced by a value that fits the layout:

- ``actor.ppo_mini_batch_size``: the largest divisor of ``data.train_batch_size`` up to
  ``MINI_BATCH_CAP`` whose sequences split evenly over the actor's data-parallel ranks
  (``data.train_batch_size`` itself with ``recompute_old_log_prob: false``, which needs one pass);
- ``actor`` / ``critic.ppo_micro_batch_size_per_gpu``: the largest divisor of the per-worker
  mini-batch (mini-batch x ``rollout.n`` / data-parallel ranks) up to ``MICRO_BATCH_CAP``; with DPO
  the largest even one (a forward holds both sides of its pairs);
- SFT / reward-model ``micro_batch_size_per_gpu``: the largest divisor (even for pairs) of what a
  worker gets per step, up to ``SFT_MICRO_BATCH_CAP``.

- ``rollout.n``: ``GROUP_N`` (8) for an estimator whose baseline is the prompt's group (grpo, rloo)
  and for online DPO, else 1.

A value the user set is never changed: the validator checks it and refuses it with the fix. When the
layout itself is invalid (workers that do not divide the batch, ...) nothing is derived and the
validator reports the real problem.

``mixed_precision`` (every ``*.fsdp_config``, the parallel config's ``fsdp_config``,
``wrap_hf_model_with_fsdp`` / ``prepare_fsdp_model``) is spelled false / null (off: the parameters'
fp32), ``bf16`` / ``bfloat16``, ``fp16`` / ``float16``, or true / ``"amp"``: the device's preferred
low precision (:func:`preferred_low_precision`): bf16 where the device computes it (every CPU torch
runs on, CUDA GPUs that report bf16 support), else fp16 on CUDA, else refused with the reason.
:func:`resolve_mixed_precision` turns each spelling into None / "bf16" / "fp16", the values the
workers and ``apply_fsdp2`` take. For a run, the device is ``trainer.device`` (``auto``: the
driver's, which decides before any worker starts).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional

from hybridflow.config import pools as rp
from hybridflow.config.schema import (GROUP_ESTIMATORS, GROUP_N, MICRO_BATCH_CAP, MINI_BATCH_CAP, SFT_MICRO_BATCH_CAP, FSDPConfig,
                                      HybridFlowConfig, RewardTrainConfig, SFTConfig)
from hybridflow.config.tree import ConfigError

__all__ = ["MIXED_PRECISION_SPELLINGS", "derive_defaults", "rollout_n", "derive_rm_defaults", "derive_sft_defaults", "largest_divisor", "log_once",
           "preferred_low_precision", "resolve_mixed_precision"]

logger = logging.getLogger("hybridflow")
_LOGGED: set[str] = set()

A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


def log_once(message: str, level: int = logging.INFO) -> None:
    """Log `message` the first time this process derives it (a trainer built twice logs it once)."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.log(level, message)


# ---------------------------------------------------------------- mixed precision
MIXED_PRECISION_SPELLINGS = (None, False, True, "amp", "bf16", "bfloat16", "fp16", "float16")
_DTYPE_SPELLINGS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}


def _cpu_has_bf16_units() -> bool:
    """Whether this CPU computes bf16 natively (x86 AVX512-BF16 / AMX-BF16, Arm BF16); without,
    torch emulates it and bf16 matmuls run far slower than fp32 (docs/performance.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = {w for line in f if line.startswith(("flags", "Features")) for w in line.split(":", 1)[-1].split()}
    except OSError:
        return True  # unknown (not Linux): no warning
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def preferred_low_precision(device: str) -> tuple[str, str, bool]:
    """("bf16" | "fp16", why, slow) for `device` ("auto" | "cpu" | "cuda[:i]" | another torch device
    type). Raises ConfigError for a device whose preference hybridflow does not know."""
    import torch

    kind = str(device).split(":")[0]
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            return "bf16", "trainer.device=cuda but this process sees no GPU to ask; bf16, which GPUs from Ampere on compute", False
        name = torch.cuda.get_device_name()
        try:
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # an older torch without the argument
            native = torch.cuda.is_bf16_supported()
        if native:
            return "bf16", f"{name} computes bf16", False
        return "fp16", f"{name} has no native bf16", False
    if kind == "cpu":
        if _cpu_has_bf16_units():
            return "bf16", "torch computes bf16 on CPU, and this CPU has bf16 units", False
        return "bf16", ("torch computes bf16 on CPU, but this CPU has no bf16 units (avx512_bf16 / amx_bf16): bf16 matmuls run "
                        "far slower than fp32 here; set mixed_precision: false to train in fp32"), True
    raise ConfigError(f"the device's preferred low precision is known for cuda and cpu, not {device!r}")


def resolve_mixed_precision(value: Any, device: str, key: str = "mixed_precision") -> Optional[str]:
    """A mixed_precision spelling -> None (off) | "bf16" | "fp16" on `device`; true / "amp" is the
    device's preferred low precision, logged once. Anything else raises ConfigError naming `key`."""
    if value is None or value is False:
        return None
    if isinstance(value, str) and value.lower() in _DTYPE_SPELLINGS:
        return _DTYPE_SPELLINGS[value.lower()]
    if value is True or (isinstance(value, str) and value.lower() == "amp"):
        try:
            dtype, why, slow = preferred_low_precision(device)
        except ConfigError as e:
            raise ConfigError(f"{key}={value!r} asks for the device's preferred low precision: {e}; set bf16 or fp16 "
                              f"(or false)") from None
        log_once(f"mixed_precision {value!r} on {str(device).split(':')[0]}: {dtype}, the device's preferred low precision ({why})",
                 logging.WARNING if slow else logging.INFO)
        return dtype
    raise ConfigError(f"{key} must be false (off), true or \"amp\" (the device's preferred low precision), bf16 or fp16, got {value!r}")


def _resolve_precisions(sections: list[tuple[str, FSDPConfig]], device: str) -> None:
    """Each section's mixed_precision as None / "bf16" / "fp16" (in place); a value that cannot be
    resolved stays, for the validator to report with every other problem."""
    for key, fc in sections:
        try:
            fc.mixed_precision = resolve_mixed_precision(fc.mixed_precision, device, f"{key}.mixed_precision")
        except ConfigError:
            pass


def largest_divisor(n: int, cap: int, step: int = 1) -> Optional[int]:
    """The largest multiple of `step` that divides `n` and is <= `cap` (None when there is none)."""
    return next((d for d in range(min(n, cap), 0, -1) if n % d == 0 and d % step == 0), None)


def positive_int(v) -> bool:
    """An int (not a bool) > 0: a size the derivations and checks can compute with."""
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _data_parallel_sizes(cfg: HybridFlowConfig, kind: str) -> tuple[Optional[int], Optional[int]]:
    """(actor dp, critic dp): the ranks a training batch is split over (workers / (pp x tp)); None
    where the pools or the layout do not fit (the validator says why). The pool sizes are the
    validator's pool check's (the same `config/pools.py` rules) and the run plan's (`run_plan.resolve`)."""
    try:
        roles = rp.run_roles(cfg, kind)
        if rp.pool_problems(cfg, roles):
            return None, None
        actor_workers, critic_workers = rp.role_world_size(cfg, rp.Role.ACTOR_ROLLOUT, roles), rp.role_world_size(cfg, rp.Role.CRITIC, roles)
    except (TypeError, ValueError, KeyError):  # sizes of the wrong type: the validator names them
        return None, None
    a, c = cfg.actor_rollout_ref.actor, cfg.critic
    actor_dp = critic_dp = None
    if positive_int(a.tensor_model_parallel_size) and positive_int(a.pipeline_model_parallel_size) and positive_int(actor_workers):
        split = a.tensor_model_parallel_size * a.pipeline_model_parallel_size
        actor_dp = actor_workers // split if actor_workers % split == 0 else None
    if positive_int(c.tensor_model_parallel_size) and positive_int(critic_workers) and critic_workers % c.tensor_model_parallel_size == 0:
        critic_dp = critic_workers // c.tensor_model_parallel_size
    return actor_dp, critic_dp


def rollout_n(cfg: HybridFlowConfig, kind: str = "rl") -> int:
    """The samples per prompt a run uses: rollout.n, or when unset GROUP_N where the algorithm compares
    a prompt's samples (a group estimator, online DPO), else 1."""
    n = cfg.actor_rollout_ref.rollout.n
    if n is not None:
        return n
    grouped = (kind == "rl" and cfg.algorithm.adv_estimator in GROUP_ESTIMATORS) or (kind == "dpo" and cfg.dpo.online)
    return GROUP_N if grouped else 1


def _derive_n(cfg: HybridFlowConfig, kind: str) -> None:
    roll = cfg.actor_rollout_ref.rollout
    if roll.n is not None:
        return
    roll.n = rollout_n(cfg, kind)
    if roll.n > 1:  # (1, verl's default, is worth no log line)
        why = (f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} baselines each sample against its prompt's group"
               if kind == "rl" else "dpo.online=true pairs the best and the worst of each prompt's samples")
        log_once(f"rollout n {roll.n}: derived ({why}); set {R}.n to choose")


def _derive_mini(cfg: HybridFlowConfig, kind: str, dp: int) -> None:
    d, a, n = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    if a.ppo_mini_batch_size is not None or not (positive_int(d.train_batch_size) and positive_int(n)):
        return
    unit = 1 if kind == "dpo" else n  # pairs are split over the workers whole; prompts as their n samples
    if kind == "rl" and not a.recompute_old_log_prob:  # one on-policy pass: the whole batch is one mini-batch
        choices = [d.train_batch_size]
        why = f"data.train_batch_size, as {A}.recompute_old_log_prob=false needs one on-policy pass"
    else:
        choices = range(min(d.train_batch_size, MINI_BATCH_CAP), 0, -1)
        why = (f"the largest divisor of data.train_batch_size ({d.train_batch_size}) up to {MINI_BATCH_CAP} whose "
               f"{'pairs' if kind == 'dpo' else 'sequences'} split evenly over {dp} data-parallel worker{'s' * (dp > 1)}")
    mini = next((m for m in choices if d.train_batch_size % m == 0 and (m * unit) % dp == 0), None)
    if mini is None:
        return  # data.train_batch_size * n does not divide over the workers: the validator says so
    a.ppo_mini_batch_size = mini
    log_once(f"actor mini batch {mini}: derived from the layout ({why}); set {A}.ppo_mini_batch_size to choose")


def _derive_micro(cfg: HybridFlowConfig, who: str, mini: Optional[int], seqs_per_unit: int, dp: Optional[int], even: bool = False) -> None:
    """who: "actor" or "critic"; mini: its mini-batch (prompts or pairs, global); seqs_per_unit: rollout.n (2 for DPO pairs)."""
    section = cfg.actor_rollout_ref.actor if who == "actor" else cfg.critic
    if section.ppo_micro_batch_size_per_gpu is not None or dp is None or not (positive_int(mini) and positive_int(seqs_per_unit)):
        return
    if (mini * seqs_per_unit) % dp:
        return  # the validator refuses the mini-batch
    per_worker = mini * seqs_per_unit // dp
    micro = largest_divisor(per_worker, MICRO_BATCH_CAP, 2 if even else 1)
    if micro is None:
        return
    key = A if who == "actor" else "critic"
    mini_key = f"{key}.ppo_mini_batch_size" if who == "actor" or cfg.critic.ppo_mini_batch_size is not None else f"{A}.ppo_mini_batch_size"
    unit = "2 sequences a pair" if even else f"{R}.n {seqs_per_unit}"
    section.ppo_micro_batch_size_per_gpu = micro
    log_once(f"{who} micro batch {micro}: derived from the per-worker mini-batch of {per_worker} sequences ({mini_key} {mini} x {unit} / "
             f"{dp} data-parallel worker{'s' * (dp > 1)}), its largest {'even ' * even}divisor up to {MICRO_BATCH_CAP}; set "
             f"{key}.ppo_micro_batch_size_per_gpu to choose")


def derive_defaults(cfg: HybridFlowConfig, kind: str = "rl") -> HybridFlowConfig:
    """A copy of `cfg` with the unset (None) batch sizes derived from the layout and every
    mixed_precision resolved for trainer.device. kind: "rl" or "dpo"."""
    cfg = copy.deepcopy(cfg)
    arr = cfg.actor_rollout_ref
    _resolve_precisions([(f"{A}.fsdp_config", arr.actor.fsdp_config), ("actor_rollout_ref.ref.fsdp_config", arr.ref.fsdp_config),
                         ("critic.fsdp_config", cfg.critic.fsdp_config), ("reward_model.fsdp_config", cfg.reward_model.fsdp_config),
                         ("teacher.fsdp_config", cfg.teacher.fsdp_config)], cfg.trainer.device)
    _derive_n(cfg, kind)
    actor_dp, critic_dp = _data_parallel_sizes(cfg, kind)
    if actor_dp is None:
        return cfg
    a, n = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    _derive_mini(cfg, kind, actor_dp)
    if kind == "dpo":
        _derive_micro(cfg, "actor", a.ppo_mini_batch_size, 2, actor_dp, even=True)
        return cfg
    _derive_micro(cfg, "actor", a.ppo_mini_batch_size, n, actor_dp)
    if cfg.algorithm.adv_estimator == "gae":
        mini = a.ppo_mini_batch_size if cfg.critic.ppo_mini_batch_size is None else cfg.critic.ppo_mini_batch_size
        _derive_micro(cfg, "critic", mini, n, critic_dp)
    return cfg


def _workers(t) -> int:
    return t.nnodes * t.n_gpus_per_node if positive_int(t.nnodes) and positive_int(t.n_gpus_per_node) else 0


def derive_sft_defaults(cfg: SFTConfig) -> SFTConfig:
    """A copy of the SFT config with micro_batch_size_per_gpu derived when unset."""
    cfg = copy.deepcopy(cfg)
    workers = _workers(cfg.trainer)
    if cfg.micro_batch_size_per_gpu is None and workers and positive_int(cfg.train_batch_size) and cfg.train_batch_size % workers == 0:
        per_worker = cfg.train_batch_size // workers
        cfg.micro_batch_size_per_gpu = micro = largest_divisor(per_worker, SFT_MICRO_BATCH_CAP)
        log_once(f"SFT micro batch {micro}: derived from the {per_worker} sequences each worker gets (train_batch_size "
                 f"{cfg.train_batch_size} / {workers} workers), their largest divisor up to {SFT_MICRO_BATCH_CAP}; set "
                 f"micro_batch_size_per_gpu to choose")
    return cfg


def derive_rm_defaults(cfg: RewardTrainConfig) -> RewardTrainConfig:
    """A copy of the reward-model training config with micro_batch_size_per_gpu derived when unset
    and fsdp_config.mixed_precision resolved for trainer.device."""
    cfg = copy.deepcopy(cfg)
    _resolve_precisions([("fsdp_config", cfg.fsdp_config)], cfg.trainer.device)
    workers = _workers(cfg.trainer)
    if cfg.micro_batch_size_per_gpu is None and workers and positive_int(cfg.train_batch_size) and cfg.train_batch_size % workers == 0:
        per_worker = 2 * cfg.train_batch_size // workers
        cfg.micro_batch_size_per_gpu = micro = largest_divisor(per_worker, SFT_MICRO_BATCH_CAP, 2)
        log_once(f"reward-model micro batch {micro}: derived from the {per_worker} sequences each worker gets (both sides of "
                 f"train_batch_size {cfg.train_batch_size} pairs / {workers} workers), their largest even divisor up to "
                 f"{SFT_MICRO_BATCH_CAP}; set micro_batch_size_per_gpu to choose")
    return cfg

