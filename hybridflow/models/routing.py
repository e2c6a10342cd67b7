"""Routing replay (R3) for mixture-of-experts models: the experts the rollout chose, replayed in training.

An MoE layer's router picks top-k experts per token from its logits. The rollout (KV-cached,
batched HF `generate`) and the trainer (one padded or packed forward) compute those logits with
other reductions, so a near tie can go the other way and the token then runs through other experts:
a log-prob difference far above rounding. With `actor_rollout_ref.actor.router_replay.mode=R3`
(verl's key) the rollout records, per token and layer, the ids of the experts it used, and the
trainer's log-prob and update forwards use those ids instead of their own top-k. The router still
computes its logits and softmax (its gradient flows), only the selection is replaced: the weights
are the softmax probabilities at the recorded ids, renormalised as the model's own router does.

Layout (verl's): `routed_experts` [b, P+R, layers, top_k], int8 (int16 past 127 experts), aligned
with `input_ids` [b, P+R]; -1 where nothing was recorded: padding, and the last response token (it
is sampled, never fed back, so no forward routed it; it changes no response log-prob either).
Prompt tokens are recorded from the prefill forward, so every position whose output the response's
log-probs depend on is replayed. Where -1, the trainer routes naturally.

- `RouteRecorder`: forward hooks on the routers of a generation model; `capture()` collects the ids
  of every forward inside it, [tokens, layers, k] per forward (the HF backend: `rollout/hf_rollout.py`,
  the continuous-batching scheduler: `rollout/scheduler.py`).
- `RouteReplayer`: forward hooks on the routers of the trained model (before FSDP2 wraps it; the
  routers are plain submodules of a decoder-layer unit, so the hooks see plain tensors), prepended so
  the expert-load monitor (`models/moe.py`) sees the replayed ids. `set_target(model, mb, packed)` is
  called by `engine/model.py` before each micro-batch's forward; the target stays until the next one
  so a checkpointed layer recomputed in backward replays the same ids.
- `routing_agreement`: per layer, the share of tokens whose expert set differs between two records
  (the mismatch doctor, the bench).

Simplified: R2 (replaying the old-log-prob pass's routing in the update) is not built; the exact
rollout mode needs no replay (its sampler is the trainer's computation, routing included) and is
refused with it; pipeline stages and multi-turn agent batches do not carry the ids (refused).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

from hybridflow.config.validate import register_check
from hybridflow.models.moe import moe_shape, routers

ROUTED_EXPERTS = "routed_experts"  # the batch key (verl's name): [b, P+R, layers, top_k], -1 = not recorded
MODES = ("disabled", "R3")


def routes_dtype(experts: int) -> torch.dtype:
    """The smallest signed integer type that holds expert ids 0..experts-1 and -1."""
    return torch.int8 if experts <= 127 else torch.int16 if experts <= 32767 else torch.int32


def has_routers(model: nn.Module) -> bool:
    """Whether `model` is a mixture-of-experts model whose routers can be recorded."""
    return moe_shape(getattr(model, "config", None)) is not None and bool(routers(model))


def _moe_routers(model: nn.Module, why: str) -> tuple[list[nn.Module], int, int]:
    """`model`'s routers in layer order, its experts and top-k; a dense model raises naming `why`."""
    shape = moe_shape(getattr(model, "config", None))
    layers = routers(model)
    if shape is None or not layers:
        raise ValueError(f"{type(model).__name__} is not a mixture-of-experts model: {why}")
    return layers, shape[0], shape[1]


