"""Per-call batching vs continuous batching in the HF backend, on one replica, one run.

Workload: a mix of short and long greedy requests (3 of 4 short) arriving over time (exponential
gaps, seeded), on the tiny Qwen2 (fp32, CPU). Three ways to serve them:

- per call (the HF backend before continuous batching): the replica runs one call at a time; a
  call takes every request that arrived while the previous one ran, at the longest limit among them
  (the agent loop's RequestBatcher shares one SamplingParams), each completion cut to its own limit
  after; a request's latency ends when its call ends;
- continuous, calls one at a time: the same calls through the scheduler (what a replica actor without
  a concurrency group for generate_requests gets: rows leave the batch as they finish, but a
  call still returns with its slowest request and the next call waits for it);
- continuous: each request submitted when it arrives (generate_requests calls running concurrently
  on the replica) joins the running batch at the next step and returns the step it finishes.

Reported: generated tokens per second over the whole run (first arrival to last completion), and
the p50 / p99 latency (arrival to completion) over all requests and over the short ones. The three
modes run in turn `--repeats` times (a shared machine's load falls on all of them alike); each
row is the mode's run of median throughput, with the slowest and fastest throughput beside it.

    .venv/bin/python bench/continuous_batching.py [--requests 64] [--gap-ms 8] [--repeats 3] [--json runs/cb.json]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_rows  # noqa: E402


def workload(tok, n: int, gap_ms: float, short: tuple[int, int], long: tuple[int, int], seed: int = 0):
    """(arrival seconds, prompt ids, max_new_tokens, is short) per request, by arrival."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        is_short = rng.random() < 0.75
        lo, hi = short if is_short else long
        prompt = tok.encode(f"max {' '.join(str(rng.randrange(10)) for _ in range(rng.randrange(1, 8)))}")
        out.append((t, prompt, rng.randrange(lo, hi + 1), is_short))
        t += rng.expovariate(1000.0 / gap_ms)
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def serve_in_calls(backend, reqs, base):
    """One call at a time, each taking every request arrived by then (RequestBatcher's shape)."""
    from hybridflow.protocol import Request

    done: list[float | None] = [None] * len(reqs)
    tokens = [0] * len(reqs)
    start = time.monotonic()
    served = 0
    while served < len(reqs):
        now = time.monotonic() - start
        if reqs[served][0] > now:
            time.sleep(reqs[served][0] - now)
            now = time.monotonic() - start
        batch = [i for i in range(served, len(reqs)) if reqs[i][0] <= now]
        longest = max(reqs[i][2] for i in batch)
        out = backend.generate_requests([Request(reqs[i][1], base.with_(max_new_tokens=longest)) for i in batch])
        end = time.monotonic() - start
        for i, c in zip(batch, out):
            done[i] = end
            tokens[i] = min(len(c.token_ids), reqs[i][2])
        served = batch[-1] + 1
    return done, tokens


def serve_on_arrival(backend, reqs, base):
    """Each request submitted to the scheduler when it arrives; done when its future resolves."""
    from hybridflow.protocol import Request

    done: list[float | None] = [None] * len(reqs)
    tokens = [0] * len(reqs)
    finished = threading.Semaphore(0)
    start = time.monotonic()

    def record(i):
        def cb(f):
            done[i] = time.monotonic() - start
            tokens[i] = len(f.result().token_ids)
            finished.release()
        return cb

    for i, (at, prompt, max_new, _) in enumerate(reqs):
        now = time.monotonic() - start
        if at > now:
            time.sleep(at - now)
        (f,) = backend.scheduler.submit([Request(prompt, base.with_(max_new_tokens=max_new))])
        f.add_done_callback(record(i))
    for _ in reqs:
        if not finished.acquire(timeout=600):
            raise TimeoutError("a request did not finish within 600 s")
    return done, tokens


def row(mode: str, reqs, done, tokens) -> dict:
    lat = [d - r[0] for d, r in zip(done, reqs)]
    short = [x for x, r in zip(lat, reqs) if r[3]]
    span = max(done) - reqs[0][0]
    return {"mode": mode, "requests": len(reqs), "tokens": sum(tokens), "seconds": span, "tokens_per_s": sum(tokens) / span,
            "p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99), "p50_short_s": percentile(short, 0.5),
            "p99_short_s": percentile(short, 0.99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--gap-ms", type=float, default=8.0, help="mean gap between arrivals")
    parser.add_argument("--short", type=int, nargs=2, default=(4, 16), help="short requests' max_new_tokens range")
    parser.add_argument("--long", type=int, nargs=2, default=(96, 128), help="long requests' max_new_tokens range")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.models.tiny import make_tiny_model
    from hybridflow.protocol import Request, SamplingParams
    from hybridflow.rollout.hf_rollout import HFRollout

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(os.path.join(tmp, "tiny"), hidden_size=64, intermediate_size=128)
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    base = SamplingParams(max_new_tokens=1, do_sample=False)
    reqs = workload(tok, args.requests, args.gap_ms, tuple(args.short), tuple(args.long))
    per_call = HFRollout(model, tok, "cpu", continuous=False)
    continuous = HFRollout(model, tok, "cpu", max_num_seqs=args.max_num_seqs)
    for b in (per_call, continuous):  # warm-up
        b.generate_requests([Request(reqs[0][1], base.with_(max_new_tokens=8))] * 4)

    modes = {"per call": lambda: serve_in_calls(per_call, reqs, base),
             "continuous, calls one at a time": lambda: serve_in_calls(continuous, reqs, base),
             "continuous": lambda: serve_on_arrival(continuous, reqs, base)}
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode, serve in modes.items():
            runs[mode].append(row(mode, reqs, *serve()))
    rows = []
    for mode, rs in runs.items():
        rs.sort(key=lambda r: r["tokens_per_s"])
        rows.append({**rs[len(rs) // 2], "slowest": rs[0]["tokens_per_s"], "fastest": rs[-1]["tokens_per_s"]})
    stats = continuous.scheduler.stats
    print(f"{args.requests} requests ({sum(r[3] for r in reqs)} short {args.short}, the rest long {args.long} new tokens), "
          f"mean gap {args.gap_ms} ms, greedy, tiny Qwen2 fp32 on {os.cpu_count()} CPU(s), torch threads {torch.get_num_threads()}; "
          f"{args.repeats} runs per mode; scheduler over all its runs: {stats.steps} steps ({stats.prefill_steps} prefill), largest batch {stats.max_batch}")
    print_rows("HF backend: per-call vs continuous batching (one replica)",
               [("mode", "mode", "<32"), ("tokens", "tokens", ">7d"), ("seconds", "seconds", ">8.2f"), ("tokens_per_s", "tokens/s", ">9.0f"),
                ("slowest", "slowest", ">8.0f"), ("fastest", "fastest", ">8.0f"),
                ("p50_s", "p50 s", ">7.3f"), ("p99_s", "p99 s", ">7.3f"), ("p50_short_s", "p50 short s", ">12.3f"),
                ("p99_short_s", "p99 short s", ">12.3f")], rows, args.json)


if __name__ == "__main__":
    main()
