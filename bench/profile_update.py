"""Where a worker's update time goes: one micro-batch's forward + backward, op by op.

    .venv/bin/python bench/profile_update.py --model runs/models/smollm2-135m --precision fp32,bf16 --compile 0,1
    .venv/bin/python bench/profile_update.py            # the demo's tiny model, fp32

Runs what each of bench/e2e.py's 2 workers runs in its update, on one thread: FSDP2 on a group of
one rank (its parameter copies and, under --precision bf16, the MixedPrecisionPolicy casts; no peer
to wait for: the e2e table has the collectives as the gap between this and `timing_s/update_actor`),
16 sequences of --prompt + --response tokens, the response log-probs and entropies through the
engine's pass (`response_logprobs`, the chunked head unless --chunk 0), a policy-gradient-shaped
loss, backward; with --compile 1 the decoder layers torch.compile'd (actor.use_torch_compile; the
fused kernels appear by name). Two warm-up passes, then --passes profiled ones (torch.profiler, self
CPU time per op). Each setting (--allocator x --precision x --compile) runs in a fresh process:
allocator `glibc` is the workers' default, `worker` adds MALLOC_MMAP_THRESHOLD_=65536 (every tensor
over 64 KiB its own mmap). Rows per setting: op category, seconds per pass, share, and for matmuls
the achieved GFLOP/s against this machine's measured 1-thread peak of the row's precision
(`flops.matmul_peak`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

ALLOCATORS = {"worker": {"MALLOC_MMAP_THRESHOLD_": "65536"}, "glibc": {}}
# op name prefix -> category (first match wins); everything else is "other"
CATEGORIES = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "mkldnn::", "aten::mkldnn")),
    ("attention", ("aten::_scaled_dot_product", "aten::_softmax", "aten::_softmax_backward", "aten::_flash_attention")),
    ("log-softmax / entropy", ("aten::_log_softmax", "aten::logsumexp", "aten::gather", "aten::scatter", "aten::exp")),
    ("casts", ("aten::_to_copy",)),
    ("copies / layout", ("aten::copy_", "aten::clone", "aten::contiguous", "aten::cat", "aten::index", "aten::split", "aten::chunk")),
    ("FSDP2 (gather / cast / reduce)", ("FSDP::", "c10d::", "fsdp::", "record_param_comms")),
    ("compiled (fused kernels)", ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph", "cpp_fused", "graph_")),
    ("fill / alloc", ("aten::fill_", "aten::zero_", "aten::zeros", "aten::empty", "aten::ones", "aten::full")),
)
TOP_OTHER = 6  # the largest ops of "other", listed under it


def category(op: str) -> str:
    return next((name for name, prefixes in CATEGORIES if op.startswith(prefixes)), "other")


def child(args) -> None:
    """One setting: profile --passes forward+backward passes, print {category: [s per pass, matmul flops per pass]} as JSON."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from hybridflow.config.schema import ModelConfig
    from hybridflow.engine.model import response_logprobs
    from hybridflow.models.hf import load_hf_model
    from hybridflow.parallel.fsdp import apply_fsdp2, make_mesh
    from hybridflow.protocol import Batch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    # The worker's layout on one rank: FSDP2 over a world of 1 (its parameter casts under bf16, no peer to wait for).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=0, world_size=1)
    model = load_hf_model(ModelConfig(path=args.model), "cpu").train()
    if args.precision != "fp32":  # as the engine does: bf16 on CPU runs eager attention (engine/cpu_kernels.py)
        from hybridflow.engine.cpu_kernels import prefer_cpu_bf16_attention
        from hybridflow.parallel.fsdp import MIXED_PRECISION_DTYPES

        prefer_cpu_bf16_attention(model, MIXED_PRECISION_DTYPES[args.precision], "cpu")
    if args.compile == "1":
        import torch._inductor.config as inductor_config

        from hybridflow.engine.compile import compile_decoder_layers

        inductor_config.cpp.enable_kernel_profile = True  # fused kernels appear in the profile by name (cpp_fused_*)
        compile_decoder_layers(model)
    apply_fsdp2(model, make_mesh("cpu", 1), mixed_precision=None if args.precision == "fp32" else args.precision)
    b, p, r = args.seqs, args.prompt, args.response
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (b, p + r))
    mb = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(p + r).expand(b, -1),
                "responses": ids[:, p:]})
    adv = torch.randn(b, 1)
    chunk = None if args.chunk <= 0 else args.chunk

    def one_pass() -> None:
        # the engine's pass: response log-probs and entropies (chunked head unless --chunk 0), a policy-gradient-shaped loss
        logp, ent = response_logprobs(model, mb, chunk=chunk)
        (-(adv * logp).mean() - 0.0 * ent.mean()).backward()  # entropy in the graph, as the actor's loss has it
        model.zero_grad(set_to_none=True)

    one_pass()  # warm-up: first-touch allocations, lazy init, compilation
    one_pass()
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(args.passes):
            one_pass()
    out: dict[str, list[float]] = {}
    others = []
    for e in prof.key_averages():
        cat, seconds = category(e.key), e.self_cpu_time_total / 1e6 / args.passes
        row = out.setdefault(cat, [0.0, 0.0])
        row[0] += seconds
        row[1] += (e.flops or 0) / args.passes if cat == "matmul" else 0.0
        if cat == "other":
            others.append((seconds, e.key))
    print("RESULT " + json.dumps({"categories": out, "top_other": sorted(others, reverse=True)[:TOP_OTHER]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="an HF checkpoint; omitted: the demo's tiny model")
    ap.add_argument("--seqs", type=int, default=16, help="sequences per micro-batch (bench/e2e.py: 32 over 2 workers)")
    ap.add_argument("--prompt", type=int, default=45, help="prompt tokens (bench/e2e.py's SmolLM2 chat prompts: ~45)")
    ap.add_argument("--response", type=int, default=16)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--precision", default="fp32", help="comma-separated fp32 / bf16 (FSDP2 MixedPrecisionPolicy, as fsdp_config.mixed_precision)")
    ap.add_argument("--compile", default="0", help="comma-separated 0 / 1: decoder layers torch.compile'd (actor.use_torch_compile)")
    ap.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the log-prob head (model.fused_kernel_chunk_size); 0 = plain logits")
    ap.add_argument("--allocator", default="glibc", help="comma-separated: " + " / ".join(ALLOCATORS))
    ap.add_argument("--port", type=int, default=29641, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one setting, --model a path
    args = ap.parse_args()
    if args.child:
        return child(args)

    import torch

    from common import print_rows
    from flops import matmul_peak

    path = args.model
    if path is None:
        from hybridflow.models.tiny import make_tiny_model

        path = str(make_tiny_model(os.path.join(tempfile.mkdtemp(prefix="bench_profile_"), "tiny"), hidden_size=128,
                                   intermediate_size=256, num_hidden_layers=2))
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peaks = {prec: matmul_peak(dtypes[prec], 1) for prec in args.precision.split(",")}
    rows = []
    for name in args.allocator.split(","):
        for prec in args.precision.split(","):
            for comp in args.compile.split(","):
                env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | ALLOCATORS[name] | {"OMP_NUM_THREADS": "1",
                                                                                                                   "HF_HUB_OFFLINE": "1"}
                cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", path, "--seqs", str(args.seqs), "--prompt", str(args.prompt),
                       "--response", str(args.response), "--passes", str(args.passes), "--precision", prec, "--chunk", str(args.chunk),
                       "--port", str(args.port + len(rows) % 50)] + (["--compile", "1"] if comp == "1" else ["--compile", "0"])
                res = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if res.returncode:
                    raise RuntimeError(f"{name} {prec} compile={comp} failed:\n{res.stderr[-3000:]}")
                result = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])
                cats = result["categories"]
                total = sum(s for s, _ in cats.values())
                setting = {"allocator": name, "precision": prec, "compile": comp}
                for cat, (s, flops) in sorted(cats.items(), key=lambda kv: -kv[1][0]):
                    rows.append({**setting, "category": cat, "seconds": s, "share": s / total, "gflops": flops / s / 1e9 if flops else float("nan"),
                                 "of_peak": flops / s / peaks[prec] if flops else float("nan")})
                    if cat == "other":
                        rows += [{**setting, "category": f"  {op[:32]}", "seconds": t, "share": t / total, "gflops": float("nan"),
                                  "of_peak": float("nan")} for t, op in result["top_other"]]
                rows.append({**setting, "category": "total", "seconds": total, "share": 1.0, "gflops": float("nan"), "of_peak": float("nan")})
    print_rows(f"one forward + backward of {args.seqs} x ({args.prompt} + {args.response}) tokens on 1 thread, {os.path.basename(path)}, "
               f"self CPU seconds per pass by op category; matmul GFLOP/s against the measured 1-thread peak of the row's precision ("
               + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.items()) + " GFLOP/s)",
               [("allocator", "allocator", "<9"), ("precision", "prec", "<5"), ("compile", "compile", "<7"), ("category", "category", "<34"),
                ("seconds", "s/pass", ">8.3f"), ("share", "share", ">6.2f"), ("gflops", "GFLOP/s", ">8.1f"), ("of_peak", "of peak", ">8.2f")],
               rows, args.json)


if __name__ == "__main__":
    main()
