"""The RL stages that run on the driver: the reward (rule and/or reward model) and the advantages.

Pure functions of the batch and the config; `RLTrainer.build_dataflow` binds them into stages.
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridflow.algorithms import apply_kl_penalty, get_adv_estimator
from hybridflow.algorithms.rollout_correction import Correction, correction_weights
from hybridflow.config.schema import AlgorithmConfig, RewardModelConfig
from hybridflow.protocol import Batch
from hybridflow.rewards.manager import last_token_index


def reward(batch: Batch, reward_fn: Callable, rm: RewardModelConfig, use_rm: bool, max_response_length: int = 0) -> Batch:
    """token_level_scores [B, R]: the rule reward, or with a reward model
    score_weight * rm_scores + rule_weight * rule (rule_weight 0: the rule is not run); plus a
    multi-turn trajectory's own reward (tools, environment: `agent_reward` [B]) and DAPO's overlong
    penalty (reward_model.overlong_buffer) on its last model token."""
    if not use_rm:
        scores, metrics = reward_fn(batch)
    else:
        scores, metrics = rm.score_weight * batch["rm_scores"], {}
        if rm.rule_weight:
            rule, metrics = reward_fn(batch)
            scores = scores + rm.rule_weight * rule
    scores = with_agent_reward(scores, batch)
    ob = rm.overlong_buffer
    if ob.enable:
        penalty = overlong_penalty(batch["response_mask"].sum(-1), max_response_length, ob.len, ob.penalty_factor)  # [B]
        scores = scores.clone()
        scores[torch.arange(len(scores)), last_token_index(batch["response_mask"])] += penalty.to(scores.dtype)
        metrics = {**metrics, "reward/overlong_penalty/mean": float(penalty.mean())}
        if ob.log:  # verl's overlong_buffer.log: the per-sample detail too (how many were cut, the worst cut)
            metrics.update({"reward/overlong_frac": float((penalty < 0).float().mean()), "reward/overlong_penalty/min": float(penalty.min())})
    return Batch.from_dict(tensors={"token_level_scores": scores}, meta={"metrics": metrics})


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_len: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment per response [B]: 0 up to max_length - buffer_len tokens, then
    -(length - (max_length - buffer_len)) / buffer_len * factor, reaching -factor at max_length."""
    exceed = lengths.float() - (max_length - buffer_len)
    return torch.clamp(-exceed / buffer_len * factor, max=0.0)


def with_agent_reward(scores: torch.Tensor, batch: Batch) -> torch.Tensor:
    """scores [B, R] plus a multi-turn trajectory's own reward (`agent_reward` [B], from its tools or
    environment) on its last model token; unchanged for a batch without one."""
    if "agent_reward" not in batch:
        return scores
    scores = scores.clone()
    scores[torch.arange(len(scores)), last_token_index(batch["response_mask"])] += batch["agent_reward"].to(scores.dtype)
    return scores


def advantage(batch: Batch, a: AlgorithmConfig, kl_ctrl) -> Batch:
    """token_level_rewards (the scores, minus the KL penalty with algorithm.use_kl_in_reward),
    advantages and returns by algorithm.adv_estimator."""
    metrics: dict[str, float] = {}
    rewards = batch["token_level_scores"]
    if a.use_kl_in_reward:
        rewards, metrics = apply_kl_penalty(rewards, batch["old_log_probs"], batch["ref_log_prob"], batch["response_mask"], kl_ctrl, a.kl_penalty)
    adv, returns = get_adv_estimator(a.adv_estimator)(
        rewards,
        batch["response_mask"],
        index=batch["uid"],
        values=batch["values"] if "values" in batch else None,
        reward_baselines=batch["reward_baselines"] if "reward_baselines" in batch else None,
        teacher_log_prob=batch["teacher_log_prob"] if "teacher_log_prob" in batch else None,
        old_log_probs=batch["old_log_probs"] if "old_log_probs" in batch else None,
        gamma=a.gamma,
        lam=a.lam,
        norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
    )
    return Batch.from_dict(tensors={"token_level_rewards": rewards, "advantages": adv, "returns": returns}, meta={"metrics": metrics})


def advantage_inputs(a: AlgorithmConfig, use_critic: bool) -> list[str]:
    """What `advantage` reads for this algorithm."""
    return (["token_level_scores", "response_mask", "uid"] + (["old_log_probs", "ref_log_prob"] if a.use_kl_in_reward else [])
            + (["values"] if use_critic else []) + (["reward_baselines"] if a.adv_estimator == "remax" else [])
            + (["teacher_log_prob", "old_log_probs"] if a.adv_estimator == "on_policy_distill" else []))


def behaviour_log_probs(batch: Batch) -> Batch:
    """Async rollout: the PPO ratio is against the policy that sampled (one version behind)."""
    return Batch.from_dict(tensors={"old_log_probs": batch["rollout_log_probs"]})


def rollout_correction(batch: Batch, correction: Correction) -> Batch:
    """rollout_is_weights / rollout_rs_mask [B, R] from the rollout's and the trainer's old
    log-probs (algorithm.rollout_correction; `algorithms/rollout_correction.py`)."""
    weights, keep, metrics = correction_weights(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"], correction)
    return Batch.from_dict(tensors={"rollout_is_weights": weights, "rollout_rs_mask": keep}, meta={"metrics": metrics})


def group_values(batch: Batch, metric: str, rule_scores: list[float] | None, rule_extras: dict[str, list[float]]) -> torch.Tensor:
    """The per-sequence value [B] dynamic sampling compares within a group (algorithm.filter_groups.metric,
    verl's names): "acc": the reward function's per-sample "acc" when it returned one for every sample,
    else its score; "score": the reward function's score (before the overlong penalty and a tool's or
    environment's reward); "seq_reward" / "seq_final_reward": the sum of token_level_scores (with them;
    the final reward, after the KL penalty, equals it here: KL-in-reward is refused with that metric).
    ``rule_scores`` / ``rule_extras``: this batch's rule reward (None when only a reward model scored)."""
    seq = batch["token_level_scores"].sum(-1)
    if metric == "acc" and rule_extras.get("acc") is not None and len(rule_extras["acc"]) == len(seq):
        return torch.tensor(rule_extras["acc"])
    if metric in ("acc", "score") and rule_scores is not None and len(rule_scores) == len(seq):
        return torch.tensor(rule_scores)
    return seq


def varied_groups(values: torch.Tensor, uids) -> torch.Tensor:
    """DAPO's dynamic sampling: the row indices [k] of the groups (rows sharing a uid, consecutive)
    whose values [B] are not all equal; a group with one value for every sample has zero GRPO
    advantage and teaches nothing."""
    rows: dict[str, list[int]] = {}
    for i, uid in enumerate(uids):
        rows.setdefault(uid, []).append(i)
    keep = [i for idx in rows.values() if len({float(values[j]) for j in idx}) > 1 for i in idx]
    return torch.tensor(sorted(keep), dtype=torch.long)
