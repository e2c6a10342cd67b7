"""Routing replay on a tiny MoE: the rollout-vs-trainer log-prob mismatch with and without it, next to a dense model.

One process, no workers: the rollout is the HF backend (`HFRollout`, per-call batched and KV-cached
`generate`, recording each token's experts), the trainer's side is the very forward the actor's
log-prob and update passes run (`engine/model.response_logprobs`, padded layout, chunked head), on a
model with the same weights in the training dtype (fp32). Per case, over the batch's response tokens:

- `logprob_diff_max` / `_mean`: |rollout log-prob - trainer log-prob| under the temperature alone,
  what the trainer reports as `rollout/logprob_diff_max` / `_mean` (trainer/metrics.py);
- `ppo_kl`: the first update's `actor/ppo_kl` when its old log-probs are the rollout's (async rollout's
  bypass mode: mean of old - new log-prob; with recomputed old log-probs it is 0 by construction);
- `routing_differs`: per layer, the share of valid tokens whose top-k expert set the trainer's own
  router picks differently from the rollout's record (with replay the trainer uses the record).

Cases: the generation weights in fp32 (the default), and in bf16 (actor_rollout_ref.rollout's
generation dtype below the training one: the weight sync casts, the usual GPU setup), each for a
dense Qwen2, and a Qwen3-MoE without and with replay. The models are random-initialised (make-model).

    .venv/bin/python bench/routing_replay.py [--prompts 64 --tokens 32 --experts 8 --seed 0]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hybridflow.algorithms import masked_mean  # noqa: E402
from hybridflow.engine.model import response_logprobs  # noqa: E402
from hybridflow.models.moe import routers  # noqa: E402
from hybridflow.models.routing import RouteReplayer, clear, routing_agreement  # noqa: E402
from hybridflow.models.tiny import make_tiny_model  # noqa: E402
from hybridflow.protocol import Batch, SamplingParams  # noqa: E402
from hybridflow.rollout.base import left_padded  # noqa: E402
from hybridflow.rollout.hf_rollout import HFRollout  # noqa: E402


def prompts(tok, n: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    words = ["max", "min", "sum", "sort"]
    texts = []
    for _ in range(n):
        digits = torch.randint(10, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
        texts.append(f"{words[int(torch.randint(4, (1,), generator=g))]} " + " ".join(str(int(d)) for d in digits))
    input_ids, mask = left_padded([tok.encode(t, add_special_tokens=False) for t in texts], tok.pad_token_id)
    return Batch.from_dict(tensors={"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)})


def trainer_topk(model, batch: Batch) -> torch.Tensor:
    """The trainer's own routing over the sequences: [b, T, L, k]."""
    outs = []
    hooks = [r.register_forward_hook(lambda m, i, o: outs.append(o[2])) for r in routers(model)]
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    for h in hooks:
        h.remove()
    b, T = batch["input_ids"].shape
    return torch.stack(outs, 1).view(b, T, len(outs), -1)


def run_case(path, gen_dtype: torch.dtype, replay: bool, args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    gen_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(gen_dtype).eval()
    train_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    moe = bool(routers(train_model))
    rollout = HFRollout(gen_model, tok, "cpu", continuous=False, record_routes=moe)
    start = time.perf_counter()
    out = rollout.generate(prompts(tok, args.prompts, args.seed), SamplingParams(max_new_tokens=args.tokens, temperature=1.0, seed=args.seed))
    gen_s = time.perf_counter() - start
    mask = out["response_mask"].float()
    row = {}
    if moe:
        own = trainer_topk(train_model, out)
        differs = routing_agreement(out["routed_experts"], own, out["attention_mask"])
        row["routing_differs"] = " / ".join(f"{d:.3f}" for d in differs)
    if replay:
        RouteReplayer(train_model)
    view = out if replay else out.select([k for k in out.keys() if k != "routed_experts"])
    with torch.no_grad():
        logp, _ = response_logprobs(train_model, view, chunk=1024)
    clear(train_model)
    diff = (out["rollout_untruncated_log_probs"] - logp).abs() * mask
    row.update(logprob_diff_max=float(diff.max()), logprob_diff_mean=float(masked_mean(diff, mask)),
               ppo_kl=float(masked_mean(out["rollout_untruncated_log_probs"] - logp, mask)), gen_s=gen_s)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        dense = make_tiny_model(os.path.join(tmp, "dense"), hidden_size=args.hidden, intermediate_size=2 * args.hidden)
        moe = make_tiny_model(os.path.join(tmp, "moe"), arch="qwen3_moe", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                              num_experts=args.experts, num_experts_per_tok=args.top_k)
        print(f"{args.prompts} prompts x {args.tokens} sampled tokens (T=1), hidden {args.hidden}, 2 layers; "
              f"MoE: Qwen3-MoE {args.experts} experts top-{args.top_k}; trainer fp32, chunked log-prob head, padded layout")
        head = (f"{'generation dtype':<17} {'model':<22} {'logprob_diff_max':>17} {'logprob_diff_mean':>18} {'ppo_kl (old=rollout)':>21}  "
                f"routing differs (layer 0 / 1)")
        print(head)
        print("-" * len(head))
        for gen_dtype in (torch.float32, torch.bfloat16):
            for name, path, replay in [("dense Qwen2", dense, False), ("MoE, no replay", moe, False), ("MoE, routing replay", moe, True)]:
                r = run_case(path, gen_dtype, replay, args)
                print(f"{str(gen_dtype).replace('torch.', ''):<17} {name:<22} {r['logprob_diff_max']:>17.3g} {r['logprob_diff_mean']:>18.3g} "
                      f"{r['ppo_kl']:>21.3g}  {r.get('routing_differs', '-')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
