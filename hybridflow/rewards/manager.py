"""RewardManager: decode responses, score them, place the score on the last valid token."""

from __future__ import annotations

import functools
import logging
import numbers
import threading
from typing import Callable

import torch

from hybridflow.protocol import Batch
from hybridflow.rewards.scorers import compute_score as default_compute_score

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
    thread is abandoned, a daemon that cannot keep the process alive).
    """

    def __init__(self, tokenizer, compute_score: Callable | None = None, timeout_s: float | None = None,
                 code_strict: bool = False):
        self.tokenizer = tokenizer
        self.compute_score = compute_score or default_compute_score
        if compute_score is None and code_strict:  # custom_reward_function.code_strict reaches the built-in code reward
            self.compute_score = functools.partial(default_compute_score, code_strict=True)
        self.timeout_s = timeout_s
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

        scores = torch.zeros((bsz, T), dtype=torch.float32)
        last = last_token_index(mask)
        decoded: list[str] = []
        values: list[float] = []
        preds: list = []
        extras: dict[str, list[float]] = {}
        per_sample: list[dict[str, float]] = []  # each sample's numeric extras (e.g. "acc"), for dynamic sampling
        errors = timeouts = 0
        first_error = None
        resp_cpu, mask_cpu = responses.cpu(), mask.cpu()
        for i in range(bsz):
            ids = resp_cpu[i][mask_cpu[i]].tolist()
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            decoded.append(text)
            rm = reward_models[i]
            extra = extra_infos[i] if extra_infos is not None else None
            pred = None
            per_sample.append({})
            try:
                gt = rm["ground_truth"] if isinstance(rm, dict) else rm
                out = _call(self.compute_score, self.timeout_s, data_source=data_sources[i], solution_str=text, ground_truth=gt, extra_info=extra)
                if isinstance(out, dict):
                    if "score" not in out:
                        raise ValueError(f"reward function returned a dict without 'score': {out!r:.200}")
                    pred = out.get("pred")
                    for k, v in out.items():
                        if k != "score" and isinstance(v, numbers.Number) and not isinstance(v, bool):
                            extras.setdefault(k, []).append(float(v))
                            per_sample[-1][k] = float(v)
                    out = out["score"]
                if isinstance(out, torch.Tensor):
                    out = out.item()
                if not isinstance(out, numbers.Number):
                    raise TypeError(f"reward function returned {type(out).__name__}, expected a float or a dict with 'score'")
                value = float(out)
            except NotImplementedError:
                # no scorer for this data_source: a configuration error, not a bad sample
                raise
            except RewardTimeout:
                timeouts += 1
                value = 0.0
            except Exception as e:  # noqa: BLE001 - a bad sample must not stop the batch
                errors += 1
                if first_error is None:
                    first_error = (i, data_sources[i], f"{type(e).__name__}: {e}")
                value = 0.0
            values.append(value)
            preds.append(pred)
            if T > 0:
                scores[i, int(last[i])] = value
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


class RewardTimeout(Exception):
    """A reward call exceeded custom_reward_function.timeout_s."""


def _call(fn: Callable, timeout_s: float | None, **kwargs):
    """fn(**kwargs), or RewardTimeout when it runs longer than timeout_s (None: no limit)."""
    if timeout_s is None:
        return fn(**kwargs)
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = e

    thread = threading.Thread(target=run, daemon=True, name="reward-call")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout(f"no result within {timeout_s} s")
    if "err" in box:
        raise box["err"]
    return box["out"]
