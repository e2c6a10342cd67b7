"""Masked statistics and the PPO actor / critic losses (semantics of verl's core_algos.py).

Shapes: B = sequences, T = response tokens, V = vocabulary. ``response_mask`` [B, T] is 1 on
generated tokens and 0 on padding; every statistic ignores the masked positions.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from hybridflow.config.schema import LOSS_AGG_MODES
from hybridflow.config.validate import register_check


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of x over valid positions (all dims when dim is None)."""
    return (x * mask).sum() if dim is None else (x * mask).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of x over valid positions; 0 where nothing is valid (instead of nan)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1e-8)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all valid positions; unbiased (Bessel, n/(n-1)) by default, like verl."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    if unbiased:
        n = mask.sum()
        if n <= 1:
            raise ValueError(f"unbiased masked_var needs at least 2 valid elements, mask sums to {n.item()}")
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over valid positions; shift_mean=False adds the mean back."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    - token-mean:           sum over valid tokens / number of valid tokens (long answers weigh more)
    - seq-mean-token-sum:   per-sequence sum, mean over the B sequences
    - seq-mean-token-mean:  per-sequence mean, mean over the B sequences (an empty one counts as 0)
    - seq-mean-token-sum-norm: Dr. GRPO: per-sequence sum over a CONSTANT, T (the response tensor's
      length, data.max_response_length), mean over the B sequences: no length bias either way
      (verl sums over the sequences instead of averaging; here a micro-batch's share is its sequences')
    """
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked_sum(loss_mat, loss_mask, dim=-1).mean()
    if loss_agg_mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, loss_mask, dim=-1).mean()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return masked_sum(loss_mat, loss_mask, dim=-1).mean() / loss_mask.shape[-1]
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {list(LOSS_AGG_MODES)}")


def micro_weight(mb_mask: torch.Tensor, mini_mask: torch.Tensor, loss_agg_mode: str) -> float:
    """The share of a micro-batch's loss in its mini-batch's, so the accumulated gradient is the
    mini-batch loss however the mini-batch is cut (fixed or token-budget micro-batches): its share of
    the valid tokens for token-mean, of the sequences otherwise. masks: response_mask [b, R]."""
    if loss_agg_mode == "token-mean":
        return float(mb_mask.sum()) / max(1.0, float(mini_mask.sum()))
    return len(mb_mask) / len(mini_mask)


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate with dual clip (verl "vanilla"); all inputs [B, T].

    Returns (pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower), all scalars.
    clip_ratio_high > clip_ratio_low is DAPO's clip-higher; clip_ratio_c bounds the loss of
    negative-advantage tokens whose ratio exploded (dual-clip PPO).
    """
    assert clip_ratio_c > 1.0, f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}"
    # Clamp the log-ratio so exp cannot overflow when the policies diverge.
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((torch.gt(clip_pg_losses1, pg_losses3) & negative).float(), response_mask)

    pg_losses = torch.where(negative, clip_pg_losses2, clip_pg_losses1)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


# ---------------------------------------------------------------- losses, by family and name
# Every loss is a pure function registered under (family, name); a worker looks it up by the
# config's name and calls it per micro-batch, so a new loss is one registered function here (or in
# a user's module imported before the run). Families and their signatures:
#   "policy"      (old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low, clip_ratio_high,
#                  clip_ratio_c, loss_agg_mode, **_) -> (pg_loss, {name: scalar}) logged as actor/<name>;
#                  chosen by `actor_rollout_ref.actor.policy_loss.loss_mode` (verl's key)
#   "value"       (vpreds, returns, values, response_mask, *, cliprange_value, loss_agg_mode) -> (vf_loss, vf_clipfrac)
#   "sft"         (log_prob [B, T], loss_mask [B, T]) -> summed NLL (the caller normalises)
#   "preference"  (policy_chosen, policy_rejected, ref_chosen, ref_rejected [P], *, beta, label_smoothing)
#                  -> per-pair losses [P]; chosen by `dpo.loss_type`
#   "reward"      (chosen_scores, rejected_scores [P], margin) -> per-pair losses [P]
# All inputs [B, T] unless stated; a loss takes the keyword arguments it needs and ignores the rest (**_).
LossFn = Callable[..., object]
PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
LOSSES: dict[str, dict[str, LossFn]] = {"policy": {}, "value": {}, "sft": {}, "preference": {}, "reward": {}}
POLICY_LOSSES: dict[str, PolicyLossFn] = LOSSES["policy"]
_LOSS_KEYS = {"policy": "actor_rollout_ref.actor.policy_loss.loss_mode", "preference": "dpo.loss_type"}


