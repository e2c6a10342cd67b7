"""The exact rollout mode's one computation (actor_rollout_ref.rollout.exact): the rollout's sampler
(rollout/hf_rollout.py) and the trainer's log-probs (engine/model.py) both call it, so the two
are bit for bit equal."""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn


def exact_row_logits(model: nn.Module, prompt: torch.Tensor, response: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Logits [1, R, V] predicting `response` [R] (padded to its full width R) after `prompt` [p]
    (no padding): the one computation the exact mode (actor_rollout_ref.rollout.exact) runs on both
    sides, the rollout's sampler and the trainer's log-probs, so the two are bit for bit equal.

    Why it is exact: the row runs alone with a shape that depends only on p and R ([1, p + R]: no
    batch-mates, no left padding, position ids 0.., no attention mask, so the causal kernel path
    every time), and the logits at position p - 1 + t depend only on the tokens up to it (causal
    attention; every other op is per token). So a sampler that runs this on the prompt and the
    first t tokens (pads after them) gets, at row t, the very numbers the trainer's pass over the
    finished response computes there."""
    ids = torch.cat([prompt, response])[None]
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    kwargs = {"logits_to_keep": response.shape[0] + 1} if "logits_to_keep" in inspect.signature(type(model).forward).parameters else {}
    out = model(input_ids=ids, position_ids=positions, use_cache=False, **kwargs)
    logits = out.logits[:, -response.shape[0] - 1 : -1, :].float()
    return logits / temperature if temperature != 1.0 else logits
