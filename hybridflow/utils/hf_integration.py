"""FSDP2 on a model you already loaded, directly or through accelerate.

    model = wrap_hf_model_with_fsdp(AutoModelForCausalLM.from_pretrained(path),
                                    {"mixed_precision": None, "offload_params": False, "sharding_strategy": "FULL_SHARD"})
    model = prepare_fsdp_model(model, accelerator, fsdp_config)

Both shard every decoder layer and then the root over all ranks of the default process group, like
the trainer's workers (`parallel/fsdp.py`). Without one they start it as `init_distributed()` does:
under torchrun / accelerate launch from its environment, in a plain `python script.py` a
one-process group. `mixed_precision` takes the run config's spellings: false / None (off), bf16,
fp16, or true / "amp" = the device's preferred low precision (bf16 on CPU and on GPUs that compute
it, else fp16; `config/derive.py`), logged once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridflow.config.derive import resolve_mixed_precision
from hybridflow.parallel.fsdp import MIXED_PRECISION_DTYPES, apply_fsdp2, decoder_layers, make_mesh
from hybridflow.utils.distributed import init_distributed

FSDP_KEYS = ("mixed_precision", "offload_params", "sharding_strategy", "reshard_after_forward")


def _options(fsdp_config: Any, device: str) -> dict:
    """A dict with FSDP_KEYS, or an `FSDPConfig` (param_offload is offload_params there), with
    mixed_precision resolved for `device` (None / "bf16" / "fp16")."""
    if fsdp_config is None:
        return {}
    if not isinstance(fsdp_config, dict):
        fsdp_config = {"mixed_precision": fsdp_config.mixed_precision, "offload_params": fsdp_config.param_offload,
                       "sharding_strategy": fsdp_config.sharding_strategy, "reshard_after_forward": fsdp_config.reshard_after_forward}
    unknown = sorted(set(fsdp_config) - set(FSDP_KEYS))
    if unknown:
        raise ValueError(f"unknown fsdp_config keys {unknown}; known: {list(FSDP_KEYS)}")
    return {**fsdp_config, "mixed_precision": resolve_mixed_precision(fsdp_config.get("mixed_precision"), device, "fsdp_config.mixed_precision")}


def wrap_hf_model_with_fsdp(model: nn.Module, fsdp_config: Any = None) -> nn.Module:
    """FSDP2 (`fully_shard`) over every rank: each holds ~1/world of every parameter."""
    device = next(model.parameters()).device.type
    o = _options(fsdp_config, device)  # a bad key or spelling fails before any process group starts
    if not dist.is_initialized():
        init_distributed()
    return apply_fsdp2(model, make_mesh(device, dist.get_world_size()), o.get("reshard_after_forward", True), o.get("offload_params", False),
                       sharding_strategy=o.get("sharding_strategy"), mixed_precision=o.get("mixed_precision"))


def prepare_fsdp_model(model: nn.Module, accelerator=None, fsdp_config: Any = None) -> nn.Module:
    """Through accelerate: with an accelerator whose FSDP plugin is FSDP2 (GPU and other accelerator
    devices), `accelerator.prepare(model)` shards it, wrapping the decoder layers; accelerate has no
    FSDP for CPU processes (its MULTI_CPU mode is DDP), so there the same FSDP2 sharding is applied
    here. Returns the sharded model; the accelerator still drives the optimizer and data."""
    if accelerator is None:
        from accelerate import Accelerator, FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # accelerate puts the model on the GPU when there is one: mixed_precision true / amp is that device's
        o = _options(fsdp_config, "cuda" if torch.cuda.is_available() else next(model.parameters()).device.type)
        mp = o.get("mixed_precision")
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=o.get("reshard_after_forward", True),
                                                cpu_offload=o.get("offload_params", False), auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=sorted({type(m).__name__ for m in decoder_layers(model)}),
                                                mixed_precision_policy=MixedPrecisionPolicy(param_dtype=MIXED_PRECISION_DTYPES[mp], reduce_dtype=torch.float32)
                                                if mp else None)
        accelerator = Accelerator(fsdp_plugin=plugin)
    if getattr(accelerator, "is_fsdp2", False):
        return accelerator.prepare(model)
    return wrap_hf_model_with_fsdp(model, fsdp_config)
