"""Per-step data metrics with verl's names (scores, rewards, advantages, lengths, throughput)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hybridflow.algorithms import masked_mean
from hybridflow.protocol import Batch


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.float()
    return {f"{prefix}/mean": float(x.mean()), f"{prefix}/max": float(x.max()), f"{prefix}/min": float(x.min())}


def compute_data_metrics(batch: Batch, world_size: int, step_seconds: float) -> dict[str, float]:
    mask = batch["response_mask"].float()  # [B, R]
    valid = mask.bool()
    resp_len = mask.sum(-1)  # [B]
    prompt_len = batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1).float()
    max_resp = batch["responses"].shape[1]
    m: dict[str, float] = {}
    m.update(_stats("critic/score", batch["token_level_scores"].sum(-1)))
    m.update(_stats("critic/rewards", batch["token_level_rewards"].sum(-1)))
    m.update(_stats("critic/advantages", batch["advantages"][valid]))
    m.update(_stats("critic/returns", batch["returns"][valid]))
    if "values" in batch:
        m.update(_stats("critic/values", batch["values"][valid]))
    m.update(_stats("response_length", resp_len))
    m["response_length/clip_ratio"] = float((resp_len >= max_resp).float().mean())
    m.update(_stats("prompt_length", prompt_len))
    # Async rollout: only the tokens sampled with the weights the trainer holds (rollout_policy_version
    # == trainer_version) compare the two engines, and only when the trainer recomputed the old
    # log-probs (not when they are the rollout's own: the bypass mode).
    same_weights = mask
    if "rollout_policy_version" in batch:
        same_weights = mask * (batch["rollout_policy_version"] == batch.meta.get("trainer_version", -2))
    recomputed = batch.meta.get("old_log_probs") != "rollout"
    if ("rollout_untruncated_log_probs" in batch and "old_log_probs" in batch and recomputed and same_weights.any()
            and batch.meta.get("temperature", 1.0) > 0):
        # Rollout engine vs training engine log-probs of the sampled tokens (same weights), both
        # under the temperature alone: the backends' truncation (top-p / top-k) is not a mismatch.
        diff = (batch["rollout_untruncated_log_probs"] - batch["old_log_probs"]).abs() * same_weights
        m["rollout/logprob_diff_max"] = float(diff.max())
        m["rollout/logprob_diff_mean"] = float(masked_mean(diff, same_weights))
        m["rollout/logprob_diff_p99"] = float(torch.quantile(diff[same_weights.bool()].double(), 0.99))
    tokens = float(batch["attention_mask"].sum())
    m["perf/total_num_tokens"] = tokens
    m["perf/throughput"] = tokens / max(step_seconds, 1e-9) / world_size  # tokens/s per worker
    return m


@dataclass
class MismatchAlarm:
    """Flags a step whose train-rollout mismatch jumps: `rollout/logprob_diff_max` over `factor` times
    the median of the last `window` steps' (at least 3 of them; a zero median - the exact mode - makes
    any non-zero value a jump). Its history is part of the trainer's checkpoint, so the first step
    after a resume is judged against the steps before it (the failure slime reported)."""

    factor: float = 10.0  # trainer.mismatch_alarm_factor; 0 = off
    window: int = 10
    history: list[float] = field(default_factory=list)

    def check(self, step: int, metrics: dict[str, float]) -> str | None:
        """Adds rollout/logprob_diff_alarm to `metrics` on a step that has the mismatch metric; the
        warning's text when it fires."""
        value = metrics.get("rollout/logprob_diff_max")
        if value is None or self.factor <= 0:
            return None
        past = self.history[-self.window:]
        median = float(np.median(past)) if len(past) >= 3 else None
        fired = median is not None and value > self.factor * median and value > 0
        self.history = [*past, value]
        metrics["rollout/logprob_diff_alarm"] = float(fired)
        if not fired:
            return None
        return (f"step {step}: rollout/logprob_diff_max jumped to {value:.3g}, over {self.factor:g}x the median {median:.3g} of the "
                f"previous {len(past)} steps (trainer.mismatch_alarm_factor). The rollout no longer samples what the trainer "
                f"computes: after a resume or a weight sync change, check the sync; `hybridflow mismatch RUN_DIR --step {step}` "
                f"finds the first layer that differs")
