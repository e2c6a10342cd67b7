"""Kernel choices for bf16 on a CPU: which attention implementation the training engine runs.

On CPU PyTorch's `scaled_dot_product_attention` dispatches to its flash-attention kernel, which in
bf16 runs far below the matmul units: on a CPU with AMX, one layer of SmolLM2-135M (16 x 61 tokens,
9 query / 3 KV heads of 64) took ~30 ms forward + backward in bf16 against ~8-10 ms in fp32, while
the same attention as HF's "eager" implementation (two batched matmuls, which oneDNN runs on AMX,
and a softmax in fp32) took ~8 ms in bf16 (docs/performance.md). So a bf16 engine on CPU switches
an HF model from "sdpa" to "eager" attention; fp32, CUDA and other implementations are left alone.
Both implementations compute the same attention (the same masks, packed sequences included);
only their rounding differs.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

log = logging.getLogger(__name__)


def prefer_cpu_bf16_attention(model: nn.Module, compute_dtype: torch.dtype, device: str) -> bool:
    """Switch `model` (an HF model) from SDPA to eager attention when it computes in bf16 on CPU;
    whether it switched."""
    cfg = getattr(model, "config", None)
    if not str(device).startswith("cpu") or compute_dtype != torch.bfloat16 or getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    if not hasattr(model, "set_attn_implementation"):
        return False
    model.set_attn_implementation("eager")
    log.info("bf16 on CPU: eager attention instead of SDPA (its CPU flash kernel is slower in bf16)")
    return True
