"""FLOP accounting for the benches: the machine's measured matmul peak and the FLOPs of an RL step.

Per sequence of L tokens through a decoder with M matmul parameters (every linear layer and the
LM head; the embedding lookup does no matmul), n layers and attention width a = heads x head_dim:

    forward      2 M L  +  2 n a L^2            (causal: QK^T and AV each ~L^2/2 dot products of width a)
    fwd + bwd    3 x forward                   (the backward is twice the forward)
    generation   prefill over the P prompt tokens: 2 M P + 2 n a P^2,
                 then each new token t (t = 0 .. R-1): 2 M + 4 n a (P + t)  (one query against P + t keys)

The LM head's V x H of M is counted only at the positions whose logits are computed: an RL
log-prob or update pass projects the R response positions of a sequence (engine/model.py and TRL
alike), and a prefill only its last position (HF generate and vLLM keep one position's logits), so
the head over L - R (or P - 1) other positions is work nobody does and is not counted
(`logits=`; without it every position counts, as torch's counter sees a plain HF forward).

MFU = FLOPs / seconds / peak, where the peak is `matmul_peak` measured in the same run with the
thread count the stage's processes use (hybridflow's workers: 1 thread each, 2 workers; TRL: one
process with torch's threads), so the fraction says how far a stage is from what this machine's
matmuls reach, not from a datasheet.
"""

from __future__ import annotations

import time

import torch


def matmul_params(arch) -> int:
    """M: the parameters that take part in a matmul per token (the LM head counts even when tied)."""
    n = 0
    for name, shape in arch.param_shapes().items():
        if len(shape) == 2 and "embed_tokens" not in name:
            n += shape[0] * shape[1]
    return n + (arch.vocab * arch.hidden if arch.tied else 0)


def forward_flops(arch, lengths: list[int], logits: list[int] | None = None) -> float:
    """One forward over sequences of these lengths (prompt + response, no padding), the LM head at
    `logits[i]` positions of sequence i (None: at every position)."""
    m, a, head = matmul_params(arch), arch.heads * arch.head_dim, arch.vocab * arch.hidden
    logits = lengths if logits is None else logits
    return float(sum(2 * (m - head) * n + 2 * head * k + 2 * arch.layers * a * n * n for n, k in zip(lengths, logits)))


def generation_flops(arch, prompt_lengths: list[int], response_lengths: list[int]) -> float:
    """Prefill of each prompt (the LM head at its last position only), then one decode step per
    generated token (with a KV cache)."""
    m, a, head = matmul_params(arch), arch.heads * arch.head_dim, arch.vocab * arch.hidden
    total = 0.0
    for p, r in zip(prompt_lengths, response_lengths):
        total += 2 * (m - head) * p + 2 * head + 2 * arch.layers * a * p * p
        total += sum(2 * m + 4 * arch.layers * a * (p + t) for t in range(r))
    return total


def matmul_peak(dtype: torch.dtype, threads: int, size: tuple[int, int, int] = (2048, 576, 1536), seconds: float = 1.0,
                device: str = "cpu") -> float:
    """FLOP/s of [m, k] activations through a [n, k] weight (`F.linear`, the layout of every
    nn.Linear) on `threads` threads (the best of repeated timings). The layout matters on CPUs
    without bf16 units: there a bf16 `a @ b` with b [k, n] contiguous measured 1.1 GFLOP/s and the
    same product through `F.linear` 7.2, so a peak taken the other way made bf16 MFU exceed 1.
    device="cuda": on the current GPU (threads ignored; each timing synchronized), where a peak
    needs large products: pass e.g. size=(8192, 8192, 8192) (`device_peak`)."""
    import torch.nn.functional as F

    m, k, n = size
    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    try:
        x, w = torch.randn(m, k, dtype=dtype, device=device), torch.randn(n, k, dtype=dtype, device=device)
        for _ in range(3):
            F.linear(x, w)
        sync()
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            F.linear(x, w)
            sync()
            best = min(best, time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return 2 * m * k * n / best


def device_peak(dtype: torch.dtype, device: str, threads: int = 1) -> float:
    """The matmul peak a stage on `device` can reach: on a GPU the best of a few large products
    (8192^3 and 4096^3: the card's, measured, not its datasheet's); on a CPU `matmul_peak`'s
    default product on `threads` threads."""
    if device.startswith("cuda"):
        return max(matmul_peak(dtype, 1, size, seconds=1.0, device=device) for size in ((8192, 8192, 8192), (4096, 4096, 4096)))
    return matmul_peak(dtype, threads)
