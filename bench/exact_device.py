"""The exact rollout mode on an accelerator: are the sampler's log-probs the trainer's, bit for bit?

`actor_rollout_ref.rollout.exact` makes both sides run `models/exact.py::exact_row_logits` on a row
of one fixed shape ([1, prompt + R]), so on a CPU they agree bit for bit (tests/test_exact_rollout.py).
On a GPU that also needs the kernels (cuBLAS GEMMs, SDPA attention) to give the same bits for the
same inputs and shapes from call to call. This bench samples with `HFRollout(exact=True)` and
recomputes every sampled token's log-prob the way the trainer does (the finished response padded
to R, one pass), for fp32 and bf16, on a tiny model and a SmolLM2-135M-shaped one (30 layers,
hidden 576, 9 heads, 3 KV heads; random weights, no download), next to the KV-cached `generate`
sampler the mode replaces; tokens per second of both samplers side by side. A third column runs
the trainer's side as the trainer does at gen_tp 1: a separate module wrapped in FSDP2 (one rank,
NCCL on a GPU) holding fp32 master weights, with mixed precision in the row's dtype (bf16), against
the sampler's generation model loaded in that dtype.

Run:  python bench/exact_device.py --device cuda      (on the GPU machine: scripts/gpu_check.sh)
      .venv/bin/python bench/exact_device.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hybridflow.algorithms import logprobs_from_logits  # noqa: E402
from hybridflow.models.exact import exact_row_logits  # noqa: E402
from hybridflow.models.tiny import make_tiny_model  # noqa: E402
from hybridflow.protocol import Request, SamplingParams  # noqa: E402
from hybridflow.rollout.hf_rollout import HFRollout  # noqa: E402

MODELS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128),
    "smollm2-shaped": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                           arch="llama", tie_word_embeddings=True),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def trainer_log_probs(model, request: Request, tokens: tuple[int, ...], R: int, pad: int, device: str) -> torch.Tensor:
    """The trainer's computation, written out: the finished response padded to R, one pass."""
    response = torch.full((R,), pad, device=device)
    response[: len(tokens)] = torch.tensor(tokens, device=device)
    with torch.no_grad():
        logits = exact_row_logits(model, torch.tensor(request.prompt_ids, device=device), response, request.params.effective_temperature)
    return logprobs_from_logits(logits, response[None])[0, : len(tokens)].cpu()


def fsdp_trainer(path, dtype: str, device: str):
    """The trainer's module as at gen_tp 1: fp32 master weights under FSDP2 (world size 1), mixed
    precision in `dtype` when it is not fp32 (parameters cast for the compute, as the trainer's)."""
    from transformers import AutoModelForCausalLM

    from hybridflow.parallel.fsdp import apply_fsdp2, make_mesh

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    return apply_fsdp2(model, make_mesh(device, 1), mixed_precision=None if dtype == "fp32" else dtype).eval()


def row(name: str, path, dtype: str, device: str, R: int, prompts: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    trainer = fsdp_trainer(path, dtype, device)
    params = SamplingParams(max_new_tokens=R, temperature=0.7, top_k=len(tok), seed=3)  # nothing cut: step-wise == untruncated
    texts = ["What is 2*3?", "Hi", "a longer prompt than the others", "count: 1 2 3", "abc", "the end is", "x", "max 3 8 1"]
    reqs = [Request(tok.encode(texts[i % len(texts)]), params.with_(seed=3 + i)) for i in range(prompts)]
    out = dict(model=name, dtype=dtype, device=device)
    for mode, exact in (("exact", True), ("generate", False)):
        rollout = HFRollout(model, tok, device, exact=exact)
        rollout.generate_requests(reqs[:1])  # warm-up (kernel selection, allocator)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        done = rollout.generate_requests(reqs if exact else [Request(r.prompt_ids, r.params.with_(top_k=-1)) for r in reqs])
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        diffs, stepwise, fsdp = [], True, []
        for r, c in zip(reqs, done):
            mine = torch.tensor(c.untruncated_log_probs if exact else c.untruncated)
            diffs.append(float((mine - trainer_log_probs(model, r, c.token_ids, R, tok.pad_token_id, device)).abs().max()))
            stepwise &= (not exact) or c.log_probs == c.untruncated_log_probs  # the behaviour log-probs are the step-wise ones
            if exact:
                fsdp.append(float((mine - trainer_log_probs(trainer, r, c.token_ids, R, tok.pad_token_id, device)).abs().max()))
        out[f"{mode}_diff"] = max(diffs)
        if exact:
            out["fsdp_diff"] = max(fsdp)
        out[f"{mode}_tok_s"] = sum(len(c.token_ids) for c in done) / seconds
        if exact:
            out["stepwise_equal"] = stepwise
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="the tiny model only, 4 prompts")
    ap.add_argument("--tokens", type=int, default=32, help="sampled tokens per prompt (R)")
    a = ap.parse_args()
    if a.device == "cuda":
        print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", rank=0, world_size=1)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, shape in MODELS.items():
            if a.quick and name != "tiny":
                continue
            path = make_tiny_model(os.path.join(d, name), **shape)
            for dtype in DTYPES:
                rows.append(row(name, path, dtype, a.device, a.tokens, 4 if a.quick else 8))
                print(rows[-1], flush=True)
    head = (f"{'model':<15} {'dtype':<5} {'exact: max |lp - trainer|':>26} {'vs FSDP2 trainer':>16} {'step-wise ==':>12} "
            f"{'generate: max |lp - trainer|':>29} {'exact tok/s':>11} {'generate tok/s':>14}")
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['model']:<15} {r['dtype']:<5} {r['exact_diff']:>26.3g} {r['fsdp_diff']:>16.3g} {str(r['stepwise_equal']):>12} "
              f"{r['generate_diff']:>29.3g} {r['exact_tok_s']:>11.1f} {r['generate_tok_s']:>14.1f}")
    dist.destroy_process_group()
    ok = all(r["exact_diff"] == 0.0 and r["fsdp_diff"] == 0.0 and r["stepwise_equal"] for r in rows)
    print(f"exact mode bit for bit on {a.device} in every row: {'yes' if ok else 'no'}")


if __name__ == "__main__":
    main()
