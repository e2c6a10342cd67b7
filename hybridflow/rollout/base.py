"""The rollout backend interface, the weight pieces it consumes, and the registry by name.

    backend.update_weights(pieces) -> dict        # trained weights pushed in as WeightPiece's
    backend.generate_requests([Request, ...]) -> [Completion, ...]
    backend.generate(prompts, SamplingParams) -> Batch   # the batch API, built on requests
    backend.sleep() / backend.wake()              # free / re-acquire generation memory
    backend.pause()  (optional)                   # a context: no generation step runs inside it

Weights are *pushed*: a weight source (the colocated 3D-HybridEngine, the cross-pool receiver,
`hybrid_engine/`) produces, for this rank, the pieces of the trained weights its generation
layout needs, and the backend writes them into its own parameters; it knows nothing of who made
them (`WeightPiece` and `GenLayout` live in `protocol.py`, which both sides import). Backends are
found by name (`actor_rollout_ref.rollout.name`): the built-in ones by import path in
`ROLLOUT_BACKENDS` (imported when first built), a user's by `@register_rollout("mine")` on a
builder `build(ctx: RolloutContext) -> RolloutBackend`, or by path (`my_pkg.my_module:build`);
the worker calls `make_rollout(name, ctx)` and never branches on which.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence, Union

import torch

from hybridflow.config.validate import register_check
from hybridflow.protocol import Batch, Completion, GenLayout, Request, SamplingParams, WeightPiece  # noqa: F401  (re-exported)


class RolloutBackend(Protocol):
    tp_index: int  # this rank's index in its generation TP group
    dp_index: int  # which replica (generation DP group) this rank belongs to
    gen_tp: int

    def layout(self) -> GenLayout: ...

    def update_weights(self, pieces: Iterable[WeightPiece]) -> dict: ...

    def generate_requests(self, requests: Sequence[Request]) -> list[Completion]: ...

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


def pause(backend) -> contextlib.AbstractContextManager:
    """The backend held between two generation steps (`backend.pause()`; a backend without one
    generates only inside calls, which the worker runs one at a time): what a weight update and a
    policy version change happen under, so no step runs on mixed weights."""
    hold = getattr(backend, "pause", None)
    return hold() if hold is not None else contextlib.nullcontext()


@dataclass(frozen=True)
class Continuation(Request):
    """A session's next request that sends only its tail: the whole prompt is the prompt + completion
    of the session's last request on this replica (`prefix_len` tokens of it before `prompt_ids`,
    which repeat its tail, a check). Sent only after a `KeptCompletion` said the replica keeps it;
    a replica that does not hold it answers `PrefixMissing`, and the caller sends the whole prompt."""

    prefix_len: int = 0


@dataclass(frozen=True)
class KeptCompletion(Completion):
    """A Completion whose replica keeps its session (prompt + these tokens, and their KV cache): the
    session's next request may be a `Continuation`."""


@dataclass(frozen=True)
class PrefixMissing(Completion):
    """The answer to a `Continuation` whose session this replica does not hold (another replica, a
    restart, evicted): nothing generated; send the whole prompt."""


@dataclass
class RolloutContext:
    """What a backend builder gets from the worker that holds it: the rollout's spec
    (`run_plan.RolloutSpec`: model, sampling section, generation dtype, longest sequence), never the
    root config."""

    spec: Any  # RolloutSpec
    tokenizer: Any
    device: str
    rank: int
    world_size: int
    train_layout: Any = None  # the colocated actor's ParallelDims (parallel/dims.py; None: FSDP over the group / no actor)
    shard_dims: Optional[dict[str, Optional[int]]] = None  # the HF model's TP table: parameter -> TP dim (None = whole)


Builder = Callable[[RolloutContext], RolloutBackend]
# name -> its builder, or "module:function" imported when first built (so this module imports no
# backend: the built-in ones import it, never the other way round). A builder may carry
# `check(spec: RolloutSpec) -> list[str]`: its own config checks, which the validator runs.
ROLLOUT_BACKENDS: dict[str, Union[str, Builder]] = {
    "hf": "hybridflow.rollout.hf_rollout:build_hf_rollout",
    "vllm": "hybridflow.rollout.vllm_rollout:build_vllm_rollout",
}


def register_rollout(name: str, check: Callable[[Any], list[str]] | None = None):
    """Decorator on a builder `build(ctx: RolloutContext) -> RolloutBackend`: the backend
    `actor_rollout_ref.rollout.name=<name>` selects (in processes that imported the decorated
    module; across Ray workers name it by path instead: rollout.name=my_pkg.my_module:build)."""
    def deco(builder: Builder) -> Builder:
        old = ROLLOUT_BACKENDS.get(name)
        if old is not None and old is not builder and old != f"{builder.__module__}:{builder.__qualname__}":
            raise ValueError(f"rollout backend {name!r} is already registered ({old})")
        if check is not None:
            builder.check = check
        ROLLOUT_BACKENDS[name] = builder
        return builder

    return deco


def rollout_builder(name: str) -> Builder:
    """The builder registered as `name`, or found at the import path "module:function"."""
    entry = ROLLOUT_BACKENDS.get(name, name if ":" in name else None)
    if entry is None:
        raise ValueError(f"unknown rollout backend {name!r} (actor_rollout_ref.rollout.name); registered: {sorted(ROLLOUT_BACKENDS)}, "
                         f"or a builder's import path module:function")
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        try:
            entry = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"rollout backend {name!r} (actor_rollout_ref.rollout.name): cannot import {module}:{attr} ({e})") from e
    return entry


