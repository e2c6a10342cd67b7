"""`init_distributed`: join the process group of a torchrun launch, or make a 1-process one.

    info = init_distributed()            # under torchrun: RANK/WORLD_SIZE/MASTER_* from the env
    info.rank, info.world_size, info.device, info.backend
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from hybridflow.parallel.process_group import init_torchrun, pick_device


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: str  # "cpu" | "cuda"
    backend: str  # "gloo" | "nccl"


def init_distributed(config=None, timeout_s: float | None = None) -> DistInfo:
    """config: a HybridFlowConfig (its trainer.device and collective_timeout_s) or None (auto device, 600 s)."""
    device = pick_device(config.trainer.device if config is not None else "auto")
    timeout = timeout_s or (config.trainer.collective_timeout_s if config is not None else 600.0)
    if not dist.is_initialized() and "WORLD_SIZE" not in os.environ:  # a plain `python script.py`: one rank
        from datetime import timedelta

        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout))
    else:
        init_torchrun(device, timeout)
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), device, dist.get_backend())
