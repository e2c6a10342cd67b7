"""Peak memory of one log-prob micro-batch: the plain logits pass against the chunked one
(model.use_fused_kernels), and what the planner (`hybridflow plan`, the pre-flight check) predicts.

The model is SmolLM2-135M-shaped (hidden 576, 30 layers, 9/3 heads, 49,152-token vocabulary, tied
embeddings: the planner's `smollm2-135m` preset) with random fp32 weights, built offline from that
shape. The micro-batch is what the actor's old-log-prob pass runs (`TrainEngine.log_probs` ->
`response_logprobs` with entropy, no gradient): 16 sequences of a 16-token prompt and a 1,024-token
response, so the logits would be 16 x 1,024 x 49,152 fp32 values (3.0 GiB each).

Each case runs in a fresh subprocess. Memory is the kernel's resident-set high-water mark (VmHWM
in /proc/self/status), reset just before the pass (`echo 5 > /proc/self/clear_refs`): the pass's
peak is VmHWM minus the resident set before it (model, inputs, torch's own), i.e. every byte the
pass touched at its peak, whoever allocated it. (tracemalloc does not see torch's allocations;
this counts them all, and nothing else runs in the process.)

    .venv/bin/python bench/logprob_memory.py [--json runs/logprob_memory.json]

Columns: case, the pass's peak (GiB over the resident set before it), the whole process's peak,
the planner's prediction of the pass's peak (`planning.cost.logprob_pass_bytes`), its error, and
the pass's seconds (the whole model's forward: noisy on a shared machine).

A second table times the head alone (the backbone is the same code in both passes): hidden states
[--speed-tokens, 576] through the [49,152, 576] fp32 head, log-probs and entropy, without gradient
and with the backward of log p + 0.01 x entropy; the plain and the chunked pass alternate, best of
--repeats each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 1024**3
SEQS, PROMPT, RESPONSE, CHUNK = 16, 16, 1024, 1024


def run_case(chunk: int | None, seqs: int, prompt: int, response: int) -> dict:
    """In this (fresh) process: build the model and the batch, then one no-grad log-prob pass with
    entropy; the pass's peak resident bytes over the resident set before it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridflow.engine.model import response_logprobs
    from hybridflow.planning.arch import PRESETS
    from hybridflow.protocol import Batch
    from hybridflow.utils.memory import reset_peak, status_bytes

    shape = {k: v for k, v in PRESETS["smollm2-135m"].items() if k != "model_type"}
    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0)
    model = LlamaForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(0)
    length = prompt + response
    mask = torch.ones(seqs, length, dtype=torch.long)
    mask[: seqs // 2, : prompt // 2] = 0  # half the prompts shorter (left padding), as rollout batches are
    ids = torch.randint(1, cfg.vocab_size, (seqs, length), generator=g) * mask
    mb = Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
                                  "responses": ids[:, prompt:]})
    with torch.no_grad():  # warm-up on 1 sequence: first-call allocations (kernels, caches) are not the pass's
        response_logprobs(model, mb.index(slice(0, 1)), 1.0, chunk=chunk, with_entropy=True)
    before = status_bytes("VmRSS")
    exact = reset_peak()
    t0 = time.perf_counter()
    with torch.no_grad():
        logp, ent = response_logprobs(model, mb, 1.0, chunk=chunk, with_entropy=True)
    seconds = time.perf_counter() - t0
    peak = status_bytes("VmHWM") if exact else None
    import resource

    return {"chunk": chunk, "pass_bytes": peak - before if exact else None, "process_peak_bytes": peak or 0,
            "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_before_bytes": before,
            "seconds": seconds, "logp_sum": float(logp.double().sum()), "ent_sum": float(ent.double().sum()), "peak_reset": exact}


def predicted(chunk: int | None, seqs: int, prompt: int, response: int) -> int:
    from hybridflow.planning.arch import Arch, PRESETS
    from hybridflow.planning.cost import MemoryInputs, logprob_pass_bytes

    arch = Arch.from_config(PRESETS["smollm2-135m"], "smollm2-135m")
    m = MemoryInputs(compute_bytes=4, micro_batch=seqs, seq_len=prompt + response, response_len=response, logits_chunk=chunk)
    return logprob_pass_bytes(arch, m, entropy=True)


