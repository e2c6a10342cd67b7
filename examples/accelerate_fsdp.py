"""FSDP2 through accelerate, trained with a DataFlow loop (the accelerate user's shape of code).

    torchrun --standalone --nproc_per_node=2 examples/accelerate_fsdp.py --steps 5   (or: accelerate launch ...)

Loads the tiny model, shards it with `prepare_fsdp_model`, and runs SFT steps on the digit_max
demonstrations as a one-stage DataFlow, printing `Step N, Loss: x` on rank 0.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.algorithms import logprobs_from_logits
from hybridflow.data.dataset import SFTDataset, collate_sft
from hybridflow.data.tasks import make_max_task
from hybridflow.models.tiny import make_tiny_model
from hybridflow.protocol import Batch
from hybridflow.trainer.dataflow import DataFlow
from hybridflow.trainer.loader import PromptLoader
from hybridflow.utils.distributed import init_distributed
from hybridflow.utils.hf_integration import prepare_fsdp_model


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", default="runs/accelerate_fsdp")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args(argv)
    info = init_distributed()
    out = os.path.abspath(a.output_dir)
    if info.rank == 0:
        make_max_task(os.path.join(out, "data"))
        make_tiny_model(os.path.join(out, "tiny_model"))
    dist.barrier()
    accelerator = Accelerator()
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "tiny_model"))
    model = prepare_fsdp_model(AutoModelForCausalLM.from_pretrained(os.path.join(out, "tiny_model")), accelerator,
                               {"sharding_strategy": "FULL_SHARD", "offload_params": False, "mixed_precision": None})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = PromptLoader(SFTDataset([os.path.join(out, "data", "sft.parquet")], tok, 32), 8 * info.world_size, collate_sft, seed=0)

    def sft_step(batch: Batch) -> dict[str, float]:
        mine = batch.chunk(info.world_size)[info.rank]  # this rank's share of the global batch
        logits = model(input_ids=mine["input_ids"], attention_mask=mine["attention_mask"], position_ids=mine["position_ids"]).logits
        nll = -logprobs_from_logits(logits[:, :-1], mine["input_ids"][:, 1:])
        mask = mine["loss_mask"][:, 1:]
        loss = (nll * mask).sum() / mask.sum()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return {"loss": loss.item()}

    flow = DataFlow()
    flow.add_stage("sft", sft_step, ["input_ids", "attention_mask", "position_ids", "loss_mask"], [])
    losses = []
    for step in range(1, a.steps + 1):
        result = flow.run(loader.next_batch())
        losses.append(result.metrics["loss"])
        if info.rank == 0:
            print(f"Step {step}, Loss: {losses[-1]:.4f}", flush=True)
    flow.close()
    return losses


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
