"""Advantage estimators: small pure functions in a registry (semantics of verl's core_algos.py).

Every estimator has the same keyword signature so the trainer can call any of them uniformly::

    adv, returns = get_adv_estimator(name)(token_level_rewards, response_mask, index=..., values=...,
                                           reward_baselines=..., gamma=..., lam=...)

Inputs/outputs are [B, T] over response tokens; outputs are zero on masked positions. ``index``
([B] array) holds a group id per sample (samples of the same prompt share it) for the
group-relative estimators (GRPO, RLOO).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from hybridflow.algorithms.losses import masked_whiten
from hybridflow.config.validate import register_check

AdvEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: dict[str, AdvEstimator] = {}


def register_adv_estimator(name: str) -> Callable[[AdvEstimator], AdvEstimator]:
    """Decorator adding an estimator to ADV_ESTIMATORS under `name`."""

    def deco(fn: AdvEstimator) -> AdvEstimator:
        if name in ADV_ESTIMATORS and ADV_ESTIMATORS[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        return fn

    return deco


def get_adv_estimator(name: str) -> AdvEstimator:
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise KeyError(f"unknown advantage estimator {name!r}; registered: {sorted(ADV_ESTIMATORS)}") from None


@register_check("adv_estimators")
def adv_estimator_names() -> list[str]:
    """algorithm.adv_estimator's choices, for the config validator."""
    return sorted(ADV_ESTIMATORS)


def _group_ids(index: Any, batch_size: int) -> torch.Tensor:
    """Map arbitrary hashable group ids [B] to dense ints 0..G-1 (order of first appearance)."""
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} entries but the batch has {batch_size}")
    dense: dict[Any, int] = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in index], dtype=torch.long)


def _group_mean_std(scores: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group size, mean and unbiased std of `scores` [B] within its group, each [B],
    in float64: a group of equal fractional scores (eight samples at 0.7) must get a mean equal to
    each score and a std of exactly 0 (float32 rounding leaves ~1e-8, which / (std + eps) turns
    into advantages of +-0.06). Callers subtract in float64 too.

    Groups of size 1 get mean 0 and std 1 (verl), so a lone sample keeps its raw score.
    """
    scores = scores.double()
    num_groups = int(gid.max().item()) + 1
    count = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, gid, torch.ones_like(scores))
    total = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, gid, scores)
    mean = total / count
    sq_dev = torch.zeros(num_groups, dtype=scores.dtype).index_add_(0, gid, (scores - mean[gid]).square())
    std = (sq_dev / (count - 1).clamp_min(1)).sqrt()
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return count[gid], mean[gid], std[gid]


@register_adv_estimator("gae")
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **_ignored: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}; whitened.

    Padding is skipped like current verl: at a masked position the running next-value and
    running advantage are carried through unchanged, so V_{t+1} is the value of the next *valid*
    token (0 after the last one). returns = A + V (before whitening).
    """
    if values is None:
        raise ValueError("gae needs `values` (critic values [B, T]); is the critic enabled?")
    with torch.no_grad():
        mask = response_mask.to(values.dtype)
        next_values = torch.zeros_like(values[:, 0])  # [B]
        last_gae = torch.zeros_like(values[:, 0])  # [B]
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[1])):
            delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
            gae_t = delta + gamma * lam * last_gae
            m = mask[:, t]
            next_values = values[:, t] * m + (1 - m) * next_values
            last_gae = gae_t * m + (1 - m) * last_gae
            advantages[:, t] = last_gae
        returns = (advantages + values) * mask
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns


@register_adv_estimator("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Optional[np.ndarray] = None,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **_ignored: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (score - group mean) / (group std + eps) per sample, broadcast over its tokens.

    score = sum of token rewards; std is unbiased; Dr.GRPO sets norm_adv_by_std_in_grpo=False.
    """
    if index is None:
        raise ValueError("grpo needs `index` (a group id per sample, e.g. the prompt uid)")
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [B]
        _, mean, std = _group_mean_std(scores, _group_ids(index, scores.shape[0]).to(scores.device))
        adv = scores.double() - mean
        if norm_adv_by_std_in_grpo:
            adv = adv / (std + epsilon)
        advantages = adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask  # [B, T]
    return advantages, advantages


@register_adv_estimator("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Optional[np.ndarray] = None,
    **_ignored: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score_i minus the mean score of the *other* samples of its group.

    score_i - (sum - score_i)/(n-1) = score_i * n/(n-1) - mean * n/(n-1); size-1 groups keep
    their raw score.
    """
    if index is None:
        raise ValueError("rloo needs `index` (a group id per sample, e.g. the prompt uid)")
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)  # [B]
        n, mean, _ = _group_mean_std(scores, _group_ids(index, scores.shape[0]).to(scores.device))
        scale = n / (n - 1).clamp_min(1)
        adv = torch.where(n > 1, scores.double() * scale - mean * scale, scores.double())
        advantages = adv.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    **_ignored: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go per token, whitened over the whole batch.

    The running return is reset to 0 at masked positions (as verl), so nothing flows backwards
    from padding into the response.
    """
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])  # [B]
        for t in reversed(range(token_level_rewards.shape[1])):
            running = token_level_rewards[:, t] + gamma * running
            returns[:, t] = running
            running = running * mask[:, t]
        returns = returns * mask
        advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_estimator("remax")
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    reward_baselines: Optional[torch.Tensor] = None,
    **_ignored: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: return-to-go (undiscounted) minus the reward of the greedy baseline response [B]."""
    if reward_baselines is None:
        raise ValueError("remax needs `reward_baselines` [B] (reward of the greedy response per prompt)")
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        # Reverse cumulative sum over tokens: returns[t] = sum_{s >= t} r_s.
        returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
        advantages = (returns - reward_baselines.to(returns.dtype).unsqueeze(-1)) * mask
    return advantages, returns


@register_adv_estimator("on_policy_distill")
def compute_on_policy_distill_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    teacher_log_prob: Optional[torch.Tensor] = None,
    old_log_probs: Optional[torch.Tensor] = None,
    **_ignored: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): each sampled token's
    advantage is minus its reverse-KL estimate, log pi_teacher(t) - log pi_student(t), with no
    discount, baseline or reward: the student raises the tokens the teacher likes more than it
    does. [B, T] inputs; returns = advantages."""
    if teacher_log_prob is None or old_log_probs is None:
        raise ValueError("on_policy_distill needs `teacher_log_prob` and `old_log_probs` [B, T] (a teacher role and the old-log-prob pass)")
    with torch.no_grad():
        advantages = (teacher_log_prob - old_log_probs).to(token_level_rewards.dtype) * response_mask
    return advantages, advantages