def head_speed(tokens: int, chunk: int, repeats: int) -> list[dict]:
    """Best-of-`repeats` seconds of the head alone, plain vs chunked, forward and forward+backward."""
    import torch
    import torch.nn.functional as F

    from hybridflow.algorithms import entropy_from_logits, logprobs_from_logits
    from hybridflow.engine.fused_logprobs import chunked_logprobs
    from hybridflow.planning.arch import PRESETS

    shape = PRESETS["smollm2-135m"]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, shape["hidden_size"], generator=g)
    weight = torch.randn(shape["vocab_size"], shape["hidden_size"], generator=g) * 0.04
    targets = torch.randint(0, shape["vocab_size"], (tokens,), generator=g)

    def plain(h, w):
        z = F.linear(h, w).float()
        return logprobs_from_logits(z, targets), entropy_from_logits(z)

    def chunked(h, w):
        return chunked_logprobs(h, w, targets, 1.0, chunk)

    best: dict[tuple[str, str], float] = {}
    for _ in range(repeats):
        for name, fn in (("plain", plain), ("chunked", chunked)):
            with torch.no_grad():
                t0 = time.perf_counter()
                fn(hidden, weight)
                best[name, "forward"] = min(best.get((name, "forward"), 1e9), time.perf_counter() - t0)
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            t0 = time.perf_counter()
            lp, ent = fn(h, w)
            (lp.sum() + 0.01 * ent.sum()).backward()
            best[name, "train"] = min(best.get((name, "train"), 1e9), time.perf_counter() - t0)
    return [{"pass": p, "plain_s": best["plain", p], "chunked_s": best["chunked", p], "ratio": best["chunked", p] / best["plain", p]}
            for p in ("forward", "train")]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--seqs", type=int, default=SEQS)
    ap.add_argument("--prompt", type=int, default=PROMPT)
    ap.add_argument("--response", type=int, default=RESPONSE)
    ap.add_argument("--chunk", type=int, default=CHUNK, help="model.fused_kernel_chunk_size of the chunked case")
    ap.add_argument("--speed-tokens", type=int, default=2048, help="tokens of the head-only timing (0: skip it)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: run one case in this process, print its JSON
    args = ap.parse_args(argv)
    if args.case is not None:
        print("CASE " + json.dumps(run_case(None if args.case == "plain" else int(args.case), args.seqs, args.prompt, args.response)))
        return []
    from bench.common import print_rows

    rows = []
    for name, chunk in (("plain (before)", None), (f"chunked {args.chunk} (after)", args.chunk)):
        cmd = [sys.executable, os.path.abspath(__file__), "--case", "plain" if chunk is None else str(chunk), "--seqs", str(args.seqs),
               "--prompt", str(args.prompt), "--response", str(args.response)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        got = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("CASE "))[5:])
        pred = predicted(chunk, args.seqs, args.prompt, args.response)
        measured = got["pass_bytes"] if got["pass_bytes"] is not None else got["maxrss_bytes"] - got["rss_before_bytes"]
        rows.append({"case": name, **got, "measured_gib": measured / GIB, "process_peak_gib": max(got["process_peak_bytes"], got["maxrss_bytes"]) / GIB,
                     "predicted_gib": pred / GIB, "error_pct": 100 * (pred - measured) / measured})
    print(f"SmolLM2-135M-shaped fp32, one log-prob micro-batch with entropy, no grad: {args.seqs} sequences x "
          f"({args.prompt} prompt + {args.response} response) tokens, vocabulary 49,152; "
          f"log-prob sums plain {rows[0]['logp_sum']:.3f} / chunked {rows[1]['logp_sum']:.3f}, entropy sums "
          f"{rows[0]['ent_sum']:.3f} / {rows[1]['ent_sum']:.3f}")
    print_rows("Peak memory of the pass (GiB over the resident set before it; VmHWM reset before the pass)",
               [("case", "case", "<22"), ("measured_gib", "measured GiB", ">12.3f"), ("predicted_gib", "predicted GiB", ">13.3f"),
                ("error_pct", "error %", ">8.1f"), ("process_peak_gib", "process peak GiB", ">16.3f"), ("seconds", "seconds", ">8.1f")],
               rows, args.json)
    if args.speed_tokens:
        import torch

        speed = head_speed(args.speed_tokens, args.chunk, args.repeats)
        print_rows(f"The head alone: {args.speed_tokens} tokens x [49,152, 576] fp32, log-probs + entropy, best of {args.repeats} "
                   f"({torch.get_num_threads()} threads)",
                   [("pass", "pass", "<8"), ("plain_s", "plain s", ">8.3f"), ("chunked_s", "chunked s", ">10.3f"), ("ratio", "chunked/plain", ">14.2f")],
                   speed)
    return rows


if __name__ == "__main__":
    main()
