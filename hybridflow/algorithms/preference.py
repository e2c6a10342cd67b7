"""Preference losses as small pure functions: DPO (sigmoid), IPO, hinge, conservative DPO, and
the Bradley-Terry reward-model loss.

Inputs are per-PAIR sequence log-probabilities [P] (sum of the response tokens' log-probs, or their
mean for IPO: `seq_log_probs(..., average=True)`), of the policy and of the frozen reference.
With h = (pi_c - pi_r) - (ref_c - ref_r) (the policy's log-ratio margin over the reference's):

    sigmoid (DPO, Rafailov et al. 2023):   -log sigma(beta h)
    conservative DPO (label_smoothing e):  -(1-e) log sigma(beta h) - e log sigma(-beta h)
    ipo (Azar et al. 2023):                 (h - 1/(2 beta))^2
    hinge (SLiC, Zhao et al. 2023):         max(0, 1 - beta h)

The implicit rewards are beta (pi - ref) per side (TRL's `rewards/chosen`, `rewards/rejected`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.algorithms.losses import get_loss, register_loss


def seq_log_probs(token_log_probs: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """[B, R] token log-probs and response mask -> [B] per-sequence sum (or mean over the mask)."""
    mask = mask.to(token_log_probs.dtype)
    total = (token_log_probs * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1.0) if average else total


@register_loss("preference", "sigmoid")
def dpo_sigmoid_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta: float = 0.1, label_smoothing: float = 0.0, **_) -> torch.Tensor:
    """DPO (conservative with label_smoothing e): -(1-e) log sigma(beta h) - e log sigma(-beta h)."""
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    return -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing


@register_loss("preference", "ipo")
def ipo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta: float = 0.1, **_) -> torch.Tensor:
    """IPO: (h - 1/(2 beta))^2."""
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    return (h - 1 / (2 * beta)) ** 2


@register_loss("preference", "hinge")
def hinge_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta: float = 0.1, **_) -> torch.Tensor:
    """SLiC's hinge: max(0, 1 - beta h)."""
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    return torch.relu(1 - beta * h)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses [P] of the registered preference loss `loss_type` and the implicit rewards
    (chosen [P], rejected [P], detached)."""
    losses = get_loss("preference", loss_type)(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=beta, label_smoothing=label_smoothing)
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


@register_loss("reward", "bradley_terry")
def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, margin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Per-pair reward-model loss [P]: -log sigma(r_c - r_r - margin) (Llama 2's margin term)."""
    return -F.logsigmoid(chosen_scores - rejected_scores - margin)


def pair_metrics(losses: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                 policy_chosen: torch.Tensor, policy_rejected: torch.Tensor) -> dict[str, float]:
    """TRL's DPO metric names, means over the pairs given."""
    return {
        "train/loss": losses.mean().item(),
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        "logps/chosen": policy_chosen.detach().mean().item(),
        "logps/rejected": policy_rejected.detach().mean().item(),
    }
