"""Mixture-of-experts models (HF's Qwen3-MoE, Mixtral, Qwen2-MoE): what the rest of hybridflow needs to know.

HF v5 keeps an MoE block as `mlp.gate` (a top-k router: `(logits [T, E], top-k weights [T, k],
top-k ids [T, k])` from hidden states [T, H]) and `mlp.experts` (3-D parameters `gate_up_proj`
[E, 2I, H] and `down_proj` [E, H, I]), inside the same decoder layer class as attention, so FSDP2's
one unit per decoder layer (`parallel/fsdp.py`, from `_no_split_modules`) shards the experts with
their layer (FSDP2 splits each 3-D parameter along dim 0, the expert dim). The generation TP table
(`parallel/tensor_parallel.py::gen_shard_dim`) names no expert or router parameter, so they stay
whole (replicated) in every generation layout; a Qwen2-MoE shared expert is a plain MLP and follows
the dense table.

`RouterMonitor` reads the routing through forward hooks on the routers (plain submodules of the
FSDP2 units, so hooks see ordinary tensors), during the actor update only:
- per-expert load: the share of (token, slot) assignments each expert got, per layer; the metrics
  are its min / max / entropy per layer, averaged over layers (`actor/moe/expert_load_*`), on this
  rank's valid (non-padding) tokens, then averaged over ranks by the driver like every metric;
- the load-balancing auxiliary loss (Switch Transformer / HF's `load_balancing_loss_func`, per
  layer: E * sum_e f_e * P_e, f_e the share of assignments to e times k, P_e the mean router
  probability of e), times `model.router_aux_loss_coef`, averaged over layers. Its gradient is
  added in the router's backward (Megatron's MoEAuxLossAutoScaler trick: the top-k weights pass
  through an identity whose backward also differentiates the aux loss), so no loss function or
  pipeline stage needs to know about it. Each forward's weight is its share of the update's valid
  tokens times the number of optimizer steps, i.e. the token-weighted mean per optimizer step when
  mini-batches are evenly sized.
Simplified: no router z-loss, no capacity (HF's blocks drop no tokens), no expert parallelism.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any, Iterator

import torch
import torch.nn as nn

# arch name (make-model --arch) -> (HF config class name, model_type)
MOE_ARCHS = {"qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig"}


def moe_shape(config: Any) -> tuple[int, int] | None:
    """(experts, experts per token) of an HF config (object or config.json dict); None for a dense model."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts")
    top_k = get("num_experts_per_tok")
    return (int(experts), int(top_k)) if experts and top_k else None


def is_moe_checkpoint(path: str) -> bool:
    """Whether the HF checkpoint at `path` (its config.json) is a mixture-of-experts model."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return moe_shape(json.load(f)) is not None
    except (OSError, ValueError):
        return False


def moe_config(arch: str, common: dict, intermediate_size: int, num_experts: int, top_k: int, shared_expert: bool):
    """The HF config of a tiny MoE of `arch` (one of MOE_ARCHS): every layer sparse, `num_experts`
    experts of width intermediate_size // 2, `top_k` per token; Qwen2-MoE adds its shared expert
    (width intermediate_size) when `shared_expert`."""
    import transformers

    cls = getattr(transformers, MOE_ARCHS[arch])
    expert_width = max(intermediate_size // 2, 1)
    kwargs = dict(common, num_experts_per_tok=top_k, output_router_logits=False, router_aux_loss_coef=0.0)
    if arch == "mixtral":  # Mixtral's experts have the dense MLP's width: intermediate_size is theirs
        return cls(**dict(kwargs, intermediate_size=expert_width), num_local_experts=num_experts)
    kwargs.update(num_experts=num_experts, moe_intermediate_size=expert_width, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if arch == "qwen2_moe":
        kwargs["shared_expert_intermediate_size"] = intermediate_size if shared_expert else 0
    return cls(**kwargs)


def routers(model: nn.Module) -> list[nn.Module]:
    """The router of every MoE block, in layer order (a module with `gate` and `experts` children)."""
    return [m.gate for m in model.modules() if isinstance(getattr(m, "gate", None), nn.Module) and isinstance(getattr(m, "experts", None), nn.Module)]


class _AuxGrad(torch.autograd.Function):
    """Identity on `x` whose backward also sends gradient 1 into `aux` (a scalar that already carries its weight)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


def load_balancing_loss(logits: torch.Tensor, ids: torch.Tensor, experts: int, valid: torch.Tensor | None) -> torch.Tensor:
    """HF's load-balancing loss of one layer: E * sum_e f_e * P_e over valid tokens (f_e sums to k).
    logits [T, E] (differentiable), ids [T, k] the chosen experts, valid [T] bool or None (all)."""
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    w = torch.ones(ids.shape[0], device=logits.device) if valid is None else valid.float()  # [T]
    counts = torch.zeros(experts, device=logits.device).index_add_(0, ids.reshape(-1), w.repeat_interleave(ids.shape[1]))  # [E]
    rows = w.sum().clamp(min=1.0)
    return experts * torch.sum(counts / rows * (probs * w[:, None]).sum(0) / rows)


