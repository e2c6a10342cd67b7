"""Validation: greedy (actor_rollout_ref.rollout.val_kwargs) generation on data.val_files, scored by
the rule reward (plus a multi-turn trajectory's own reward, as in training); accuracy per data
source as `val-core/<data_source>/acc/mean@<n>`, multi-turn means as `val-aux/agent/*`. With
val_kwargs.n > 1 also `acc/best@<n>/mean` (each prompt's best sample) and unbiased
`acc/pass@<k>` for k = 1, 2, 4, ... <= n (a sample counts as solved when its score is > 0)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable

import numpy as np

from hybridflow.config.schema import HybridFlowConfig
from hybridflow.protocol import Batch
from hybridflow.rollout.base import SamplingParams
from hybridflow.trainer.driver_stages import with_agent_reward
from hybridflow.trainer.keys import with_sample_info


def validate(cfg: HybridFlowConfig, val_ds: Any, collate: Callable[[list], Batch], generate: Callable[[Batch, SamplingParams], Batch],
             reward_fn: Callable, greedy: SamplingParams) -> dict[str, float]:
    """Generate for every validation prompt (data.val_batch_size at a time, val_kwargs.n samples
    each) with `generate(prompts, greedy)` (single- or multi-turn); the mean score per data source."""
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    size = cfg.data.val_batch_size or len(val_ds)
    scores: dict[str, list[float]] = defaultdict(list)
    agent: dict[str, list[tuple[float, int]]] = defaultdict(list)  # multi-turn: (a batch's mean, its rows)
    for start in range(0, len(val_ds), size):
        batch = collate([val_ds[i] for i in range(start, min(start + size, len(val_ds)))])
        batch = batch.repeat(vk.n, interleave=True)
        out = generate(batch, greedy)
        seq_scores = with_agent_reward(reward_fn(with_sample_info(out, batch))[0], out).sum(-1).tolist()
        for ds, s in zip(batch["data_source"], seq_scores):
            scores[ds].append(s)
        for k, v in out.meta.get("metrics", {}).items():
            if k.startswith("agent/") and k.endswith("mean"):
                agent[k].append((v, len(out)))
    out = {f"val-core/{ds}/acc/mean@{vk.n}": float(np.mean(v)) for ds, v in scores.items()}
    if vk.n > 1:  # the samples of a prompt are consecutive (repeat interleave)
        for ds, v in scores.items():
            per_prompt = [v[i:i + vk.n] for i in range(0, len(v), vk.n)]
            out[f"val-core/{ds}/acc/best@{vk.n}/mean"] = float(np.mean([max(p) for p in per_prompt]))
            k = 1
            while k <= vk.n:
                out[f"val-core/{ds}/acc/pass@{k}"] = float(np.mean([pass_at_k(vk.n, sum(s > 0 for s in p), k) for p in per_prompt]))
                k *= 2
    return {**out, **{f"val-aux/{k}": sum(v * n for v, n in vals) / sum(n for _, n in vals) for k, vals in agent.items()}}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): the chance that k of the n samples, c of them correct,
    include a correct one: 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