def register_loss(family: str, name: str) -> Callable[[LossFn], LossFn]:
    if family not in LOSSES:
        raise ValueError(f"unknown loss family {family!r}; families: {sorted(LOSSES)}")

    def deco(fn: LossFn) -> LossFn:
        if name in LOSSES[family]:
            raise ValueError(f"{family} loss {name!r} is already registered")
        LOSSES[family][name] = fn
        return fn

    return deco


def get_loss(family: str, name: str) -> LossFn:
    if name not in LOSSES.get(family, {}):
        key = f" ({_LOSS_KEYS[family]})" if family in _LOSS_KEYS else ""
        raise ValueError(f"unknown {family} loss {name!r}{key}; registered: {sorted(LOSSES.get(family, {}))}")
    return LOSSES[family][name]


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    return register_loss("policy", name)


def get_policy_loss(name: str) -> PolicyLossFn:
    return get_loss("policy", name)


@register_check("policy_losses")
def policy_loss_names() -> list[str]:
    """actor_rollout_ref.actor.policy_loss.loss_mode's choices, for the config validator."""
    return sorted(POLICY_LOSSES)


@register_policy_loss("vanilla")
def vanilla_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
                        clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                        loss_agg_mode: str = "token-mean", **_) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with clip-higher and dual clip (`compute_policy_loss`)."""
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low,
                                                                    clip_ratio_high, clip_ratio_c, loss_agg_mode)
    return pg_loss, {"pg_clipfrac": clipfrac, "ppo_kl": ppo_kl, "pg_clipfrac_lower": clipfrac_lower}


@register_policy_loss("gspo")
def gspo_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
                     clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, **_) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, s_i = exp(mean_t (log_prob - old)),
    clipped to [1 - low, 1 + high] like PPO's, and the loss averaged per sequence (seq-mean-token-mean,
    whatever loss_agg_mode says). Each token's gradient is s_i * grad log_prob_t / |o_i|: the ratio's
    value is the sequence's, its gradient the token's (log_prob - sg(log_prob) + sg(mean log-ratio)).
    GSPO's paper clips at 3e-4 / 4e-4 (clip_ratio_low / clip_ratio_high)."""
    log_ratio = log_prob - old_log_prob  # [B, T]
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)  # [B]
    log_s = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    s = torch.exp(log_s)  # [B, T]: every token of sequence i holds s_i
    pg_losses1 = -advantages * s
    pg_losses2 = -advantages * torch.clamp(s, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_loss = agg_loss(torch.maximum(pg_losses1, pg_losses2), response_mask, "seq-mean-token-mean")
    return pg_loss, {"pg_clipfrac": masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask),
                     "ppo_kl": masked_mean(-log_ratio, response_mask)}


@register_policy_loss("cispo")
def cispo_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
                      clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, loss_agg_mode: str = "token-mean",
                      **_) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): -sg(clip(ratio, 1 - low, 1 + high)) * A * log_prob per token. The
    importance weight is clipped and detached, so no token is dropped from the gradient (PPO's clip
    zeroes it) and the gradient flows only through log_prob: A * w * grad log_prob."""
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    pg_loss = agg_loss(-advantages * weight * log_prob, response_mask, loss_agg_mode)
    return pg_loss, {"pg_clipfrac": masked_mean(torch.ne(weight, ratio).float(), response_mask), "ppo_kl": masked_mean(-log_ratio, response_mask)}


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * max((v - R)^2, (v_clip - R)^2); inputs [B, T].

    v_clip keeps the new prediction within cliprange_value of the rollout-time value.
    Returns (vf_loss, vf_clipfrac).
    """
    vpredclipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpredclipped - returns).square()
    vf_loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


@register_loss("value", "clipped")
def clipped_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *,
                       cliprange_value: float, loss_agg_mode: str = "token-mean", **_) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value regression (`compute_value_loss`), verl's critic loss."""
    return compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode)


@register_loss("sft", "nll")
def sft_nll_loss(log_prob: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Summed negative log-likelihood of the loss tokens: sum(-log p * mask) over [B, T]."""
    return (-log_prob * loss_mask).sum()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [...] of softmax(logits [..., V]) = logsumexp(z) - sum(softmax(z) * z), in fp32 (bf16 logits too)."""
    logits = logits.float()
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (pd * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels) [B, T] from logits [B, T, V], computed in fp32 for accuracy."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
