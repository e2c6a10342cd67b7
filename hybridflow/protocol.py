"""`Batch`: the one container that moves between the driver and the workers.

A batch holds ``B`` rows (samples). Every tensor has first dimension ``B``; every non-tensor entry
is a 1-D ``dtype=object`` numpy array of length ``B`` (per-sample Python objects such as strings
or dicts); ``meta`` holds batch-level values (temperature, global step, ...) that are never split.

All row operations (``index``, ``chunk``, ``repeat``, ...) act on whole columns at once (one torch
/ numpy call per key), never with a Python loop over rows of a tensor. Slicing returns views; to
keep Ray/pickle transfers small, ``__getstate__`` copies a tensor that is a view into a larger
storage, because torch pickles the *whole* storage of a view.

The typed messages the driver and the rollout backends share live here too, so the driver never
imports a backend: ``SamplingParams`` (how to sample), ``Request`` (one prompt's token ids and its
sampling settings) and ``Completion`` (the generated token ids, their log-probs and why it ended);
and the weights boundary between training and generation: ``WeightPiece`` (a part of one trained
parameter) and ``GenLayout`` (how a backend lays the weights out), which weight sources
(`hybrid_engine/`) produce and rollout backends (`rollout/`) consume without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Literal, NamedTuple, Optional, Protocol, Sequence, Union, runtime_checkable

import numpy as np
import torch

Index = Union[int, slice, Sequence[int], Sequence[bool], torch.Tensor, np.ndarray]
Box = tuple[tuple[int, int], ...]  # per dim [lo, hi) of the whole tensor


class WeightPiece(NamedTuple):
    """A part of one trained parameter: `tensor` holds `box` of the whole tensor of `shape`."""

    name: str  # the HF parameter name
    shape: tuple[int, ...]
    box: Box
    tensor: torch.Tensor
    static: bool = False  # a frozen parameter: the source will not send it again, so the backend keeps it while asleep
    borrowed: bool = False  # `tensor` is the trainer's own shard (the colocated engine lent it): the backend never frees it


@runtime_checkable
class WeightSource(Protocol):
    """What produces this rank's pieces of the trained weights for its rollout backend, which takes
    them with `backend.update_weights(source.pieces())` and knows nothing else of the source: the
    colocated 3D-HybridEngine (`hybrid_engine/executor.py::HybridEngine`, the minimal pieces of the
    switch into the backend's `GenLayout`) or the cross-pool receiver of async rollout
    (`hybrid_engine/cross_pool.py::PoolReceiver`, the pieces the actor's pool published)."""

    last_stats: dict  # the last stream's measured stats (seconds, bytes moved, ...), once it is consumed

    def pieces(self) -> Iterator[WeightPiece]: ...


@dataclass(frozen=True)
class GenLayout:
    """How a backend lays the weights out over the generation ranks, for the weight source that
    feeds it: gen_tp, which ranks form a TP group (HybridFlow's strided micro-DP grouping, or
    consecutive ranks as vLLM's launcher does), each parameter's TP shard dim (None = whole on
    every rank), the backend's own parameter storages when the source may write there in place
    (None: the source stages the pieces and the backend copies them in), and the weights' dtype."""

    gen_tp: int
    consecutive: bool
    shard_dims: dict[str, Optional[int]]
    buffers: Optional[dict[str, torch.nn.Parameter]] = None
    dtype: Optional[torch.dtype] = None  # the generation weights' dtype (the switch casts to it); None = the trainer's


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one generation call (the driver builds it from actor_rollout_ref.rollout:
    `run_plan.RolloutSpec.sampling_params`)."""

    max_new_tokens: int
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    stop: tuple[str, ...] = ()  # stop strings, kept in the response
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS
    seed: int = 0  # per call; backends derive per-replica / per-request seeds from it
    top_logprobs: int = 0  # > 0: each token also carries the k most likely tokens' log-probs (the endpoint's top_logprobs)

    def with_(self, **changes: Any) -> "SamplingParams":
        """A copy with some fields changed (e.g. a request's own max_new_tokens)."""
        return replace(self, **changes)

    @property
    def sampling(self) -> bool:
        return self.do_sample and self.temperature > 0

    @property
    def effective_temperature(self) -> float:
        """The temperature log-probs are computed under (1.0 for greedy decoding)."""
        return self.temperature if self.sampling else 1.0


@dataclass(frozen=True)
class Request:
    """One generation request: the prompt's token ids (no padding) and its own sampling settings
    (max new tokens, stop strings and stop token ids included). session: the conversation it
    continues (a multi-turn trajectory, a paused response): replicas route a session's requests to
    the replica that served it before, where its prefix may be cached."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    session: Optional[str] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        if not self.prompt_ids:
            raise ValueError("a Request needs at least one prompt token")


@dataclass(frozen=True)
class Completion:
    """What a backend returns per request: the generated token ids (a stop token or stop string
    included), their log-probs and why generation ended: "stop" (EOS, a stop token id or a stop
    string) or "length" (max_new_tokens reached). Two log-probs per token:
    - log_probs: the behaviour log-prob, under the distribution the token was sampled from (after
      temperature, top-k and top-p: the truncated, renormalised one); rollout correction's;
    - untruncated_log_probs: under the temperature alone (None: the same, nothing was truncated),
      what the trainer computes; the rollout-vs-trainer mismatch metric's."""

    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    finish_reason: Literal["stop", "length"]
    untruncated_log_probs: Optional[tuple[float, ...]] = None
    versions: Optional[tuple[int, ...]] = None  # per token: the policy version that sampled it, when the caller tracks them (async rollout)
    # per token, with params.top_logprobs = k: the k most likely (token id, log-prob) under the distribution
    # sampled from (log_probs'), most likely first
    top_logprobs: Optional[tuple[tuple[tuple[int, float], ...], ...]] = None
    # MoE with routing replay (models/routing.py): the experts each position used, [len(prompt) + n, layers, top_k]
    # (the prompt the backend held, then the tokens; -1 = not recorded, e.g. the last token, never fed back)
    routed_experts: Optional[torch.Tensor] = field(default=None, compare=False)

    @property
    def untruncated(self) -> tuple[float, ...]:
        return self.log_probs if self.untruncated_log_probs is None else self.untruncated_log_probs

    def cut(self, n: int) -> "Completion":
        """The first n tokens, finish_reason "length" (a request's own limit inside a shared call)."""
        return Completion(self.token_ids[:n], self.log_probs[:n], "length",
                          None if self.untruncated_log_probs is None else self.untruncated_log_probs[:n],
                          None if self.versions is None else self.versions[:n],
                          None if self.top_logprobs is None else self.top_logprobs[:n],
                          None if self.routed_experts is None else self.routed_experts[: self.routed_experts.shape[0] - len(self.token_ids) + n])


def _to_object_array(key: str, value: Any) -> np.ndarray:
    """Per-sample values -> 1-D object array of length len(value).

    ``np.array(list_of_lists)`` would build a 2-D array (or fail on ragged input), so the array
    is allocated empty and filled element by element.
    """
    if isinstance(value, np.ndarray) and value.dtype == object and value.ndim == 1:
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"non-tensor {key!r} must be a list or 1-D array of per-sample values, got {type(value).__name__}")
    items = list(value)
    arr = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        arr[i] = item
    return arr


def _row_count(key: str, value: Union[torch.Tensor, np.ndarray]) -> int:
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        raise ValueError(f"tensor {key!r} is 0-dim; batch tensors need a leading batch dimension")
    return int(value.shape[0])


def _values_equal(a: Any, b: Any) -> bool:
    """Equality that works for tensors, arrays and plain Python objects (used by `union`)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a_arr, b_arr = np.asarray(a), np.asarray(b)
        if a_arr.shape != b_arr.shape:
            return False
        if a_arr.dtype == object or b_arr.dtype == object:
            return all(_values_equal(x, y) for x, y in zip(a_arr.ravel(), b_arr.ravel()))
        return bool(np.array_equal(a_arr, b_arr))
    result = a == b
    return bool(result) if not isinstance(result, (np.ndarray, torch.Tensor)) else _values_equal(a, b)


def _compact(t: torch.Tensor) -> torch.Tensor:
    """Copy `t` if it only views part of its storage, so pickling sends just its own bytes."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t


@dataclass(eq=False)  # field-wise == on dicts of tensors is ambiguous; compare keys explicitly
class Batch:
    """Column store of ``len(self)`` samples: tensors, per-sample objects and batch-level meta."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensors = {k: _to_object_array(k, v) for k, v in self.non_tensors.items()}
        self._check_lengths()

    # ------------------------------------------------------------------ construction / access
    @classmethod
    def from_dict(
        cls,
        tensors: Optional[dict[str, torch.Tensor]] = None,
        non_tensors: Optional[dict[str, Any]] = None,
        meta: Optional[dict[str, Any]] = None,
    ) -> "Batch":
        """Build a batch; lists become object arrays; all lengths must agree (ValueError naming the key)."""
        tensors = dict(tensors or {})
        for k, v in tensors.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"tensor {k!r} must be a torch.Tensor, got {type(v).__name__}")
        return cls(tensors=tensors, non_tensors=dict(non_tensors or {}), meta=dict(meta or {}))

    def _check_lengths(self) -> None:
        expected: Optional[int] = None
        first_key = ""
        for k, v in list(self.tensors.items()) + list(self.non_tensors.items()):
            n = _row_count(k, v)
            if expected is None:
                expected, first_key = n, k
            elif n != expected:
                raise ValueError(f"length mismatch: {k!r} has {n} rows but {first_key!r} has {expected}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for v in self.non_tensors.values():
            return int(v.shape[0])
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str) -> Union[torch.Tensor, np.ndarray]:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"{key!r} not in batch; available keys: {self.keys()}")

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            n = _row_count(key, value)
        else:
            value = _to_object_array(key, value)
            n = len(value)
        if self.keys() and n != len(self):
            raise ValueError(f"cannot set {key!r} with {n} rows on a batch of length {len(self)}")
        # A key lives in exactly one of the two dicts.
        self.tensors.pop(key, None)
        self.non_tensors.pop(key, None)
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensors[key] = value

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.non_tensors)

    def __repr__(self) -> str:
        t = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items())
        nt = ", ".join(self.non_tensors)
        return f"Batch(len={len(self)}, tensors={{{t}}}, non_tensors=[{nt}], meta={self.meta})"

    def _new(self, tensors: dict[str, torch.Tensor], non_tensors: dict[str, np.ndarray]) -> "Batch":
        # Bypass __post_init__ checks: columns produced by one vectorised op per key are consistent.
        out = Batch.__new__(Batch)
        out.tensors, out.non_tensors, out.meta = tensors, non_tensors, dict(self.meta)
        return out

    # ------------------------------------------------------------------ row operations
    def index(self, idx: Index) -> "Batch":
        """Rows selected by an int / int list / slice / LongTensor / bool mask / numpy array."""
        if isinstance(idx, slice):
            t_idx: Any = idx
            np_idx: Any = idx
        else:
            if isinstance(idx, int):
                idx = [idx]
            t_idx = torch.as_tensor(np.asarray(idx) if not isinstance(idx, torch.Tensor) else idx)
            if t_idx.dtype == torch.bool:
                if t_idx.dim() != 1 or t_idx.numel() != len(self):
                    raise ValueError(f"bool mask has shape {tuple(t_idx.shape)}, batch has {len(self)} rows")
            elif t_idx.numel() == 0:
                t_idx = t_idx.to(torch.long)
            elif t_idx.is_floating_point() or t_idx.is_complex():
                raise TypeError(f"index must be integer or bool, got {t_idx.dtype}")
            t_idx = t_idx.cpu().reshape(-1) if t_idx.dtype != torch.bool else t_idx.cpu()
            np_idx = t_idx.numpy()
        tensors = {
            k: v[t_idx if isinstance(t_idx, slice) else t_idx.to(v.device)] for k, v in self.tensors.items()
        }
        non_tensors = {k: v[np_idx] for k, v in self.non_tensors.items()}
        return self._new(tensors, non_tensors)

    def split(self, size: int) -> list["Batch"]:
        """Consecutive pieces of `size` rows; the last one may be smaller."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.index(slice(s, s + size)) for s in range(0, len(self), size)]

    def chunk(self, n: int) -> list["Batch"]:
        """`n` equal parts (e.g. one per worker)."""
        if n <= 0:
            raise ValueError(f"chunk count must be positive, got {n}")
        if len(self) % n != 0:
            raise ValueError(
                f"batch of length {len(self)} cannot be chunked into {n} equal parts; "
                f"call pad_to_multiple({n}) first and unpad the results"
            )
        size = len(self) // n
        return [self.index(slice(i * size, (i + 1) * size)) for i in range(n)]

    @staticmethod
    def concat(batches: list["Batch"]) -> "Batch":
        """Rows of all batches in order; every batch must have the same keys; meta of the first."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for b in batches[1:]:
            if set(b.tensors) != set(first.tensors) or set(b.non_tensors) != set(first.non_tensors):
                raise ValueError(f"concat: key mismatch {sorted(b.keys())} vs {sorted(first.keys())}")
        tensors = {k: torch.cat([b.tensors[k] for b in batches], dim=0) for k in first.tensors}
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors}
        return first._new(tensors, non_tensors)

    def repeat(self, times: int, interleave: bool = True) -> "Batch":
        """Each row `times` times: interleave -> [a, a, b, b]; otherwise [a, b, a, b]."""
        if times <= 0:
            raise ValueError(f"repeat times must be positive, got {times}")
        if interleave:
            tensors = {k: v.repeat_interleave(times, dim=0) for k, v in self.tensors.items()}
            non_tensors = {k: np.repeat(v, times) for k, v in self.non_tensors.items()}
        else:
            tensors = {k: v.repeat(times, *([1] * (v.dim() - 1))) for k, v in self.tensors.items()}
            non_tensors = {k: np.tile(v, times) for k, v in self.non_tensors.items()}
        return self._new(tensors, non_tensors)

    def pad_to_multiple(self, k: int) -> tuple["Batch", int]:
        """Append copies of the first rows (cycling) so that len % k == 0; returns (padded, pad_size)."""
        if k <= 0:
            raise ValueError(f"pad multiple must be positive, got {k}")
        pad_size = (-len(self)) % k
        if pad_size == 0:
            return self, 0
        if len(self) == 0:
            raise ValueError("cannot pad an empty batch")
        pad_rows = torch.arange(pad_size) % len(self)
        return Batch.concat([self, self.index(pad_rows)]), pad_size

    def unpad(self, pad_size: int) -> "Batch":
        """Drop the last `pad_size` rows (inverse of `pad_to_multiple`)."""
        if pad_size < 0 or pad_size > len(self):
            raise ValueError(f"pad_size {pad_size} out of range for batch of length {len(self)}")
        return self if pad_size == 0 else self.index(slice(0, len(self) - pad_size))

    # ------------------------------------------------------------------ key operations
    def select(self, keys: Optional[list[str]] = None) -> "Batch":
        """A batch with only `keys` (all if None); columns are shared, meta copied."""
        keys = self.keys() if keys is None else list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"keys {missing} not in batch; available keys: {self.keys()}")
        return self._new(
            {k: self.tensors[k] for k in keys if k in self.tensors},
            {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
        )

    def pop(self, keys: list[str]) -> "Batch":
        """Remove `keys` from this batch and return them as a new batch (meta copied)."""
        out = self.select(keys)
        for k in keys:
            self.tensors.pop(k, None)
            self.non_tensors.pop(k, None)
        return out

    def union(self, other: "Batch") -> "Batch":
        """Merged keys and meta; shared keys (and meta entries) must be equal."""
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"union: lengths differ ({len(self)} vs {len(other)})")
        for k in set(self.keys()) & set(other.keys()):
            if not _values_equal(self[k], other[k]):
                raise ValueError(f"union: key {k!r} present in both batches with different values")
        for k in set(self.meta) & set(other.meta):
            if not _values_equal(self.meta[k], other.meta[k]):
                raise ValueError(f"union: meta {k!r} differs ({self.meta[k]!r} vs {other.meta[k]!r})")
        out = self._new({**self.tensors, **other.tensors}, {**self.non_tensors, **other.non_tensors})
        out.meta.update(other.meta)
        return out

    def to(self, device: Union[str, torch.device]) -> "Batch":
        """All tensors moved to `device` (non-tensors and meta unchanged)."""
        return self._new({k: v.to(device) for k, v in self.tensors.items()}, dict(self.non_tensors))

    # ------------------------------------------------------------------ pickling (Ray)
    def __getstate__(self) -> dict[str, Any]:
        return {
            "tensors": {k: _compact(v) for k, v in self.tensors.items()},
            "non_tensors": self.non_tensors,
            "meta": self.meta,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tensors = state["tensors"]
        self.non_tensors = state["non_tensors"]
        self.meta = state["meta"]
