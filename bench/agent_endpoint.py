"""The agent endpoint under load: N concurrent clients for S seconds against the tiny model.

Rows, side by side (the same backend, the same batcher, the same request mix):
- ``endpoint``: each client is the official `openai.AsyncOpenAI` on its own session (its own
  key), sending chat completions in a loop over HTTP to the run's endpoint (agent/openai_server.py);
- ``direct``: the same loop calling the batcher in-process (no HTTP, no JSON, no chat template):
  the floor the endpoint's own overhead is measured against.
Columns: requests done, errors, requests/s, p50 / p99 latency (ms), and what the server answered
with a non-200 status. Every client sends 16-token requests (`max_tokens=16`, temperature 1), so
the model's work per request is the same in both rows; the HF backend batches whatever is pending.

Run:  .venv/bin/python bench/agent_endpoint.py [--clients 32] [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hybridflow.agent.loop import RequestBatcher  # noqa: E402
from hybridflow.agent.openai_server import EndpointSettings, LiveEndpoint  # noqa: E402
from hybridflow.models.tiny import make_tiny_model  # noqa: E402
from hybridflow.protocol import SamplingParams  # noqa: E402
from hybridflow.rollout.hf_rollout import HFRollout  # noqa: E402

MAX_TOKENS = 16


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def run(mode: str, backend, tok, clients: int, seconds: float) -> dict:
    import openai

    batcher = RequestBatcher(backend.generate_requests, SamplingParams(max_new_tokens=MAX_TOKENS, seed=0))
    ep = LiveEndpoint(EndpointSettings("tiny", 256, 256, sampling="request"), tok, batcher)
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.monotonic() + seconds

    async def http_client(i: int) -> None:
        s = ep.open_session()
        async with openai.AsyncOpenAI(base_url=ep.url(s), api_key=s.key, max_retries=0, timeout=60) as client:
            while time.monotonic() < deadline:
                messages = [{"role": "user", "content": f"max {i % 10} {(i * 7) % 10} {len(latencies) % 10}"}]  # a new conversation each time
                t = time.perf_counter()
                try:
                    await client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=1.0)
                    latencies.append(time.perf_counter() - t)
                except Exception as e:  # noqa: BLE001 - counted, the bench goes on
                    errors.append(f"{type(e).__name__}: {e}"[:200])

    async def direct_client(i: int) -> None:
        while time.monotonic() < deadline:
            ids = tok.encode(f"max {i % 10} {(i * 7) % 10} {len(latencies) % 10}")
            t = time.perf_counter()
            try:
                await batcher.generate(ids, MAX_TOKENS, None, SamplingParams(max_new_tokens=MAX_TOKENS, seed=0), False)
                latencies.append(time.perf_counter() - t)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}"[:200])

    start = time.monotonic()
    if mode == "endpoint":
        async with ep.serve():
            await asyncio.gather(*(http_client(i) for i in range(clients)))
    else:
        await asyncio.gather(*(direct_client(i) for i in range(clients)))
    wall = time.monotonic() - start
    return {"mode": mode, "done": len(latencies), "errors": len(errors), "rps": len(latencies) / wall,
            "p50_ms": 1000 * statistics.median(latencies) if latencies else float("nan"), "p99_ms": 1000 * percentile(latencies, 0.99),
            "non_200": dict(ep.counters.errors), "calls": batcher.calls, "first_error": errors[0] if errors else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(os.path.join(d, "tiny"), hidden_size=64, intermediate_size=128)
        tok = AutoTokenizer.from_pretrained(path)
        backend = HFRollout(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), tok, "cpu")
        rows = [asyncio.run(run(mode, backend, tok, args.clients, args.seconds)) for mode in ("direct", "endpoint")]
    print(f"\n{args.clients} concurrent clients x {args.seconds:.0f} s, {MAX_TOKENS}-token chat completions, tiny model (HF backend), "
          f"{os.cpu_count()} cores")
    print(f"{'row':<10} {'requests':>9} {'errors':>7} {'req/s':>8} {'p50 ms':>9} {'p99 ms':>9} {'backend calls':>14}  non-200")
    for r in rows:
        print(f"{r['mode']:<10} {r['done']:>9} {r['errors']:>7} {r['rps']:>8.1f} {r['p50_ms']:>9.1f} {r['p99_ms']:>9.1f} {r['calls']:>14}  "
              f"{r['non_200'] or '-'}")
        if r["first_error"]:
            print(f"  first error: {r['first_error']}")


if __name__ == "__main__":
    main()
