"""Validation: greedy (actor_rollout_ref.rollout.val_kwargs) generation on data.val_files, scored by
the rule reward (plus a multi-turn trajectory's own reward, as in training); accuracy per data
source as `val-core/<data_source>/acc/mean@<n>`, multi-turn means as `val-aux/agent/*`."""

from __future__ import annotations

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
    return {**{f"val-core/{ds}/acc/mean@{vk.n}": float(np.mean(v)) for ds, v in scores.items()},
            **{f"val-aux/{k}": sum(v * n for v, n in vals) / sum(n for _, n in vals) for k, vals in agent.items()}}
