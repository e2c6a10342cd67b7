"""Validation: (val_kwargs) generation on data.val_files, scored by the rule reward (plus a
multi-turn trajectory's own reward, as in training); multi-turn means as `val-aux/agent/*`.

Per data source, with N = actor_rollout_ref.rollout.val_kwargs.n samples per prompt, the metrics
of verl's `process_validation_metrics`, computed per prompt and then averaged over prompts:
- `acc/mean@N`; with N > 1 also `acc/std@N`;
- for k = 2, 4, ... and N: `acc/best@k/{mean,std}`, `acc/worst@k/{mean,std}` and, when the scorer
  returns a `pred` (its extracted answer), `acc/maj@k/{mean,std}`: bootstrapped, k of the N samples
  drawn with replacement 1000 times (seed 42), the best / worst score and the score of the most
  common answer (samples without an answer do not vote);
- unbiased `acc/pass@k` for k = 1, 2, 4, ... <= N (a sample counts as solved when its score is > 0).
`val-core/...` holds mean@N, best@N/{mean,std}, maj@N/mean and pass@k; the rest goes to `val-aux/...`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable

import numpy as np

from hybridflow.config.schema import SamplingConfig
from hybridflow.protocol import Batch
from hybridflow.protocol import SamplingParams
from hybridflow.trainer.driver_stages import with_agent_reward
from hybridflow.trainer.keys import with_sample_info


def validate(val_kwargs: SamplingConfig, val_batch_size: int | None, val_ds: Any, collate: Callable[[list], Batch],
             generate: Callable[[Batch, SamplingParams], Batch],
             reward_fn: Callable, greedy: SamplingParams) -> dict[str, float]:
    """Generate for every validation prompt (data.val_batch_size at a time, val_kwargs.n samples
    each) with `generate(prompts, greedy)` (single- or multi-turn); the metrics per data source."""
    vk = val_kwargs  # actor_rollout_ref.rollout.val_kwargs
    size = val_batch_size or len(val_ds)
    scores: dict[str, list[float]] = defaultdict(list)
    preds: dict[str, list] = defaultdict(list)
    agent: dict[str, list[tuple[float, int]]] = defaultdict(list)  # multi-turn: (a batch's mean, its rows)
    for start in range(0, len(val_ds), size):
        batch = collate([val_ds[i] for i in range(start, min(start + size, len(val_ds)))])
        batch = batch.repeat(vk.n, interleave=True)
        out = generate(batch, greedy)
        seq_scores = with_agent_reward(reward_fn(with_sample_info(out, batch))[0], out).sum(-1).tolist()
        batch_preds = getattr(reward_fn, "last_preds", None) or [None] * len(seq_scores)  # a RewardManager keeps them
        for ds, s, p in zip(batch["data_source"], seq_scores, batch_preds):
            scores[ds].append(s)
            preds[ds].append(p)
        for k, v in out.meta.get("metrics", {}).items():
            if k.startswith("agent/") and k.endswith("mean"):
                agent[k].append((v, len(out)))
    out: dict[str, float] = {}
    for ds, v in scores.items():  # the samples of a prompt are consecutive (repeat interleave)
        per_prompt = [sample_metrics(v[i:i + vk.n], preds[ds][i:i + vk.n]) for i in range(0, len(v), vk.n)]
        for name in per_prompt[0]:
            core = name.startswith("pass@") or name in (f"mean@{vk.n}", f"best@{vk.n}/mean", f"best@{vk.n}/std", f"maj@{vk.n}/mean")
            out[f"{'val-core' if core else 'val-aux'}/{ds}/acc/{name}"] = float(np.mean([m[name] for m in per_prompt]))
    return {**out, **{f"val-aux/{k}": sum(v * n for v, n in vals) / sum(n for _, n in vals) for k, vals in agent.items()}}


def sample_metrics(scores: list[float], preds: list, n_bootstrap: int = 1000, seed: int = 42) -> dict[str, float]:
    """One prompt's metrics over its N samples (see the module doc); preds[i] is sample i's
    answer or None."""
    n = len(scores)
    out = {f"mean@{n}": float(np.mean(scores))}
    if n == 1:
        return out
    out[f"std@{n}"] = float(np.std(scores))
    has_preds = any(p is not None for p in preds)
    rng = np.random.default_rng(seed)
    for k in _powers_of_two(n, first=2, last=n):
        idx = rng.integers(0, n, size=(n_bootstrap, k))  # [n_bootstrap, k]: k of the n samples, with replacement
        draws = np.asarray(scores, dtype=np.float64)[idx]
        stats = {"best": draws.max(1), "worst": draws.min(1)}
        if has_preds:
            stats["maj"] = np.array([majority_value([preds[i] for i in row], draws[j].tolist()) for j, row in enumerate(idx)])
        for name, v in stats.items():
            out[f"{name}@{k}/mean"], out[f"{name}@{k}/std"] = float(v.mean()), float(v.std())
    for k in _powers_of_two(n, first=1, last=None):
        out[f"pass@{k}"] = pass_at_k(n, sum(s > 0 for s in scores), k)
    return out


def _powers_of_two(n: int, first: int, last: int | None) -> list[int]:
    """first, 2 * first, ... below n, then `last` (verl's k for best@k: 2, 4, ..., n); all <= n when last is None."""
    ks, k = [], first
    while k < n:
        ks.append(k)
        k *= 2
    return ks + ([last] if last is not None else ([n] if k == n else []))


def majority_value(preds: list, scores: list[float]) -> float:
    """The score of the most common answer (ties: the one seen first; the score of its first
    sample); 0.0 when no sample has an answer."""
    votes: dict = {}
    for p, s in zip(preds, scores):
        if p is not None:
            votes.setdefault(p, []).append(s)
    if not votes:
        return 0.0
    return max(votes.values(), key=len)[0]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): the chance that k of the n samples, c of them correct,
    include a correct one: 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
