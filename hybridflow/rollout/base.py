"""The rollout backend interface and the typed sampling settings every backend takes.

    backend.generate(prompts, SamplingParams(...)) -> Batch   # responses, masks, rollout log-probs
    backend.sync_weights(...) -> dict                         # trained weights -> generation weights
    backend.release()                                         # free generation memory until the next sync

The actor worker (and the generation-only rollout worker) hold one backend and never branch on
which: `hf_rollout.HFRollout` (HF generate, tensor-parallel, fed by the 3D-HybridEngine) and
`vllm_rollout.VLLMRollout` (an in-process vLLM engine). `make_rollout` picks one by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hybridflow.protocol import Batch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one generation call (the driver builds it from actor_rollout_ref.rollout)."""

    max_new_tokens: int
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    stop: tuple[str, ...] = ()  # stop strings, kept in the response
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS
    seed: int = 0  # per step; backends derive per-replica / per-row seeds from it

    @classmethod
    def from_config(cls, cfg, greedy: bool = False, seed: int = 0) -> "SamplingParams":
        """From a HybridFlowConfig: actor_rollout_ref.rollout (or its val_kwargs when greedy)."""
        r = cfg.actor_rollout_ref.rollout
        s = r.val_kwargs if greedy else r
        return cls(cfg.data.max_response_length, s.do_sample, s.temperature, s.top_p, s.top_k, tuple(r.stop), tuple(r.stop_token_ids), seed)

    @property
    def sampling(self) -> bool:
        return self.do_sample and self.temperature > 0

    @property
    def effective_temperature(self) -> float:
        """The temperature log-probs are computed under (1.0 for greedy decoding)."""
        return self.temperature if self.sampling else 1.0


class RolloutBackend(Protocol):
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
