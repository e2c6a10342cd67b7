"""Peak memory per rank of one training micro-batch of a long multi-turn trajectory: Ulysses sp2
against data parallelism alone, and what the planner (`planning.cost.memory_plan`) predicts.

The trajectory: one 8,192-token row per data rank (a 512-token prompt, then assistant turns and
tool outputs alternating, the tool outputs masked out of the loss), on a tiny fp32 Qwen2 built
offline (hidden 128, 4 layers, 4/2 heads, intermediate 256). Each rank runs the actor's update
micro-batch through `TrainEngine.forward_backward` (FSDP2 over the ranks, chunked head, a PPO-like
token loss), after one warm-up step on a short batch (optimizer state, allocator).
- dp2: 2 ranks, each its own 8,192-token row (no sequence split).
- sp2: 2 ranks, one row split in two 4,096-token slices (`parallel/ulysses.py`).
- dp2xsp2 (--world 4): 4 ranks, two rows, each split over an sp pair.
All modes run the same attention kernel: dp runs Ulysses' attention over a group of one rank (the
all-to-all is then a copy), i.e. per-sequence causal SDPA without a [T, T] mask, and the planner is
told so (`MemoryInputs(attention="ulysses")`, `cost.layer_activation_bytes`); so the table isolates
the split.

Memory is each rank's resident-set high-water mark (VmHWM), reset just before the micro-batch
(`/proc/self/clear_refs`), minus the resident set then: every byte the forward and backward touched
at their peak. The workers' allocator setting (MALLOC_MMAP_THRESHOLD_=65536: every tensor over
64 KiB is its own mapping, returned when freed) keeps the resident set equal to the live tensors.
Each mode runs in fresh processes.

    .venv/bin/python bench/ulysses_memory.py [--tokens 8192] [--world 4] [--json runs/ulysses_memory.json]

Columns (MiB, max over ranks): mode, tokens per rank; the resident set the forward added (the
tensors kept for backward) against the planner's activations term and its error; the forward +
backward peak against the planner's step bytes (activations + the logits term + gradients + FSDP's
unsharded layers) and its error; seconds of the micro-batch's forward + backward (noisy on a
shared machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
PROMPT, CHUNK = 512, 1024


def trajectories(rows: int, tokens: int, vocab: int, seed: int = 0):
    """`rows` multi-turn rows of `tokens` tokens: PROMPT prompt tokens, then the response as
    assistant turns (in the loss) and tool outputs (masked) of 256-1,024 tokens alternating."""
    import torch

    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, tokens), generator=g)
    resp = tokens - PROMPT
    mask = torch.zeros(rows, resp)
    for r in range(rows):
        at, turn = 0, 0
        while at < resp:
            n = int(torch.randint(256, 1025, (1,), generator=g))
            if turn % 2 == 0:
                mask[r, at : at + n] = 1
            at, turn = at + n, turn + 1
    attn = torch.ones(rows, tokens, dtype=torch.long)
    pos = torch.arange(tokens).expand(rows, -1).clone()
    return Batch.from_dict(tensors={"input_ids": ids, "attention_mask": attn, "position_ids": pos, "responses": ids[:, PROMPT:],
                                    "response_mask": mask, "advantages": torch.randn(rows, resp, generator=g)})


def _loss(logp, ent, mb):
    m = mb["response_mask"]
    return (-(mb["advantages"] * logp) - 0.01 * ent).mul(m).sum() / m.sum().clamp(min=1)


def _worker(rank: int, world: int, sp: int, port: int, path: str, tokens: int, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from transformers import AutoModelForCausalLM

    from hybridflow.config.schema import FSDPConfig, OptimConfig
    from hybridflow.engine.train_engine import TrainEngine
    from hybridflow.parallel import ulysses
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.parallel.layout import train_mesh
    from hybridflow.utils.memory import reset_peak, status_bytes

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    layout = ParallelDims.for_world(world, sp=sp)
    engine = TrainEngine(model, train_mesh(layout, "cpu"), "cpu", FSDPConfig(), optim=OptimConfig(lr=1e-4), remove_padding=True, logits_chunk=CHUNK)
    if sp == 1:  # dp alone, through the same attention kernel: Ulysses over a group of one rank (module doc)
        singles = [dist.new_group([r]) for r in range(world)]
        engine.sp_group = singles[rank]
        ulysses.install(engine.module)
    dp_i, dp, _ = layout.dispatch(rank)
    vocab = model.config.vocab_size
    engine.forward_backward(trajectories(1, 1024, vocab, seed=1), _loss, 1)  # warm-up: gradients, optimizer state, allocator
    engine.step()
    batch = trajectories(dp, tokens, vocab).index(slice(dp_i, dp_i + 1))  # this data rank's row
    dist.barrier()
    before = status_bytes("VmRSS")
    if not reset_peak():
        raise RuntimeError("this kernel cannot reset VmHWM (/proc/self/clear_refs): the peak would be the process's")
    t0 = time.perf_counter()
    engine.module.train()  # what forward_backward does for one micro-batch, with a reading between forward and backward
    loss = _loss(*engine._token_logprobs(batch, 1.0, True, False), batch)
    saved = status_bytes("VmRSS")  # the forward's tensors kept for backward
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = status_bytes("VmHWM")
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"rank": rank, "peak_bytes": peak - before, "saved_bytes": saved - before, "rss_before_bytes": before,
                   "seconds": seconds}, f)
    dist.barrier()
    dist.destroy_process_group()


def predicted(path: str, world: int, sp: int, tokens: int) -> dict:
    """The planner's bytes for one rank's micro-batch: what the forward and backward add to a rank
    that already holds its shards and optimizer state."""
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import MemoryInputs, memory_plan, plan_for

    arch, layout = load_arch(path), ParallelDims.for_world(world, sp=sp)
    # every mode runs Ulysses' attention kernel (dp over a group of one rank: module doc), so the planner is told so
    m = MemoryInputs(param_bytes=4, compute_bytes=4, micro_batch=1, seq_len=tokens, response_len=tokens - PROMPT, logits_chunk=CHUNK,
                     attention="ulysses")
    parts = memory_plan(plan_for(arch, layout, 1, 4), arch, layout, m, 0)
    return {k: parts[k] for k in ("activations", "grads", "fsdp_unshard")} | {"step": parts["activations"] + parts["grads"] + parts["fsdp_unshard"]}


def run(mode: str, world: int, sp: int, path: str, tokens: int, tmp: str) -> dict:
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from conftest import free_port

    out = os.path.join(tmp, mode)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # the workers' setting (module doc); inherited by the spawned ranks
    mp.spawn(_worker, args=(world, sp, free_port(), path, tokens, out), nprocs=world)
    ranks = [json.load(open(f"{out}.{r}")) for r in range(world)]
    pred = predicted(path, world, sp, tokens)
    peak, saved = max(r["peak_bytes"] for r in ranks), max(r["saved_bytes"] for r in ranks)
    return {"mode": mode, "world": world, "sp": sp, "tokens_per_rank": tokens // sp, "measured_bytes": peak, "saved_bytes": saved,
            "measured_bytes_per_rank": [r["peak_bytes"] for r in ranks], "predicted_bytes": pred["step"], "predicted": pred,
            "error": pred["step"] / peak - 1, "saved_error": pred["activations"] / saved - 1, "seconds": max(r["seconds"] for r in ranks)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of each trajectory (one row per data rank)")
    ap.add_argument("--world", type=int, default=2, choices=(2, 4), help="4 adds dp2xsp2 against dp4")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from hybridflow.models.tiny import make_tiny_model

    tmp = tempfile.mkdtemp(prefix="ulysses_memory_")
    path = str(make_tiny_model(os.path.join(tmp, "m"), max_position_embeddings=max(args.tokens, 256), **MODEL))
    modes = [("dp2", 2, 1), ("sp2", 2, 2)] + ([("dp4", 4, 1), ("dp2xsp2", 4, 2)] if args.world == 4 else [])
    rows = [run(mode, world, sp, path, args.tokens, tmp) for mode, world, sp in modes]
    mib = 1024**2
    print(f"\nPeak memory of one {args.tokens}-token micro-batch per rank (forward + backward; MiB over the resident set before it)")
    print(f"{'mode':10s} {'tokens/rank':>11s} {'after fwd':>9s} {'pred acts':>9s} {'error':>7s} {'peak':>9s} {'predicted':>9s} {'error':>7s} "
          f"{'seconds':>8s}")
    for r in rows:
        print(f"{r['mode']:10s} {r['tokens_per_rank']:11d} {r['saved_bytes'] / mib:9.1f} {r['predicted']['activations'] / mib:9.1f} "
              f"{r['saved_error']:+7.1%} {r['measured_bytes'] / mib:9.1f} {r['predicted_bytes'] / mib:9.1f} {r['error']:+7.1%} {r['seconds']:8.2f}")
    print(f"load average: {os.getloadavg()}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "model": MODEL, "rows": rows, "loadavg": os.getloadavg()}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
