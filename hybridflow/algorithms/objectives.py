"""Training objectives: each role's loss as a small object built once from its settings, which the
training engine (`TrainEngine.train`) calls per micro-batch. The engine owns the loop (epochs,
mini-batches, micro-batches, accumulation, steps, metric means); an objective owns the arithmetic.

    objective.mini_batch(mini)        -> ctx, or None to skip the mini-batch on every rank
    objective(out, mb, ctx)           -> (loss, metrics)

`out` is (log_prob [b, R], entropy [b, R]) for token objectives (`head = None`: the engine's token
head, pipeline-capable) or what the worker's head returns (values [b, R], sequence log-probs [b],
scores [b]). The loss is the micro-batch's SHARE of its mini-batch's loss, so the accumulated
gradient is the mini-batch's loss however it was cut. Metrics map a name to a value (weight 1) or
to (weighted sum, weight): the engine reports sum / weight over the update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Union

import torch
import torch.distributed as dist

from hybridflow.algorithms.actor_loss import loss_mask, ppo_actor_loss
from hybridflow.algorithms.losses import PolicyLossFn, get_loss, get_policy_loss, micro_weight
from hybridflow.algorithms.preference import dpo_loss, pair_metrics

Metric = Union[float, tuple[float, float]]  # a value (weight 1), or (weighted sum, weight)
Metrics = dict[str, Metric]


@dataclass(frozen=True)
class PPOLoss:
    """The actor's PPO-family loss (`ppo_actor_loss`) with its settings resolved once."""

    loss_mode: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    loss_agg_mode: str
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_type: str = "low_var_kl"
    kl_loss_coef: float = 0.0

    # The per-token fields the loss reads (packed as the pipeline's loss target when pp > 1).
    fields = ("old_log_probs", "advantages", "response_mask", "ref_log_prob", "rollout_is_weights", "rollout_rs_mask")
    remove_padding = None  # the engine's setting

    @classmethod
    def of(cls, actor) -> "PPOLoss":
        """From the actor's section (`ActorConfig`): clip_ratio_low / clip_ratio_high default to clip_ratio."""
        low = actor.clip_ratio_low if actor.clip_ratio_low is not None else actor.clip_ratio
        high = actor.clip_ratio_high if actor.clip_ratio_high is not None else actor.clip_ratio
        return cls(actor.policy_loss.loss_mode, low, high, actor.clip_ratio_c, actor.loss_agg_mode, actor.entropy_coeff,
                   actor.use_kl_loss, actor.kl_loss_type, actor.kl_loss_coef)

    @property
    def policy_loss(self) -> PolicyLossFn:
        return get_policy_loss(self.loss_mode)

    def mini_batch(self, mini: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return loss_mask(mini)  # [b, R]: the mini-batch's loss tokens, for each micro-batch's share

    def __call__(self, out: tuple[torch.Tensor, torch.Tensor], mb, mini_mask: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        log_prob, entropy = out
        loss, parts = ppo_actor_loss(log_prob, entropy, mb, policy_loss=self.policy_loss, clip_ratio_low=self.clip_ratio_low,
                                     clip_ratio_high=self.clip_ratio_high, clip_ratio_c=self.clip_ratio_c, loss_agg_mode=self.loss_agg_mode,
                                     entropy_coeff=self.entropy_coeff, use_kl_loss=self.use_kl_loss, kl_loss_type=self.kl_loss_type,
                                     kl_loss_coef=self.kl_loss_coef)
        share = micro_weight(loss_mask(mb), mini_mask.to(log_prob.device), self.loss_agg_mode)
        return loss * share, {f"actor/{k}": v.item() for k, v in parts.items()}


@dataclass(frozen=True)
class ValueLoss:
    """The critic's clipped value regression towards `returns`; out: values [b, R]."""

    cliprange_value: float
    loss_agg_mode: str
    fields = ()
    remove_padding = None

    def mini_batch(self, mini) -> torch.Tensor:
        return mini["response_mask"]

    def __call__(self, values: torch.Tensor, mb, mini_mask: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        vf_loss, clipfrac = get_loss("value", "clipped")(values, mb["returns"], mb["values"], mb["response_mask"],
                                                         cliprange_value=self.cliprange_value, loss_agg_mode=self.loss_agg_mode)
        share = micro_weight(mb["response_mask"], mini_mask, self.loss_agg_mode)
        return vf_loss * share, {"critic/vf_loss": vf_loss.item(), "critic/vf_clipfrac": clipfrac.item()}


@dataclass(frozen=True)
class DPOLoss:
    """DPO (and its registered variants) on interleaved pairs [c0, r0, c1, r1, ...]; out: sequence
    log-probs [2p]. The loss is the mean over the mini-batch's counted pairs (pair_weight 1) of
    every rank; a mini-batch of ties only is skipped by every rank together."""

    beta: float
    loss_type: str
    label_smoothing: float
    world_size: int
    fields = ()
    remove_padding = None

    def mini_batch(self, mini) -> torch.Tensor | None:
        w_global = mini["pair_weight"][0::2].sum()  # mini is on the engine's device
        if dist.is_initialized():
            dist.all_reduce(w_global)
        return None if float(w_global) == 0 else w_global

    def __call__(self, logps: torch.Tensor, mb, w_global: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        ref, weight = mb["ref_seq_log_prob"], mb["pair_weight"][0::2]
        losses, chosen_r, rejected_r = dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], self.beta, self.loss_type, self.label_smoothing)
        metrics: Metrics = {}
        keep = weight > 0
        if keep.any():
            n = float(keep.sum())
            m = pair_metrics(losses[keep], chosen_r[keep], rejected_r[keep], logps[0::2][keep], logps[1::2][keep])
            metrics = {k: (v * n, n) for k, v in m.items()}
        # FSDP2 averages gradients over ranks: x world makes the sum over ranks / global pairs.
        return (losses * weight).sum() / w_global.to(losses.device) * self.world_size, metrics


@dataclass(frozen=True)
class BradleyTerryLoss:
    """The reward model's -log sigma(r_c - r_r - margin) on interleaved pairs; out: scores [2p].
    One optimizer step per call (the whole batch is one mini-batch)."""

    margin: float = 0.0
    fields = ()
    remove_padding = None

    def mini_batch(self, mini) -> int:
        return len(mini)

    def __call__(self, scores: torch.Tensor, mb, rows: int) -> tuple[torch.Tensor, Metrics]:
        chosen, rejected = scores[0::2], scores[1::2]
        pair_loss = get_loss("reward", "bradley_terry")(chosen, rejected, self.margin + mb["margin"][0::2]).mean()
        n = len(mb)
        values = {"train/loss": pair_loss.item(), "train/accuracy": (chosen > rejected).float().mean().item(),
                  "rewards/chosen": chosen.mean().item(), "rewards/rejected": rejected.mean().item(),
                  "rewards/margins": (chosen - rejected).mean().item()}
        return pair_loss * n / rows, {k: (v * n, n) for k, v in values.items()}


@dataclass(frozen=True)
class SFTLoss:
    """Mean token NLL over the loss tokens (loss_mask [b, T]), every token weighing the same across
    the data-parallel ranks (normalised by the GLOBAL number of loss tokens of the mini-batch)."""

    dp_size: int
    dp_group: Any = None
    fields = ("loss_mask",)
    remove_padding = False  # SFT rows are right-padded and already trimmed to the rank's longest

    def mini_batch(self, mini) -> torch.Tensor:
        tokens = mini["loss_mask"].sum()
        if dist.is_initialized():
            dist.all_reduce(tokens, group=self.dp_group)
        return tokens

    def __call__(self, out: tuple[torch.Tensor, torch.Tensor], mb, global_tokens: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        log_prob, _ = out
        loss_sum = get_loss("sft", "nll")(log_prob, mb["loss_mask"])
        # FSDP2 averages gradients over dp ranks: x dp makes the result sum / global_tokens.
        return loss_sum * self.dp_size / global_tokens.to(loss_sum.device), {"train/loss": (loss_sum.item(), float(mb["loss_mask"].sum()))}

