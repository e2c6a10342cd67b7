"""What a vision-language model's forward takes beyond a text micro-batch's tensors.

A VLM micro-batch (`data/vision.py::collate_vision`, and the rollout's output) carries
- ``position_ids`` [b, 3, L]: Qwen2-VL's M-RoPE index (temporal, height, width) in verl's layout; the
  HF model takes [3, b, L];
- the non-tensor ``multi_modal_inputs``: per row ``{"pixel_values": [P_i, D], "image_grid_thw": [n_i, 3]}``.
`forward_inputs` turns them into the forward's ``position_ids`` and ``pixel_values`` / ``image_grid_thw``
(the rows' images concatenated in row order: the model fills the ``<|image_pad|>`` runs left to right).

With the position ids given the model does not compute its rope index, so it needs no
``mm_token_type_ids``. Simplified: the packed (remove-padding) forward is not wired for a VLM (its
per-sequence M-RoPE restart is not what transformers' packed-sequence detection reads), so a VLM
micro-batch always runs left-padded; the log-probs are the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from hybridflow.data.vision import MULTI_MODAL_KEY, pack_multi_modal_inputs  # the rows' image inputs (verl's key)
from hybridflow.protocol import Request

# The vision tower's parameters in transformers v5's Qwen2-VL / Qwen2.5-VL (model.visual.*: patch embedding,
# blocks, merger): what actor_rollout_ref.model.freeze_vision_tower freezes (fnmatch patterns, as actor.freeze_modules).
VISION_TOWER_PATTERNS = ("model.visual.*", "visual.*")
# The config keys of the vision tokens (Qwen2-VL): a rollout never samples them (suppressed), so a response holds text only.
VISION_TOKEN_KEYS = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")


def suppressed_token_ids(config: Any) -> tuple[int, ...]:
    """The token ids a policy never samples: a VLM's vision tokens (`VISION_TOKEN_KEYS` of its config), () for a text model
    (no ``vision_config``). The one place both sides read: the HF rollout suppresses them when sampling, and the trainer's
    log-prob pass (`engine/model.py`) masks their logits to -inf before the log-softmax, so the policy trained is the one
    sampled (without it, the rollout's log-probs sit ~0.02 above the trainer's on the tiny VLM)."""
    if getattr(config, "vision_config", None) is None:
        return ()
    return tuple(int(t) for t in (getattr(config, k, None) for k in VISION_TOKEN_KEYS) if t is not None)


def suppress_logits(logits: torch.Tensor, suppress: Sequence[int], targets: torch.Tensor | None = None) -> torch.Tensor:
    """logits [..., V] with the columns `suppress` set to -inf (out of place: autograd gives them no gradient), so the
    log-softmax is the distribution renormalised without those tokens, the one the HF rollout samples from for a VLM.
    `logits` itself when `suppress` is empty (a text model).

    targets [...]: the token each position scores; where it is itself a suppressed token (an image token of a tool's
    message in a multi-turn response: mask 0, never sampled) the position keeps its plain logits, so its log-prob stays
    finite (-inf there would make every masked product 0 * -inf = nan)."""
    if not suppress:
        return logits
    ids = torch.tensor(list(suppress), device=logits.device)
    masked = logits.index_fill(-1, ids, float("-inf"))
    if targets is None:
        return masked
    return torch.where(torch.isin(targets, ids)[..., None], logits, masked)


def is_multi_modal(mb: Any) -> bool:
    """Whether ``mb`` (a Batch) is a VLM micro-batch: M-RoPE position ids [b, 3, L] or per-row image inputs."""
    return MULTI_MODAL_KEY in mb or ("position_ids" in mb and mb["position_ids"].dim() == 3)


def forward_inputs(mb: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(position_ids for the model, extra forward kwargs) of a micro-batch: a text batch's [b, L] and {};
    a VLM's [3, b, L] and {pixel_values [sum P_i, D], image_grid_thw [sum n_i, 3]} on input_ids' device
    ({} when no row has an image)."""
    pos = mb["position_ids"]
    if pos.dim() == 3:
        pos = pos.transpose(0, 1)  # [b, 3, L] -> [3, b, L]
    if MULTI_MODAL_KEY not in mb:
        return pos, {}
    device = mb["input_ids"].device
    return pos, {k: v.to(device) for k, v in pack_multi_modal_inputs(list(mb[MULTI_MODAL_KEY])).items()}


@dataclass(frozen=True)
class ImageRequest(Request):
    """A generation request whose prompt holds images (a multi-turn trajectory's, `agent/images.py`): the pixel inputs of
    every image in the prompt, in the order of their ``<|image_pad|>`` runs: ``{"pixel_values": [P, D], "image_grid_thw":
    [n, 3]}``. Only the HF rollout's per-call path takes it (the continuous-batching scheduler and the exact sampler see
    token ids only and refuse it). Not compared or hashed: the prompt ids already differ where the images' sizes do."""

    multi_modal_inputs: dict = field(default_factory=dict, compare=False)


def request_images(r: Request) -> dict:
    """A request's pixel inputs ({} for a text request)."""
    return getattr(r, "multi_modal_inputs", None) or {}
