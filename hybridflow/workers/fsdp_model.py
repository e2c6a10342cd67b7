"""Shared pieces of the FSDP2 workers: loading an HF model, micro-batched forward passes.

Sequence layout used everywhere (verl's): `input_ids` [B, P+R] = left-padded prompt (P tokens)
followed by the right-padded response (R tokens). The logits that predict response token j sit
at position P-1+j, so response logits are `logits[:, -R-1:-1]`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hybridflow.config.schema import ModelConfig
from hybridflow.protocol import Batch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def load_hf_model(cfg: ModelConfig, device: str, kind: str = "causal_lm") -> nn.Module:
    """An HF model from a local path; kind "value" puts a 1-output token head on the backbone."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    dtype = DTYPES[cfg.dtype]
    if kind == "value":
        from transformers import AutoConfig

        # No dropout on the value head (HF's token-classification heads default to 0.1): values feed GAE.
        config = AutoConfig.from_pretrained(cfg.path, num_labels=1)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(cfg.path, config=config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype)
    if cfg.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model.to(device)


def response_logits(model: nn.Module, mb: Batch, temperature: float = 1.0) -> torch.Tensor:
    """Logits [b, R, V] (or [b, R, 1] for a value head) at the positions that predict the response."""
    resp_len = mb["responses"].shape[1]
    out = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"], use_cache=False)
    logits = out.logits[:, -resp_len - 1 : -1, :].float()
    return logits / temperature if temperature != 1.0 else logits


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    return batch.split(max(1, size))