class RouterMonitor:
    """Forward hooks on every router of `model` (before FSDP2 wraps it: hooks stay on the submodules).

    `with monitor.update(batch, steps):` records the expert load of the forwards inside (not the
    recomputation of a checkpointed layer in backward) and, when aux_coef > 0 and grad is on, adds
    the weighted aux loss's gradient. `metrics()` returns and clears the recorded load."""

    def __init__(self, model: nn.Module, experts: int, top_k: int, aux_coef: float = 0.0):
        self.experts, self.top_k, self.aux_coef = experts, top_k, float(aux_coef)
        self.layers = routers(model)
        self.counts = [torch.zeros(experts, dtype=torch.float64) for _ in self.layers]  # per layer [E]: assignments
        self.aux_sum, self.aux_n = 0.0, 0
        self.active, self.weight_per_token = False, 0.0
        self.valid: torch.Tensor | None = None  # [b*T] bool of the forward in flight (None: every token)
        for i, r in enumerate(self.layers):
            r.register_forward_hook(self._hook(i))
        # The root model's forward sees the attention mask [b, T]; the routers see the flattened tokens [b*T, H].
        model.register_forward_pre_hook(self._mask_hook, with_kwargs=True)

    @classmethod
    def attach(cls, model: nn.Module, aux_coef: float = 0.0) -> "RouterMonitor | None":
        shape = moe_shape(getattr(model, "config", None))
        if shape is None or not routers(model):
            return None
        return cls(model, *shape, aux_coef=aux_coef)

    def _mask_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        self.valid = mask.reshape(-1).bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _hook(self, layer: int):
        def hook(module: nn.Module, inputs: tuple, out: Any):
            if not self.active or not isinstance(out, tuple) or len(out) != 3:
                return None
            logits, weights, ids = out  # [T, E], [T, k], [T, k]
            valid = self.valid if self.valid is not None and self.valid.numel() == ids.shape[0] else None
            recompute = torch._C._current_graph_task_id() != -1  # a checkpointed layer run again inside backward
            if not recompute:
                chosen = ids if valid is None else ids[valid.to(ids.device)]
                self.counts[layer] += torch.bincount(chosen.reshape(-1).cpu(), minlength=self.experts).double()
            if self.aux_coef > 0 and torch.is_grad_enabled() and module.training:
                aux = load_balancing_loss(logits, ids, self.experts, None if valid is None else valid.to(ids.device))
                tokens = float(ids.shape[0] if valid is None else valid.sum())
                if not recompute:
                    self.aux_sum, self.aux_n = self.aux_sum + float(aux.detach()), self.aux_n + 1
                scale = self.aux_coef * tokens * self.weight_per_token / len(self.layers)
                return logits, _AuxGrad.apply(weights, aux * scale), ids
            return None

        return hook

    @contextlib.contextmanager
    def update(self, batch: Any, steps: int) -> Iterator["RouterMonitor"]:
        """Record the forwards of one update call over `batch` (its attention_mask [b, L] counts the
        valid tokens) taking `steps` optimizer steps."""
        tokens = float(batch["attention_mask"].sum())
        self.active, self.weight_per_token = True, (steps / tokens if tokens else 0.0)
        try:
            yield self
        finally:
            self.active, self.valid = False, None

    def shares(self) -> torch.Tensor:
        """[layers, E]: each layer's share of assignments per expert (rows sum to 1; 0 rows if nothing routed)."""
        c = torch.stack(self.counts)  # [layers, E]
        return c / c.sum(-1, keepdim=True).clamp(min=1.0)

    def metrics(self, prefix: str = "actor/moe") -> dict[str, float]:
        """min / max / entropy (nats, at most log E) of each layer's expert shares, averaged over the
        layers that routed tokens; the aux loss's mean when it is on. Clears the counts."""
        s = self.shares()
        used = s.sum(-1) > 0
        out: dict[str, float] = {}
        if used.any():
            s = s[used]
            ent = -(s * torch.log(s.clamp(min=1e-30))).sum(-1)  # [layers]
            out = {f"{prefix}/expert_load_min": float(s.min(-1).values.mean()), f"{prefix}/expert_load_max": float(s.max(-1).values.mean()),
                   f"{prefix}/expert_load_entropy": float(ent.mean())}
        if self.aux_n:
            out[f"{prefix}/aux_loss"] = self.aux_sum / self.aux_n
        self.counts = [torch.zeros(self.experts, dtype=torch.float64) for _ in self.layers]
        self.aux_sum, self.aux_n = 0.0, 0
        return out


def max_entropy(experts: int) -> float:
    """The entropy of a perfectly balanced load over `experts` (nats)."""
    return math.log(experts)


@contextlib.contextmanager
def recording(monitor: RouterMonitor | None, batch: Any, plan: Any, prefix: str) -> Iterator[dict[str, float]]:
    """Around one update call of `plan` (`run_plan.UpdatePlan`) over `batch`: yields a dict that holds
    the monitor's metrics under `prefix` once the block ends ({} for a dense model, monitor None)."""
    out: dict[str, float] = {}
    if monitor is None:
        yield out
        return
    rows = int(batch["attention_mask"].shape[0])
    steps = plan.epochs * max(1, math.ceil(rows / (plan.mini_rows or rows or 1)))
    with monitor.update(batch, steps):
        yield out
    out.update(monitor.metrics(prefix))
