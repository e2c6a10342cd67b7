"""Rollout correction: importance weights and rejection masks between the rollout's behaviour
policy and the trainer's old policy (algorithm.rollout_correction; verl's decoupled mode).

The rollout samples from pi_rollout (another backend, precision or a stale policy version); PPO's
ratio is taken against pi_old (the trainer's log-probs before the update). The gradient is
unbiased for pi_old only after reweighting each sample by pi_old / pi_rollout. Per token t
(shapes [B, T], masked by response_mask), with d_t = old_log_prob_t - rollout_log_prob_t:

    token IS:       w_t = min(exp(d_t), threshold)
    sequence IS:    w_t = min(exp(sum_s d_s), threshold)            (the same on every token)
    token RS:       keep_t = lower <= exp(d_t) <= upper
    sequence RS:    keep_t = lower <= exp(sum_s d_s) <= upper
    geometric RS:   keep_t = lower <= exp(mean_s d_s) <= upper
    veto:           keep = 0 on every token of a sequence with any exp(d_t) < veto_threshold

Log-ratios are clamped to [-20, 20] before exp (verl's safety bound). The weights multiply the
advantages (every policy loss here is homogeneous of degree one in the advantage, so that equals
weighting each token's loss); rejected tokens leave the loss's mask (and its denominator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hybridflow.algorithms.losses import masked_mean, masked_sum

SAFETY_BOUND = 20.0


@dataclass(frozen=True)
class Correction:
    """The resolved settings (RolloutCorrectionConfig with "auto" decided)."""

    rollout_is: Optional[str] = None  # token | sequence | None
    is_threshold: float = 2.0
    rollout_rs: Optional[str] = None  # token | sequence | geometric | None
    rs_upper: float = 2.0
    rs_lower: float = 0.5
    veto_threshold: Optional[float] = None

    @property
    def active(self) -> bool:
        return bool(self.rollout_is or self.rollout_rs or self.veto_threshold)


def resolve(rc, async_rollout: bool) -> Correction:
    """RolloutCorrectionConfig -> Correction: rollout_is "auto" is token-level IS with async rollout, off otherwise."""
    rollout_is = ("token" if async_rollout else None) if rc.rollout_is == "auto" else rc.rollout_is
    lower, upper = rc.rs_bounds()
    return Correction(rollout_is, rc.rollout_is_threshold, rc.rollout_rs, upper, lower, rc.rollout_token_veto_threshold)


def correction_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       c: Correction) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(is_weights [B, T] (1 where IS is off; 0 on padding), keep [B, T] (the rejection mask, 0/1
    float, already times response_mask), metrics). Nothing here has a gradient."""
    mask = response_mask.float()
    d = ((old_log_probs - rollout_log_probs) * mask).detach()  # [B, T] log pi_old - log pi_rollout
    d_tok = d.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    d_seq = masked_sum(d, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B] log of the sequence's ratio product
    metrics: dict[str, float] = {}
    valid_tokens = mask.sum().clamp(min=1.0)
    seq_valid = (mask.sum(-1) > 0).float()  # [B]

    weights = mask.clone()
    if c.rollout_is == "token":
        raw = d_tok.exp()
        weights = raw.clamp(max=c.is_threshold) * mask
        metrics["rollout_corr/is_clipped_frac"] = float(((raw > c.is_threshold).float() * mask).sum() / valid_tokens)
    elif c.rollout_is == "sequence":
        raw = d_seq.exp()  # [B]
        weights = raw.clamp(max=c.is_threshold)[:, None] * mask
        metrics["rollout_corr/is_clipped_frac"] = float(((raw > c.is_threshold).float() * seq_valid).sum() / seq_valid.sum().clamp(min=1.0))
    if c.rollout_is:
        metrics["rollout_corr/is_weight_mean"] = float(weights.sum() / valid_tokens)
        metrics["rollout_corr/is_weight_max"] = float(weights.max())

    keep = mask.clone()
    if c.rollout_rs:
        if c.rollout_rs == "token":
            ratio = d_tok.exp()  # [B, T]
        else:
            log_r = d_seq if c.rollout_rs == "sequence" else masked_mean(d, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
            ratio = log_r.exp()[:, None].expand_as(mask)  # [B, T]
        inside = ((ratio >= c.rs_lower) & (ratio <= c.rs_upper)).float()
        keep = keep * inside
        metrics["rollout_corr/rs_masked_frac"] = float(((1 - inside) * mask).sum() / valid_tokens)
    if c.veto_threshold:
        vetoed = (((d_tok.exp() < c.veto_threshold).float() * mask).sum(-1) > 0).float()  # [B]
        keep = keep * (1 - vetoed)[:, None]
        metrics["rollout_corr/veto_frac"] = float((vetoed * seq_valid).sum() / seq_valid.sum().clamp(min=1.0))
    metrics["rollout_corr/kept_token_frac"] = float(keep.sum() / valid_tokens)
    return weights, keep, metrics
