"""Which device a process computes on, and joining the process group torchrun describes: the part
of process start-up that the Ray workers (`controller/`), torchrun mode and a user's own loop
(`utils/distributed.py::init_distributed`) share, so none of them imports another."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def pick_device(device: str) -> str:
    """"auto" -> "cuda" where CUDA is available, else "cpu"; anything else as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def init_torchrun(device: str, timeout_s: float) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT); (rank, world)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            from hybridflow.config.loader import ConfigError

            raise ConfigError("trainer.launcher=torchrun but RANK/WORLD_SIZE are not set: start it with "
                              "`torchrun --nproc_per_node=N ...` (or use the default trainer.launcher=ray)")
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
