"""Sharded checkpoints through torch.distributed.checkpoint (DCP).

Layout of one role's checkpoint directory:
    <dir>/            DCP files: model + optimizer state, each rank writing its own shards
    <dir>/extra_rank{r}.pt   lr scheduler state and this rank's RNG states
Loading goes through the same state-dict API, so a checkpoint written by N ranks is resharded
by DCP on load.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hybridflow.parallel.expert_parallel import checkpoint_views, restore


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _options(flatten_optimizer: bool, trainable_only: bool = False):
    """flatten_optimizer: the optimizer's param groups keyed per parameter FQN, as pipeline stages
    need (each holds other parameters, and DCP keeps one copy of a shared `param_groups` list).
    trainable_only: leave frozen parameters out (LoRA: the base is re-read from model.path)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if not (flatten_optimizer or trainable_only):
        return None
    return StateDictOptions(flatten_optimizer_state_dict=flatten_optimizer, ignore_frozen_params=trainable_only, strict=not trainable_only)


def save_sharded(path: str, model, optimizer, scheduler, flatten_optimizer: bool = False, trainable_only: bool = False) -> None:
    os.makedirs(path, exist_ok=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(flatten_optimizer, trainable_only))
    swapped = checkpoint_views(model, model_sd, optim_sd)  # expert parallelism: each EP rank's experts at their own offsets
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    finally:
        restore(swapped)  # the optimizer's state dict may be its live one
    extra = {"scheduler": scheduler.state_dict() if scheduler is not None else None, "rng": rng_state()}
    torch.save(extra, os.path.join(path, f"extra_rank{dist.get_rank()}.pt"))
    dist.barrier()


def load_sharded(path: str, model, optimizer, scheduler, flatten_optimizer: bool = False, trainable_only: bool = False) -> None:
    options = _options(flatten_optimizer, trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    swapped = checkpoint_views(model, model_sd, optim_sd)
    try:
        dcp.load(state, checkpoint_id=path)
    finally:
        restore(swapped)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    extra = torch.load(os.path.join(path, f"extra_rank{dist.get_rank()}.pt"), weights_only=False)
    if scheduler is not None and extra["scheduler"] is not None:
        scheduler.load_state_dict(extra["scheduler"])
    set_rng_state(extra["rng"])
