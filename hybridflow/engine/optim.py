"""AdamW plus a warm-up schedule (transformers' schedulers; constant or cosine with a floor)."""

from __future__ import annotations

import math

import torch
from transformers import get_scheduler

from hybridflow.config.schema import OptimConfig


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    total = cfg.total_training_steps if cfg.total_training_steps > 0 else total_steps
    warmup = cfg.lr_warmup_steps if cfg.lr_warmup_steps >= 0 else int(cfg.lr_warmup_steps_ratio * total)
    if cfg.lr_scheduler_type == "cosine":
        return get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=warmup, num_training_steps=max(total, 1), scheduler_specific_kwargs={"min_lr_rate": cfg.min_lr_ratio})
    return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=warmup)


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float, ranks_per_stage: int | None = None) -> float:
    """Clip the global gradient norm (DTensor-aware), step unless it is inf/nan, zero the grads.
    ranks_per_stage: a TP / pipeline layout's tp x dp (parameters on several meshes and stages:
    `parallel.layout.grad_norm_and_clip`); None: FSDP over the group (torch's clip_grad_norm_)."""
    if ranks_per_stage is not None:
        from hybridflow.parallel.layout import grad_norm_and_clip

        grad_norm = grad_norm_and_clip([p for p in model.parameters() if p.requires_grad], grad_clip, ranks_per_stage)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
