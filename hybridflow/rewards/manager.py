"""RewardManager: decode responses, score them, place the score on the last valid token."""

from __future__ import annotations

import functools
import logging
import threading
from typing import Callable

import torch

from hybridflow.protocol import Batch
from hybridflow.rewards.scorers import compute_score as default_compute_score
from hybridflow.rewards.scoring import SampleResult, score_sample
from hybridflow.rewards.workers import KEY as WORKERS_KEY
from hybridflow.rewards.workers import RewardWorkerPool, worker_count

logger = logging.getLogger(__name__)
# Per-sample counts whose batch sum is a metric of its own (reward/<key>), next to the mean.
SUMMED_EXTRAS = ("code_inprocess_checks",)


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """[B] index of each row's last 1 in response_mask [B, T] (0 for an empty row): where a
    sequence-level score sits. Not the count minus one: a multi-turn response has tool tokens
    (mask 0) between its model turns."""
    return (response_mask.long() * torch.arange(1, response_mask.shape[-1] + 1, device=response_mask.device)).argmax(-1)


class RewardManager:
    """``__call__(batch) -> (token_level_scores [B, T] float32, metrics)``.

    The batch needs tensors ``responses`` [B, T] and ``response_mask`` [B, T], and non-tensors
    ``data_source``, ``reward_model`` (dict with ``ground_truth``) and optionally ``extra_info``.
    ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`` may return a number
    or a dict with key ``"score"`` (other numeric keys become ``reward/<key>/mean`` metrics, and
    the counts in ``SUMMED_EXTRAS`` also ``reward/<key>``, their sum over the batch; a
    ``"pred"``, the extracted answer, is kept in ``last_preds`` for validation's maj@N). A
    sample whose scoring raises (or returns something else) scores 0.0 and is counted in
    ``reward/errors``; one warning per call is logged. ``NotImplementedError`` (no scorer for a
    data_source: a configuration error) propagates. The score sits at the last valid response
    token (the last 1 of ``response_mask``; index 0 for an empty response). The decoded strings of
    the last call are kept in ``last_decoded``. ``timeout_s`` (custom_reward_function.timeout_s)
    bounds each call: one that takes longer scores 0.0 and is counted in ``reward/timeouts`` (its
    thread is abandoned, a daemon that cannot keep the process alive; the code reward's sandboxes
    end at the deadline: ``deadline.py``).

    ``num_workers`` (reward_model.num_workers): the samples are scored on that many reward workers
    (Ray actors, ``workers.py``), in chunks, with the same results; None = chosen from the machine
    when Ray is initialised at the first call, else none; 0 (the default here) = on this process,
    one after another (``scoring.score_sample`` either way). ``close()`` stops the workers.
    """

    def __init__(self, tokenizer, compute_score: Callable | None = None, timeout_s: float | None = None,
                 code_strict: bool = False, num_workers: int | None = 0):
        self.tokenizer = tokenizer
        self.compute_score = compute_score or default_compute_score
        if compute_score is None and code_strict:  # custom_reward_function.code_strict reaches the built-in code reward
            self.compute_score = functools.partial(default_compute_score, code_strict=True)
        self.timeout_s = timeout_s
        self.num_workers = num_workers  # reward_model.num_workers (workers.py); resolved on the first call
        self.pool: RewardWorkerPool | None = None
        self._pool_lock = threading.Lock()
        self._pool_decided = False
        self.last_decoded: list[str] = []
        self.last_scores: list[float] = []
        self.last_preds: list = []  # per sample: the scorer's "pred" (its extracted answer) or None
        self.last_extras: dict[str, list[float]] = {}  # see __call__

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        responses = batch["responses"]
        mask = batch["response_mask"].bool()
        bsz, T = responses.shape
        data_sources = batch["data_source"]
        reward_models = batch["reward_model"]
        extra_infos = batch.non_tensors.get("extra_info") if "extra_info" in batch.non_tensors else None

        resp_cpu, mask_cpu = responses.cpu(), mask.cpu()
        decoded = [self.tokenizer.decode(resp_cpu[i][mask_cpu[i]].tolist(), skip_special_tokens=True) for i in range(bsz)]
        items = [(data_sources[i], decoded[i], reward_models[i], extra_infos[i] if extra_infos is not None else None) for i in range(bsz)]
        results = self._score(items)

        scores = torch.zeros((bsz, T), dtype=torch.float32)
        last = last_token_index(mask)
        values: list[float] = []
        preds: list = []
        extras: dict[str, list[float]] = {}
        per_sample: list[dict[str, float]] = []  # each sample's numeric extras (e.g. "acc"), for dynamic sampling
        errors = timeouts = 0
        first_error = None
        for i, r in enumerate(results):
            if r.status == "config":  # no scorer for this data_source: a configuration error, not a bad sample
                raise NotImplementedError(r.error)
            per_sample.append(dict(r.extras))
            for k, v in r.extras.items():
                extras.setdefault(k, []).append(v)
            if r.status == "timeout":
                timeouts += 1
            elif r.status == "error":
                errors += 1
                if first_error is None:
                    first_error = (i, data_sources[i], r.error)
            values.append(r.value)
            preds.append(r.pred)
            if T > 0:
                scores[i, int(last[i])] = r.value
        if errors:
            idx, ds, msg = first_error
            logger.warning(
                "reward function raised for %d of %d samples (scored 0.0); first: sample %d data_source=%r: %s",
                errors, bsz, idx, ds, msg,
            )
        self.last_decoded = decoded
        self.last_scores = values
        self.last_preds = preds
        # {key: [B] values} for the numeric extras every sample reported (algorithm.filter_groups.metric=acc reads "acc")
        self.last_extras = {k: [d[k] for d in per_sample] for k in extras if all(k in d for d in per_sample)}
        if timeouts:
            logger.warning("reward function took longer than custom_reward_function.timeout_s=%s for %d of %d samples (scored 0.0)",
                           self.timeout_s, timeouts, bsz)
        metrics: dict[str, float] = {"reward/errors": float(errors), "reward/timeouts": float(timeouts)}
        if values:
            t = torch.tensor(values)
            metrics.update({"reward/mean": t.mean().item(), "reward/max": t.max().item(), "reward/min": t.min().item()})
        for k, v in extras.items():
            metrics[f"reward/{k}/mean"] = sum(v) / len(v)
            if k in SUMMED_EXTRAS:
                metrics[f"reward/{k}"] = sum(v)
        return scores.to(responses.device), metrics

    def _score(self, items: list[tuple]) -> list[SampleResult]:
        """Each sample's result, in order: on the reward workers when there are any, else here, one after another."""
        pool = self._workers()
        if pool is not None:
            return pool.score(items)
        results = []
        for item in items:
            results.append(score_sample(self.compute_score, self.timeout_s, *item))
            if results[-1].status == "config":
                break
        return results

    def _workers(self) -> RewardWorkerPool | None:
        """The pool of reward workers, started on the first call (Ray is up by then in a Ray run), or None."""
        with self._pool_lock:
            if not self._pool_decided:
                n = worker_count(self.num_workers)
                if n > 0:
                    self.pool = RewardWorkerPool(n, self.compute_score, self.timeout_s)
                    logger.info("reward: %d reward workers (%s)", n, WORKERS_KEY)
                self._pool_decided = True
            return self.pool

    def close(self) -> None:
        """Stop the reward workers (a later call starts new ones)."""
        with self._pool_lock:
            pool, self.pool, self._pool_decided = self.pool, None, False
        if pool is not None:
            pool.shutdown()
