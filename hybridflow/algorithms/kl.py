"""KL estimators between the policy and the reference model, and KL-coefficient controllers.

Per-token estimators of KL(pi || pi_ref) from sampled log-probs (see Schulman, "Approximating KL
Divergence"), with verl's names:

- ``k1`` / ``kl``:          lp - ref                      (unbiased, high variance, can be < 0)
- ``k2`` / ``mse``:         0.5 * (lp - ref)^2
- ``k3`` / ``low_var_kl``:  exp(ref - lp) - (ref - lp) - 1 (unbiased, >= 0), clamped to [-10, 10]
- ``abs``:                  |lp - ref|

`apply_kl_penalty` folds the estimate into the token rewards (``use_kl_in_reward``) and updates
the controller, like verl's ``ray_trainer.apply_kl_penalty``.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import numpy as np
import torch

from hybridflow.algorithms.losses import agg_loss, masked_mean


def _k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob - ref_log_prob


def _k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_prob - ref_log_prob).square()


def _k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    # Clamp the log-ratio before exp (as verl) so that a far-off token cannot overflow to inf.
    log_ratio = torch.clamp(ref_log_prob - log_prob, min=-20.0, max=20.0)
    kl = torch.exp(log_ratio) - log_ratio - 1.0
    return torch.clamp(kl, min=-10.0, max=10.0)


def _abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    return (log_prob - ref_log_prob).abs()


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "kl": _k1,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
    "abs": _abs,
}


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate [B, T] of the given kind (unmasked)."""
    try:
        fn = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}") from None
    return fn(log_prob, ref_log_prob)


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive coefficient (Ziegler et al. 2019): moves beta so that the KL tracks `target_kl`."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be positive, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        # Error clipped to +-20% so one noisy batch cannot move beta far.
        proportional_error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


KLController = Union[FixedKLController, AdaptiveKLController]


def make_kl_controller(type: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> KLController:
    """Controller from config (``algorithm.kl_ctrl``): type is "fixed" or "adaptive"."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type {type!r}; choose 'fixed' or 'adaptive'")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards [B, T] = scores - beta * kl * mask; then update the controller with the batch KL.

    The reported/used KL is the batch mean of each sequence's masked-mean token KL.
    """
    mask = response_mask.to(log_prob.dtype)
    kld = kl_penalty(log_prob, ref_log_prob, kind) * mask  # [B, T]
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, mask, dim=-1).mean().item()  # [B] -> scalar
    kl_ctrl.update(current_kl=current_kl, n_steps=int(token_level_scores.shape[0]))
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
) -> torch.Tensor:
    """KL-to-reference loss term (``use_kl_loss``): per-token estimate [B, T] aggregated to a scalar."""
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kind), response_mask, loss_agg_mode)
