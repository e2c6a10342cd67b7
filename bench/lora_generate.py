"""LoRA generation in the HF backend: adapters unmerged (what the backend runs: each targeted layer
computes W x + s B A x) vs merged into the weights (W' = W + s B A: a plain model), side by side.

Both generate the same greedy tokens from the same prompts in one process (fp32, CPU); the table
gives generated tokens per second and the merged / unmerged speed ratio, and checks that both
produced the same tokens.

Run:  .venv/bin/python bench/lora_generate.py [--model runs/models/smollm2-135m] [--rank 16] --json PATH
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_rows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="an HF checkpoint (default: the demo's tiny model, built here)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.config.schema import ModelConfig
    from hybridflow.models.lora import apply_lora, merged_state_dict

    torch.manual_seed(0)
    path = args.model or make_tiny(tempfile.mkdtemp(prefix="bench_lora_"))
    unmerged = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), ModelConfig(path=path, lora_rank=args.rank,
                                                                                                      lora_alpha=2 * args.rank)).eval()
    with torch.no_grad():  # trained-looking adapters (B is 0 at init)
        for name, p in unmerged.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.02)
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    merged.load_state_dict(merged_state_dict(unmerged.state_dict(), unmerged))
    vocab = merged.config.vocab_size
    prompts = torch.randint(3, min(vocab, 250), (args.prompts, 24), generator=torch.Generator().manual_seed(0))
    rows, tokens = [], {}
    for name, model in (("unmerged", unmerged), ("merged", merged)):
        times = []
        for _ in range(1 + args.repeats):
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(prompts, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                                     pad_token_id=0, attention_mask=torch.ones_like(prompts))
            times.append(time.perf_counter() - start)
        tokens[name] = out[:, prompts.shape[1]:]
        seconds = statistics.median(times[1:])  # the first call warms up
        rows.append({"mode": name, "model": os.path.basename(os.path.normpath(path)), "rank": args.rank, "seconds": seconds,
                     "tokens_per_second": args.prompts * args.new_tokens / seconds})
    for r in rows:
        r["vs_unmerged"] = rows[0]["seconds"] / r["seconds"]
    same = torch.equal(tokens["unmerged"], tokens["merged"])
    print_rows(f"HF greedy generate, {args.prompts} prompts x {args.new_tokens} new tokens, fp32; same tokens: {'yes' if same else 'no'}",
               [("mode", "mode", "<9"), ("model", "model", "<14"), ("rank", "rank", ">4"), ("seconds", "seconds", ">8.3f"),
                ("tokens_per_second", "tok/s", ">8.1f"), ("vs_unmerged", "speed vs unmerged", ">17.2f")], rows, args.json)


def make_tiny(out: str) -> str:
    from hybridflow.models.tiny import make_tiny_model

    return str(make_tiny_model(os.path.join(out, "tiny"), hidden_size=128, intermediate_size=256, num_hidden_layers=2))


if __name__ == "__main__":
    main()