class RouteRecorder:
    """Forward hooks on every router of `model`; inside `capture()` each router call's top-k ids
    [T, k] are kept and grouped per forward (the routers run in layer order once per forward)."""

    def __init__(self, model: nn.Module):
        self.layers, self.experts, self.top_k = _moe_routers(model, "it has no routers to record")
        self.dtype = routes_dtype(self.experts)
        self._calls: list[torch.Tensor] | None = None
        self.handles = [r.register_forward_hook(self._hook) for r in self.layers]

    def remove(self) -> None:
        """Take the hooks off the routers (a recorder for one replay, e.g. the mismatch doctor's)."""
        for h in self.handles:
            h.remove()

    @classmethod
    def attach(cls, model: nn.Module) -> "RouteRecorder | None":
        return cls(model) if has_routers(model) else None

    def _hook(self, module: nn.Module, inputs: tuple, out: Any) -> None:
        if self._calls is not None and isinstance(out, tuple) and len(out) == 3:
            self._calls.append(out[2].detach().to(self.dtype))  # [T, k]

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """Yields a list that, once the block ends, holds one [T, layers, k] tensor per forward run inside."""
        forwards: list[torch.Tensor] = []
        self._calls = []
        try:
            yield forwards
        finally:
            calls, self._calls = self._calls, None
        L = len(self.layers)
        if len(calls) % L:
            raise RuntimeError(f"routing record: {len(calls)} router calls is not a whole number of forwards over {L} MoE layers")
        forwards.extend(torch.stack(calls[i:i + L], dim=1).cpu() for i in range(0, len(calls), L))  # each [T, L, k]

    def empty(self, n: int) -> torch.Tensor:
        """[n, layers, k] of -1 (nothing recorded)."""
        return torch.full((n, len(self.layers), self.top_k), -1, dtype=self.dtype)


