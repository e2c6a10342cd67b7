"""What each role's update does with the rows it receives, resolved once from the config.

`UpdatePlan` is per data-parallel rank: the training engine (`TrainEngine.train`) walks a call's
rows with it (epochs x mini-batches, each one optimizer step, cut into micro-batches), so no worker
loops over mini-batches and the sizes are computed in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hybridflow.config.schema import HybridFlowConfig


@dataclass(frozen=True)
class UpdatePlan:
    """micro_rows: rows per forward/backward (or max_tokens: a token budget per micro-batch instead,
    dynamic batch size); mini_rows: rows per optimizer step on this rank (None: the whole call is one
    step); epochs: passes over the call's rows; metric_prefix: where grad_norm / lr are reported."""

    micro_rows: int
    mini_rows: Optional[int] = None
    epochs: int = 1
    max_tokens: Optional[int] = None
    metric_prefix: str = "actor"

    def __post_init__(self):
        for name in ("micro_rows", "epochs") + (("mini_rows",) if self.mini_rows is not None else ()):
            if getattr(self, name) < 1:
                raise ValueError(f"UpdatePlan.{name} must be >= 1, got {getattr(self, name)}")


def mini_rows(prompts: int, n: int, dp: int) -> int:
    """Rows (sequences) per data-parallel rank in a mini-batch of `prompts` prompts x n samples."""
    return prompts * n // dp


def actor_update_plan(cfg: HybridFlowConfig, dp: int) -> UpdatePlan:
    """The PPO actor's: ppo_mini_batch_size prompts x rollout.n samples per step over dp ranks."""
    a = cfg.actor_rollout_ref.actor
    return UpdatePlan(micro_rows=a.ppo_micro_batch_size_per_gpu, mini_rows=mini_rows(a.ppo_mini_batch_size, cfg.actor_rollout_ref.rollout.n, dp),
                      epochs=a.ppo_epochs, max_tokens=a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None, metric_prefix="actor")


def critic_update_plan(cfg: HybridFlowConfig, dp: int) -> UpdatePlan:
    """The critic's: its own mini-batch (default the actor's) over its own dp ranks."""
    c = cfg.critic
    prompts = c.ppo_mini_batch_size or cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    return UpdatePlan(micro_rows=c.ppo_micro_batch_size_per_gpu, mini_rows=mini_rows(prompts, cfg.actor_rollout_ref.rollout.n, dp),
                      epochs=c.ppo_epochs, metric_prefix="critic")


def dpo_update_plan(cfg: HybridFlowConfig, world: int) -> UpdatePlan:
    """DPO's: actor.ppo_mini_batch_size PAIRS (2 rows each) per step over the group."""
    a = cfg.actor_rollout_ref.actor
    return UpdatePlan(micro_rows=a.ppo_micro_batch_size_per_gpu, mini_rows=mini_rows(a.ppo_mini_batch_size, 2, world), metric_prefix="actor")


def sft_update_plan(cfg: HybridFlowConfig) -> UpdatePlan:
    """SFT on the actor worker: one optimizer step per call."""
    return UpdatePlan(micro_rows=cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, metric_prefix="train")
