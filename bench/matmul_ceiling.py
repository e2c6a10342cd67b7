"""The update's MFU ceiling from its matmuls alone: what the fastest possible update would reach if
nothing but its matmul kernels took time (no elementwise ops, copies, collectives or optimizer).

One forward + backward of a decoder runs, for every linear layer W [out, in] on T tokens, three
products in the layouts autograd gives them:

    forward           y  = x  @ W^T     [T, in]  x [in, out]    (F.linear)
    input gradient    gx = gy @ W       [T, out] x [out, in]
    weight gradient   gW = gy^T @ x     [out, T] x [T, in]      (gy transposed: a strided view)

each 2 T in out FLOPs, so 6 T in out per layer per pass. This times each product at the model's own
shapes (from config.json, one thread, the best of repeated timings), sums them over the layers and
the LM head (over the response positions alone, in chunks of `--chunk`, as the engine's chunked
log-prob head runs it), and
divides the pass's matmul FLOPs by that time and by the peak that `bench/e2e.py` measures
(`flops.matmul_peak`: F.linear at [2048, 576] x [576, 1536]). Attention's two batched products are
left out (at 61 tokens they are ~1% of the FLOPs).

    .venv/bin/python bench/matmul_ceiling.py --model runs/models/smollm2-135m --tokens 976:256,3904:1024
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def best_seconds(fn, seconds: float = 0.3) -> float:
    """The fastest of repeated calls (after two warm-ups), timing for about `seconds`."""
    fn()
    fn()
    best, spent = float("inf"), 0.0
    while spent < seconds:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return best


def product_seconds(tokens: int, out: int, inp: int, dtype: torch.dtype) -> dict[str, float]:
    """Seconds of the three products of one linear layer [out, in] on `tokens` tokens."""
    x, w, gy = torch.randn(tokens, inp, dtype=dtype), torch.randn(out, inp, dtype=dtype), torch.randn(tokens, out, dtype=dtype)
    return {"forward": best_seconds(lambda: F.linear(x, w)),
            "input grad": best_seconds(lambda: gy @ w),
            "weight grad": best_seconds(lambda: gy.t() @ x)}


def layer_shapes(arch) -> list[tuple[int, int]]:
    """[out, in] of every linear weight of one decoder layer (matrices only; norms are vectors)."""
    shapes = []
    for name, shape in arch.param_shapes().items():
        if name.startswith("model.layers.0.") and len(shape) == 2:
            shapes.append((shape[0], shape[1]))
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF checkpoint directory (its config.json)")
    ap.add_argument("--tokens", default="976:256,3904:1024", help="comma-separated tokens:response tokens per micro-batch per worker "
                    "(bench/e2e.py's SmolLM2 run: 16 sequences x (45 + 16) = 976 tokens, 256 of them response positions)")
    ap.add_argument("--precision", default="bf16,fp32")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per chunk of the log-prob head (model.fused_kernel_chunk_size)")
    args = ap.parse_args()

    from flops import matmul_peak

    from hybridflow.planning.arch import load_arch

    torch.set_num_threads(1)
    arch = load_arch(args.model)
    shapes = layer_shapes(arch)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    print(f"{os.path.basename(args.model.rstrip('/'))}: {arch.layers} layers of {len(shapes)} linear weights {shapes}, head [{arch.vocab}, {arch.hidden}]")
    header = f"{'prec':<5} {'tokens':>6} {'resp':>5} {'peak GF/s':>9} {'fwd GF/s':>8} {'dgrad':>7} {'wgrad':>7} {'head':>7} {'pass s':>7} {'ceiling':>7}"
    print(header)
    for prec in args.precision.split(","):
        dtype = dtypes[prec]
        peak = matmul_peak(dtype, 1)
        for tokens, responses in (map(int, t.split(":")) for t in args.tokens.split(",")):
            per_kind = {"forward": 0.0, "input grad": 0.0, "weight grad": 0.0}
            flops_layers = 0.0
            for out, inp in shapes:
                for kind, s in product_seconds(tokens, out, inp, dtype).items():
                    per_kind[kind] += s * arch.layers
                flops_layers += 2.0 * tokens * out * inp * arch.layers  # per product
            chunk = min(args.chunk, responses)
            head = product_seconds(chunk, arch.vocab, arch.hidden, dtype)
            head_s = sum(head.values()) * responses / chunk
            flops_head = 6.0 * responses * arch.vocab * arch.hidden
            total_s = sum(per_kind.values()) + head_s
            rate = {k: flops_layers / s / 1e9 for k, s in per_kind.items()}
            ceiling = (3 * flops_layers + flops_head) / total_s / peak
            print(f"{prec:<5} {tokens:>6} {responses:>5} {peak / 1e9:>9.1f} {rate['forward']:>8.1f} {rate['input grad']:>7.1f} {rate['weight grad']:>7.1f} "
                  f"{flops_head / head_s / 1e9:>7.1f} {total_s:>7.3f} {ceiling:>7.3f}", flush=True)
    print("ceiling: the pass's matmul FLOPs / (the matmuls' summed seconds x peak): the update's MFU if nothing else took time")


if __name__ == "__main__":
    main()