def make_rollout(name: str, ctx: RolloutContext) -> RolloutBackend:
    """The backend `name` names (a registered name or a builder's import path), built for ctx."""
    return rollout_builder(name)(ctx)


@register_check("rollout_backend")
def rollout_backend_problems(name: str, spec) -> list[str]:
    """`name` (actor_rollout_ref.rollout.name) names a registered backend (or an importable builder),
    and the backend's own checks of its `RolloutSpec` (its builder's `check(spec)`) pass."""
    try:
        builder = rollout_builder(name)
    except ValueError as e:
        return [str(e)]
    check = getattr(builder, "check", None)
    return list(check(spec)) if check is not None else []


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


def left_padded(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows -> (input_ids, attention_mask) [b, P], left-padded to the longest row P."""
    P = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), P), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, P - len(r):] = torch.tensor(list(r), dtype=torch.long)
            mask[i, P - len(r):] = 1
    return ids, mask


def rollout_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, responses: torch.Tensor, log_probs: torch.Tensor, lengths: torch.Tensor,
                  params: SamplingParams, loss_mask: torch.Tensor | None = None, untruncated_log_probs: torch.Tensor | None = None) -> Batch:
    """What every backend returns. Inputs: prompts [b, P] (left-padded), responses / log_probs
    [b, R] (behaviour log-probs, `Completion`), generated lengths [b], untruncated_log_probs [b, R]
    (None: the same). Output: prompts, responses, response_mask [b, R], the full input_ids /
    attention_mask / position_ids [b, P+R], rollout_log_probs [b, R] (behaviour: rollout correction
    and async rollout's old log-probs) and rollout_untruncated_log_probs [b, R] (the temperature
    alone: the rollout-vs-trainer mismatch metric). loss_mask [b, R]: the response_mask when it is
    not every valid token (multi-turn: 0 on tool tokens, which attention still sees)."""
    R = params.max_new_tokens
    valid = (torch.arange(R, device=responses.device) < lengths[:, None]).long()  # [b, R]
    response_mask = valid if loss_mask is None else loss_mask.long()
    full_mask = torch.cat([attention_mask, valid], dim=1)
    return Batch.from_dict(
        tensors={
            "prompts": input_ids.cpu(),
            "responses": responses.cpu(),
            "response_mask": response_mask.cpu(),
            "input_ids": torch.cat([input_ids, responses], dim=1).cpu(),
            "attention_mask": full_mask.cpu(),
            "position_ids": position_ids_from(full_mask).cpu(),
            "rollout_log_probs": (log_probs * response_mask).cpu(),
            "rollout_untruncated_log_probs": ((log_probs if untruncated_log_probs is None else untruncated_log_probs) * response_mask).cpu(),
        },
        meta={"temperature": params.effective_temperature},
    )


def batch_requests(prompts: Batch, params: SamplingParams) -> list[Request]:
    """Left-padded prompts [b, P] -> one Request per row (its unpadded token ids), all sharing
    `params` (backends derive per-request seeds from the position in the call)."""
    return [Request(tuple(t for t, m in zip(ids, mask) if m), params)
            for ids, mask in zip(prompts["input_ids"].tolist(), prompts["attention_mask"].tolist())]


def generate_batch(backend, prompts: Batch, params: SamplingParams, pad_id: int, completions: list | None = None) -> Batch:
    """The batch API on top of `generate_requests`: completions are right-padded to
    max_new_tokens next to the prompts as given ([b, P], left-padded); completions that carry their
    tokens' policy versions add rollout_policy_version [b, R] (-1 past each response).
    completions: the prompts' completions when the backend made them otherwise (a VLM's image prompts)."""
    if completions is None:
        completions = backend.generate_requests(batch_requests(prompts, params))
    b, R = len(completions), params.max_new_tokens
    responses = torch.full((b, R), pad_id, dtype=torch.long)
    logps = torch.zeros((b, R), dtype=torch.float32)
    untruncated = torch.zeros((b, R), dtype=torch.float32)
    lengths = torch.zeros(b, dtype=torch.long)
    versions = torch.full((b, R), -1, dtype=torch.long) if completions and completions[0].versions is not None else None
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        lengths[i] = n
        responses[i, :n] = torch.tensor(c.token_ids, dtype=torch.long)
        logps[i, :n] = torch.tensor(c.log_probs, dtype=torch.float32)
        untruncated[i, :n] = torch.tensor(c.untruncated, dtype=torch.float32)
        if versions is not None:
            versions[i, :n] = torch.tensor(c.versions, dtype=torch.long)
    out = rollout_batch(prompts["input_ids"], prompts["attention_mask"], responses, logps, lengths, params, untruncated_log_probs=untruncated)
    if versions is not None:
        out["rollout_policy_version"] = versions
    if completions and completions[0].routed_experts is not None:  # MoE routing replay: [b, P+R, layers, k] (models/routing.py)
        from hybridflow.models.routing import ROUTED_EXPERTS, batch_routes

        prompt_lens = prompts["attention_mask"].sum(-1).tolist()
        out[ROUTED_EXPERTS] = batch_routes([c.routed_experts for c in completions], prompt_lens, prompts["input_ids"].shape[1], R)
    return out