def merge_routes(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    """Two records of one sequence's prefix ([n, L, k] each, -1 = not recorded): the longer one with the
    positions `new` recorded taken from it (the last forward that computed a position wins)."""
    if new is None or old is None:
        return new if old is None else old
    n = max(old.shape[0], new.shape[0])
    out = torch.full((n, *new.shape[1:]), -1, dtype=new.dtype)
    out[: old.shape[0]] = old
    have = new[:, 0, 0] >= 0  # [n_new]: a position is recorded for every layer or for none
    out[: new.shape[0]][have] = new[have]
    return out


def batch_routes(rows: list[torch.Tensor | None], prompt_lens: list[int], P: int, R: int) -> torch.Tensor | None:
    """Per-completion records ([p_i + n_i, L, k]: the unpadded prompt then the response) -> [b, P+R, L, k]
    aligned with left-padded prompts [b, P] and right-padded responses [b, R]; None when none was recorded."""
    first = next((r for r in rows if r is not None), None)
    if first is None:
        return None
    out = torch.full((len(rows), P + R, *first.shape[1:]), -1, dtype=first.dtype)
    for i, (r, p) in enumerate(zip(rows, prompt_lens)):
        if r is not None:
            seg = r[: p + R]  # [p + n, L, k], n <= R
            out[i, P - p: P - p + seg.shape[0]] = seg
    return out


class RouteReplayer:
    """Forward hooks on every router of the trained `model` that replace its top-k ids with a target's
    (see the module docstring). The target is [T, L, k] in the order the routers see the tokens
    (the micro-batch's [b*T] rows, or the packed valid tokens); -1 rows route naturally."""

    def __init__(self, model: nn.Module):
        self.layers, self.experts, self.top_k = _moe_routers(model, "routing replay needs MoE routers")
        self.target: torch.Tensor | None = None  # [T, L, k] long, -1 = natural
        # (token, layer) pairs whose ids came from the target, and of those the pairs whose own top-k set was another
        # than the target's, since the last take_counts: device tensors, summed without a host sync per router
        self.replayed_pairs: torch.Tensor | int = 0
        self.differing_pairs: torch.Tensor | int = 0
        for i, r in enumerate(self.layers):
            r.register_forward_hook(self._hook(i), prepend=True)
        model._route_replayer = self  # engine/model.py finds it on the module it runs

    def _hook(self, layer: int):
        def hook(module: nn.Module, inputs: tuple, out: Any):
            if self.target is None or not isinstance(out, tuple) or len(out) != 3:
                return None
            logits, weights, ids = out  # [T, E], [T, k], [T, k]
            if self.target.shape[0] != ids.shape[0]:
                raise RuntimeError(f"routing replay: the router of MoE layer {layer} sees {ids.shape[0]} tokens but the recorded "
                                   f"{ROUTED_EXPERTS} give {self.target.shape[0]} for this forward")
            forced = self.target[:, layer].to(ids.device)  # [T, k]
            use = forced[:, :1] >= 0  # [T, 1]
            chosen = torch.where(use, forced, ids)  # [T, k]
            probs = torch.softmax(logits.float(), dim=-1)  # [T, E]: as the HF routers compute it
            top = probs.gather(1, chosen)  # [T, k]
            if getattr(module, "norm_topk_prob", True):  # Mixtral always renormalises; Qwen when norm_topk_prob
                top = top / top.sum(dim=-1, keepdim=True)
            self.replayed_pairs = self.replayed_pairs + use.sum()
            # the replay changed this token's experts (not just their order): the routing the rollout saw differs from this forward's
            self.differing_pairs = self.differing_pairs + ((forced.sort(-1).values != ids.sort(-1).values).any(-1, keepdim=True) & use).sum()
            return logits, top.to(weights.dtype), chosen

        return hook

    def set(self, target: torch.Tensor | None) -> None:
        self.target = None if target is None else target.long()

    def take_counts(self) -> tuple[int, int]:
        """(replayed, differing) (token, layer) pairs since the last call, then zero."""
        out = (int(self.replayed_pairs), int(self.differing_pairs))
        self.replayed_pairs = self.differing_pairs = 0
        return out


def set_target(model: nn.Module, mb: Any, packed: bool) -> None:
    """Before a training forward of `model` on micro-batch `mb`: the replayer (if the model has one)
    takes mb's routed_experts [b, P+R, L, k] in the token order the routers see ([b*(P+R)] padded,
    the valid tokens when packed); none in mb: natural routing."""
    replayer: RouteReplayer | None = getattr(model, "_route_replayer", None)
    if replayer is None:
        return
    if ROUTED_EXPERTS not in mb:
        replayer.set(None)
        return
    ids = mb[ROUTED_EXPERTS]  # [b, T, L, k]
    if packed:
        ids = ids[mb["attention_mask"].bool()]  # [T_valid, L, k]
    replayer.set(ids.reshape(-1, *ids.shape[-2:]))


def clear(model: nn.Module) -> None:
    """No replay on the next forwards of `model` (after a log-prob or update call)."""
    replayer = getattr(model, "_route_replayer", None)
    if replayer is not None:
        replayer.set(None)


def routing_agreement(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Per layer, the share of `mask`ed positions whose expert SET differs between records a and b
    ([n, T, L, k]; positions where either is -1 are left out). mask [n, T] bool."""
    both = mask.bool() & (a[..., 0, 0] >= 0) & (b[..., 0, 0] >= 0)  # [n, T]
    if not both.any():
        return [0.0] * a.shape[-2]
    sa, sb = a[both].long().sort(-1).values, b[both].long().sort(-1).values  # [N, L, k]
    return (sa != sb).any(-1).float().mean(0).tolist()


@register_check("router_replay")
def router_replay_problems(mode: str, model_path: str, rollout_name: str, exact: bool, pipeline_stages: int, multi_turn_or_agent: bool) -> list[str]:
    """actor_rollout_ref.actor.router_replay.mode against the run: an MoE checkpoint (model_path), a backend
    that records (hf, not its exact mode), no pipeline stages, no multi-turn agent batches."""
    from hybridflow.config.validate import model_json

    key = "actor_rollout_ref.actor.router_replay.mode"
    if mode not in MODES:
        return [f"{key} must be one of {list(MODES)}, got {mode!r}"]
    if mode == "disabled":
        return []
    out = []
    try:
        shape = moe_shape(model_json(model_path))
    except Exception:  # noqa: BLE001 - a missing checkpoint is reported by the model checks
        shape = ()
    if shape is None:
        out.append(f"{key}={mode} replays the experts of a mixture-of-experts model; {model_path!r} is dense (no experts): set it to disabled")
    if rollout_name != "hf":
        out.append(f"{key}={mode} needs a rollout that records each token's experts; actor_rollout_ref.rollout.name={rollout_name} does not "
                   f"(only hf records them): use actor_rollout_ref.rollout.name=hf or set {key}=disabled")
    elif exact:
        out.append(f"{key}={mode} with actor_rollout_ref.rollout.exact=true: the exact sampler already routes as the trainer does (bit for bit); "
                   f"set {key}=disabled")
    if pipeline_stages > 1:
        out.append(f"{key}={mode} is not wired into pipeline stages: set actor_rollout_ref.actor.pipeline_model_parallel_size=1")
    if multi_turn_or_agent:
        out.append(f"{key}={mode}: multi-turn and agent batches do not carry the recorded experts; set {key}=disabled")
    return out
