"""The rollout backend interface.

    backend.generate_requests([Request(prompt_ids, SamplingParams(...)), ...]) -> [Completion, ...]
    backend.generate(prompts, SamplingParams(...)) -> Batch   # the batch API, built on requests
    backend.sync_weights(...) -> dict                         # trained weights -> generation weights
    backend.release()                                         # free generation memory until the next sync

The actor worker (and the generation-only rollout worker) hold one backend and never branch on
which: `hf_rollout.HFRollout` (HF generate, tensor-parallel, fed by the 3D-HybridEngine) and
`vllm_rollout.VLLMRollout` (an in-process vLLM engine). `make_rollout` picks one by name.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from hybridflow.protocol import Batch, Completion, Request, SamplingParams


class RolloutBackend(Protocol):
    def generate_requests(self, requests: Sequence[Request]) -> list[Completion]: ...

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch: ...

    def sync_weights(self, measure_baseline: bool = False, check: bool = False, trace: bool = False) -> dict: ...

    def release(self) -> None: ...


def response_lengths(responses: torch.Tensor, stop_ids: list[int], pad_id: int) -> torch.Tensor:
    """Generated tokens per row [b]: up to and including the first stop id; a row that stopped
    otherwise (a stop string, or the length limit) ends before its trailing padding."""
    R = responses.shape[1]
    pos = torch.arange(R, device=responses.device)
    is_stop = torch.isin(responses, torch.tensor(stop_ids, device=responses.device))
    first_stop = torch.where(is_stop, pos, R).min(dim=1).values  # [b], R = none
    not_pad = torch.where(responses != pad_id, pos + 1, 0).max(dim=1).values  # [b] end of non-pad
    return torch.where(first_stop < R, first_stop + 1, not_pad)


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)


def rollout_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, responses: torch.Tensor, log_probs: torch.Tensor, lengths: torch.Tensor, params: SamplingParams) -> Batch:
    """What every backend returns. Inputs: prompts [b, P] (left-padded), responses / log_probs
    [b, R], generated lengths [b]. Output: prompts, responses, response_mask [b, R], the full
    input_ids / attention_mask / position_ids [b, P+R] and rollout_log_probs [b, R] (under the
    sampling temperature, for the rollout-vs-trainer check and off-policy ratios)."""
    R = params.max_new_tokens
    response_mask = (torch.arange(R, device=responses.device) < lengths[:, None]).long()  # [b, R]
    full_mask = torch.cat([attention_mask, response_mask], dim=1)
    return Batch.from_dict(
        tensors={
            "prompts": input_ids.cpu(),
            "responses": responses.cpu(),
            "response_mask": response_mask.cpu(),
            "input_ids": torch.cat([input_ids, responses], dim=1).cpu(),
            "attention_mask": full_mask.cpu(),
            "position_ids": position_ids_from(full_mask).cpu(),
            "rollout_log_probs": (log_probs * response_mask).cpu(),
        },
        meta={"temperature": params.effective_temperature},
    )


def batch_requests(prompts: Batch, params: SamplingParams) -> list[Request]:
    """Left-padded prompts [b, P] -> one Request per row (its unpadded token ids), all sharing
    `params` (backends derive per-request seeds from the position in the call)."""
    return [Request(tuple(t for t, m in zip(ids, mask) if m), params)
            for ids, mask in zip(prompts["input_ids"].tolist(), prompts["attention_mask"].tolist())]


def generate_batch(backend, prompts: Batch, params: SamplingParams, pad_id: int) -> Batch:
    """The batch API on top of `generate_requests`: completions are right-padded to
    max_new_tokens next to the prompts as given ([b, P], left-padded)."""
    completions = backend.generate_requests(batch_requests(prompts, params))
    b, R = len(completions), params.max_new_tokens
    responses = torch.full((b, R), pad_id, dtype=torch.long)
    logps = torch.zeros((b, R), dtype=torch.float32)
    lengths = torch.zeros(b, dtype=torch.long)
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        lengths[i] = n
        responses[i, :n] = torch.tensor(c.token_ids, dtype=torch.long)
        logps[i, :n] = torch.tensor(c.log_probs, dtype=torch.float32)
    return rollout_batch(prompts["input_ids"], prompts["attention_mask"], responses, logps, lengths, params)
