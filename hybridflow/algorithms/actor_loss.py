"""The actor's PPO-family loss on one micro-batch, as a pure function of tensors and settings.

    loss = policy_loss(old_log_probs, log_prob, advantages)          (the registered loss_mode)
           - entropy_coeff * agg(entropy)                           (an entropy bonus)
           + kl_loss_coef * agg(KL(log_prob || ref_log_prob))        (use_kl_loss)

Every term is aggregated with the same loss_agg_mode over the loss mask: response_mask, times
rollout correction's rejection mask when there is one (`loss_mask`). Rollout correction's
importance weights multiply the advantages (every policy loss is homogeneous of degree one in
them). The worker scales the result by the micro-batch's share of its mini-batch (`micro_weight`)
and logs the parts.
"""

from __future__ import annotations

from typing import Mapping

import torch

from hybridflow.algorithms.kl import kl_loss
from hybridflow.algorithms.losses import PolicyLossFn, agg_loss


def ppo_actor_loss(log_prob: torch.Tensor, entropy_tok: torch.Tensor, mb: Mapping[str, torch.Tensor], *, policy_loss: PolicyLossFn,
                   clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float, loss_agg_mode: str, entropy_coeff: float = 0.0,
                   use_kl_loss: bool = False, kl_loss_type: str = "low_var_kl", kl_loss_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, {pg_loss, entropy, kl_loss when use_kl_loss, and the policy loss's own metrics}).

    log_prob / entropy_tok [b, R]; mb holds response_mask and advantages [b, R], old_log_probs
    (absent: one on-policy pass, this forward's own log-probs detached), ref_log_prob (use_kl_loss)
    and, with rollout correction, rollout_is_weights / rollout_rs_mask [b, R]."""
    mask = loss_mask(mb)
    old = mb["old_log_probs"] if "old_log_probs" in mb else log_prob.detach()
    adv = mb["advantages"] * mb["rollout_is_weights"] if "rollout_is_weights" in mb else mb["advantages"]
    pg_loss, metrics = policy_loss(old, log_prob, adv, mask, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                                   clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode)
    entropy = agg_loss(entropy_tok, mask, loss_agg_mode)
    loss = pg_loss - entropy_coeff * entropy
    parts = {"pg_loss": pg_loss, **metrics, "entropy": entropy}
    if use_kl_loss:
        parts["kl_loss"] = kl_loss(log_prob, mb["ref_log_prob"], mask, kl_loss_type, loss_agg_mode)
        loss = loss + kl_loss_coef * parts["kl_loss"]
    return loss, parts


def loss_mask(mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """[b, R] the tokens the loss counts: response_mask without rollout correction's rejected ones."""
    return mb["response_mask"] * mb["rollout_rs_mask"] if "rollout_rs_mask" in mb else mb["response_mask"]
