"""Run by tests/test_hf_integration.py under `torchrun --nproc_per_node=2`: each rank reports
what the helpers gave it (one JSON file per rank in argv[1])."""

import json
import os
import sys

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from hybridflow.utils.distributed import init_distributed
from hybridflow.utils.hf_integration import prepare_fsdp_model, wrap_hf_model_with_fsdp


def held(model) -> tuple[int, int]:
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    return local, sum(p.numel() for p in model.parameters())


out_dir, model_dir = sys.argv[1], sys.argv[2]
info = init_distributed()
report = {"rank": info.rank, "world_size": info.world_size, "backend": info.backend, "device": info.device}
model = wrap_hf_model_with_fsdp(AutoModelForCausalLM.from_pretrained(model_dir),
                                {"sharding_strategy": "FULL_SHARD", "offload_params": False, "mixed_precision": None})
report["wrap"] = held(model)
ids = torch.tensor([[5, 6, 7, 8]])
report["wrap_logits_sum"] = float(model(input_ids=ids).logits.sum())
model = prepare_fsdp_model(AutoModelForCausalLM.from_pretrained(model_dir), None, {"sharding_strategy": "FULL_SHARD"})
report["prepare"] = held(model)
report["prepare_logits_sum"] = float(model(input_ids=ids).logits.sum())
with open(os.path.join(out_dir, f"rank{info.rank}.json"), "w") as f:
    json.dump(report, f)
