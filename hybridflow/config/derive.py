"""Sizes the user left unset, derived from the layout before validation (logged once each).

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

A value the user set is never changed: the validator checks it and refuses it with the fix. When the
layout itself is invalid (workers that do not divide the batch, ...) nothing is derived and the
validator reports the real problem.
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

from hybridflow.config import pools as rp
from hybridflow.config.schema import (MICRO_BATCH_CAP, MINI_BATCH_CAP, SFT_MICRO_BATCH_CAP, HybridFlowConfig, RewardTrainConfig,
                                      SFTConfig)

__all__ = ["derive_defaults", "derive_rm_defaults", "derive_sft_defaults", "largest_divisor", "log_once"]

logger = logging.getLogger("hybridflow")
_LOGGED: set[str] = set()

A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


def log_once(message: str) -> None:
    """Log `message` at INFO the first time this process derives it (a trainer built twice logs it once)."""
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)


def largest_divisor(n: int, cap: int, step: int = 1) -> Optional[int]:
    """The largest multiple of `step` that divides `n` and is <= `cap` (None when there is none)."""
    return next((d for d in range(min(n, cap), 0, -1) if n % d == 0 and d % step == 0), None)


def _pos(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _data_parallel_sizes(cfg: HybridFlowConfig, kind: str) -> tuple[Optional[int], Optional[int]]:
    """(actor dp, critic dp): the ranks a training batch is split over (workers / (pp x tp)); None
    where the pools or the layout do not fit (the validator says why). The pool sizes are the
    validator's "pools" check's (`controller/checks.py` over the same `config/pools.py` rules)."""
    try:
        roles = rp.run_roles(cfg, kind)
        if rp.pool_problems(cfg, roles):
            return None, None
        actor_workers, critic_workers = rp.role_world_size(cfg, rp.Role.ACTOR_ROLLOUT, roles), rp.role_world_size(cfg, rp.Role.CRITIC, roles)
    except (TypeError, ValueError, KeyError):  # sizes of the wrong type: the validator names them
        return None, None
    a, c = cfg.actor_rollout_ref.actor, cfg.critic
    actor_dp = critic_dp = None
    if _pos(a.tensor_model_parallel_size) and _pos(a.pipeline_model_parallel_size) and _pos(actor_workers):
        split = a.tensor_model_parallel_size * a.pipeline_model_parallel_size
        actor_dp = actor_workers // split if actor_workers % split == 0 else None
    if _pos(c.tensor_model_parallel_size) and _pos(critic_workers) and critic_workers % c.tensor_model_parallel_size == 0:
        critic_dp = critic_workers // c.tensor_model_parallel_size
    return actor_dp, critic_dp


def _derive_mini(cfg: HybridFlowConfig, kind: str, dp: int) -> None:
    d, a, n = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    if a.ppo_mini_batch_size is not None or not (_pos(d.train_batch_size) and _pos(n)):
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
    if section.ppo_micro_batch_size_per_gpu is not None or dp is None or not (_pos(mini) and _pos(seqs_per_unit)):
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
    """A copy of `cfg` with the unset (None) batch sizes derived from the layout. kind: "rl" or "dpo"."""
    cfg = copy.deepcopy(cfg)
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
    return t.nnodes * t.n_gpus_per_node if _pos(t.nnodes) and _pos(t.n_gpus_per_node) else 0


def derive_sft_defaults(cfg: SFTConfig) -> SFTConfig:
    """A copy of the SFT config with micro_batch_size_per_gpu derived when unset."""
    cfg = copy.deepcopy(cfg)
    workers = _workers(cfg.trainer)
    if cfg.micro_batch_size_per_gpu is None and workers and _pos(cfg.train_batch_size) and cfg.train_batch_size % workers == 0:
        per_worker = cfg.train_batch_size // workers
        cfg.micro_batch_size_per_gpu = micro = largest_divisor(per_worker, SFT_MICRO_BATCH_CAP)
        log_once(f"SFT micro batch {micro}: derived from the {per_worker} sequences each worker gets (train_batch_size "
                 f"{cfg.train_batch_size} / {workers} workers), their largest divisor up to {SFT_MICRO_BATCH_CAP}; set "
                 f"micro_batch_size_per_gpu to choose")
    return cfg


def derive_rm_defaults(cfg: RewardTrainConfig) -> RewardTrainConfig:
    """A copy of the reward-model training config with micro_batch_size_per_gpu derived when unset."""
    cfg = copy.deepcopy(cfg)
    workers = _workers(cfg.trainer)
    if cfg.micro_batch_size_per_gpu is None and workers and _pos(cfg.train_batch_size) and cfg.train_batch_size % workers == 0:
        per_worker = 2 * cfg.train_batch_size // workers
        cfg.micro_batch_size_per_gpu = micro = largest_divisor(per_worker, SFT_MICRO_BATCH_CAP, 2)
        log_once(f"reward-model micro batch {micro}: derived from the {per_worker} sequences each worker gets (both sides of "
                 f"train_batch_size {cfg.train_batch_size} pairs / {workers} workers), their largest even divisor up to "
                 f"{SFT_MICRO_BATCH_CAP}; set micro_batch_size_per_gpu to choose")
    return cfg

