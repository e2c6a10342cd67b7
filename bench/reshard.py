"""Benchmark the 3D-HybridEngine switch: FSDP2 training shards -> tensor-parallel generation weights.

Two passes. The timing pass runs first, in processes with the trainer's worker environment
(`trainer.worker_env`'s default, `config.schema.DEFAULT_WORKER_ENV`; glibc malloc untouched): per
FSDP layout (N = 2 and 4, every valid gen_tp) it times the switch as the trainer runs it
(`HybridEngine.reshard`, layer granularity, generation buffers kept), the same engine on its
all-gather path (`gather path`: what NCCL runs, and gloo's path before the point-to-point one), the
`floor` below, and two floors worked out from the modules alone (`independent_floors`: per layer
one all_gather_into_tensor per group, and the same bytes as one send / recv per peer), one of each
per round with the order rotated every round, and prints the best round (median in brackets), the
load average, and optimized / floor. Every switch moves the planner's minimum, and the last one,
onto poisoned buffers, is checked bit-exact. The memory pass (every other table) sets
MALLOC_MMAP_THRESHOLD_=65536 so RSS is exact; that makes each large temporary fresh zeroed pages,
gloo's included (about 5x slower collectives here), so its seconds are not the trainer's.

For every world size N (gloo processes on this machine) and every valid generation TP size, it
reshards a >= 50M-parameter fp32 Qwen2 model with the optimized path (one all-gather per micro-DP
group) and with the naive baseline (gather every full parameter, then slice), and reports per rank:
bytes received (measured) against the planner's theoretical minimum and the naive volume, the
median wall time, and the peak extra resident memory against the engine's theory. Every reshard is
checked bit-exact (`engine.max_abs_diff() == 0.0`).

`lora-first` / `lora` (gen TP 1, `--lora-rank`): the same model with LoRA adapters on every
projection; the first switch moves the frozen base once, every later one the adapters alone.
`bf16`: the fp32 shards to bf16 generation weights (mixed precision), half the bytes of `optimized`.
A second table: the switch + the generation's first forward (prefill), one after the other and
streamed (`HybridEngine.stream`: each layer completed by a forward pre-hook just before it runs),
and the fraction of the switch's time the overlap hid.
`frozen` is `optimized` with the embeddings and lm_head frozen (`actor.freeze_modules`): after the
first switch they are skipped, 0 bytes. `optimized` keeps the generation buffers between switches (`keep_generation_buffers`, what the
trainer picks when memory allows); `released` is the same path freeing them after every rollout
(so every switch re-allocates and page-faults them), as with `keep_generation_buffers: false`.
Next to them: a `floor` row per layout -- the collectives alone, nothing else: per layer one flat
all-gather of the layer's moving bytes into a pre-allocated buffer inside the micro-DP group for the
TP-sharded weights and one over all ranks for the replicated ones (no copy in or out, no Python
between them; timed before and after the modes, the median of both) -- and the
`hybridflow plan` prediction from config.json alone: its bytes (must equal the measured ones) and
its seconds with the bandwidth, latency and copy speed measured in the same processes
(`planning/calibrate.measure`).
A third table, `resharding_buffer_percent` (`--buffer-percents`, default unset,0.1,0.3), on the
smallest layout that stages whole layers (N = 2, gen_tp 1: every rank gathers the whole model):
per setting a fresh engine, its layers in flight and staging buffer against `hybridflow plan`'s,
the peak extra memory of its first switch (the staging pages are touched then; the generation
buffers are kept, so they add nothing) and the median seconds of the later switches, bit-exact.

Run:  .venv/bin/python bench/reshard.py --json runs/bench_reshard.json
      .venv/bin/python bench/reshard.py --timing-only      (the timing pass alone, N = 2 and 4: a few minutes)
      .venv/bin/python bench/reshard.py --buffer-only      (the third table alone, N = 2: well under a minute)
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import statistics
import sys
import tempfile
import time

import torch
from common import write_rows

MB = 1e6
MODEL = dict(hidden_size=512, num_hidden_layers=17, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1408)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gen_model(path: str, world: int, tp: int, dtype: torch.dtype = torch.float32):
    """The generation model the switch writes into: loaded from `path` in `dtype`, TP over `tp` ranks."""
    from transformers import AutoModelForCausalLM

    from hybridflow.parallel.tensor_parallel import apply_tensor_parallel, gen_mesh

    rollout = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().requires_grad_(False)
    if tp > 1:
        apply_tensor_parallel(rollout, gen_mesh("cpu", world, tp)["tp"])
    return rollout


def worker(rank: int, world: int, port: int, path: str, repeats: int, out_file: str, lora_rank: int = 0,
           buffer_percents: tuple = (), buffer_only: bool = False) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from hybridflow.config.schema import HybridEngineConfig
    from hybridflow.hybrid_engine.executor import HybridEngine
    from hybridflow.parallel.fsdp import apply_fsdp2, make_mesh
    from hybridflow.parallel.tensor_parallel import fsdp_shard_placement_fn, gen_shard_dims

    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.calibrate import measure
    from hybridflow.planning.cost import Cluster, plan_for, predict_switch

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per rank and model otherwise
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if not buffer_only:  # the time model's inputs, for the main table's predictions
        cal = measure()
        cluster = Cluster(nodes=1, gpus_per_node=world, intra_node_bw=cal["bandwidth"], inter_node_bw=cal["bandwidth"],
                          latency_s=cal["latency_s"], copy_bw=cal["copy_bw"])
    actor = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dims = gen_shard_dims(actor)
    apply_fsdp2(actor, make_mesh("cpu", world), shard_placement_fn=fsdp_shard_placement_fn(actor, world))
    with torch.no_grad():  # make the trained weights differ from the checkpoint the rollout loads
        gen = torch.Generator().manual_seed(rank)
        for p in actor.parameters():
            p.to_local().add_(torch.randn(p.to_local().shape, generator=gen) * 0.01)
    cfg = actor.config
    adam = torch.optim.AdamW(actor.parameters(), lr=1e-6)  # the delta rows' real updates
    results = buffer_rows(path, actor, dims, world, rank, repeats, buffer_percents) if buffer_percents else []
    for tp in (1, 2, 4):
        if buffer_only or world % tp or cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp:
            continue
        rollout = gen_model(path, world, tp)
        engine = HybridEngine(actor, rollout, dims, tp, HybridEngineConfig(granularity="layer", keep_generation_buffers=True), "cpu")
        planned = plan_for(load_arch(path), ParallelDims(dp=world), tp, 4)  # from config.json alone
        predicted = predict_switch(planned, cluster)
        floor_times, floor_bytes = floor_seconds(engine, repeats)
        floor_at = len(results)  # its seconds are filled in after the modes (timed again then)
        results.append(dict(world_size=world, train_layout=f"dp{world}", gen_tp=tp, mode="floor", rank=rank, seconds=0.0, bytes_received=floor_bytes,
                            peak_extra_bytes=0, theory_extra_bytes=0, min_bytes=engine.plan.min_bytes(rank), naive_bytes=engine.plan.naive_bytes(rank),
                            planner_bytes=planned.min_bytes(rank), predicted_seconds=predicted["optimized"].predicted_seconds))
        for mode in ("optimized", "released", "naive", "frozen"):
            skip = frozenset()
            if mode == "frozen":  # embeddings and lm_head frozen (actor.freeze_modules): moved once, then skipped
                for n, p in actor.named_parameters():
                    p.requires_grad_(not ("embed_tokens" in n or "lm_head" in n))
                engine.release()
                engine = HybridEngine(actor, rollout, dims, tp, HybridEngineConfig(granularity="layer", keep_generation_buffers=True), "cpu")
                skip = engine.frozen
            engine.cfg.keep_generation_buffers = mode != "released"
            results.append(dict(
                world_size=world, train_layout=f"dp{world}", gen_tp=tp, mode=mode, rank=rank,
                **timed_switches(engine, mode != "naive", repeats, f"N={world} gen_tp={tp} {mode}"),
                min_bytes=engine.plan.min_bytes(rank, skip), naive_bytes=engine.plan.naive_bytes(rank),
                planner_bytes=planned.naive_bytes(rank) if mode == "naive" else planned.min_bytes(rank, skip),
                predicted_seconds=predicted["naive" if mode == "naive" else "optimized"].predicted_seconds,
            ))
        engine.release()
        results[floor_at]["seconds"] = statistics.median(floor_times + floor_seconds(engine, repeats)[0])
        actor.requires_grad_(True)
        del engine, rollout
        results.append(bf16_row(path, actor, dims, world, tp, rank, repeats, cluster))
        results.append(overlap_row(path, actor, dims, world, tp, rank, repeats))
        results.append(delta_row(path, actor, dims, world, tp, rank, adam))
    if lora_rank and not buffer_only:
        results += lora_rows(path, world, rank, repeats, cluster, lora_rank)
    write_gathered(results, world, rank, out_file)
    dist.destroy_process_group()


def trainer_env() -> dict[str, str]:
    """The environment the trainer's Ray workers run under (`trainer.worker_env`'s default,
    `config.schema.DEFAULT_WORKER_ENV`, which the worker group hands every actor), on top of this
    process's: glibc's malloc left to its defaults (no MALLOC_* setting)."""
    from hybridflow.config.schema import DEFAULT_WORKER_ENV

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return {**env, **DEFAULT_WORKER_ENV}


def layer_of(name: str) -> str:
    """`model.layers.3.mlp.up_proj.weight` -> `layers.3`; others by their module (`model.norm`)."""
    parts = name.split(".")
    return ".".join(parts[parts.index("layers") : parts.index("layers") + 2]) if "layers" in parts else ".".join(parts[:-1])


def independent_floors(actor, rollout, world: int, tp: int, rank: int, micro_group) -> tuple[dict, int]:
    """The collectives alone, worked out from the modules (not from the engine's plan or units):
    per layer, every parameter the generation model shards over TP (a DTensor with a Shard
    placement) needs the training shards of its k = N / gen_tp consecutive ranks, every other one
    the shards of all N ranks; the layer's shards are one flat buffer per group. Returns
    ({"allgather": fn, "p2p": fn}, bytes received per rank): `allgather` = one all_gather_into_tensor
    per layer and group into a pre-allocated buffer, `p2p` = the same bytes as one send to and one
    receive from every other rank of the group per layer (what the engine posts on gloo, before it
    splits them per parameter)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    k = world // tp
    gen = dict(rollout.named_parameters())
    per_layer: dict[str, list[int]] = {}  # layer -> [TP-sharded numel per rank, replicated numel per rank]
    for name, p in actor.named_parameters():
        g = gen[name]
        sharded = isinstance(g, DTensor) and any(pl.is_shard() for pl in g.placements)
        if (sharded and k == 1) or world == 1:
            continue  # already where generation needs it
        per_layer.setdefault(layer_of(name), [0, 0])[0 if sharded else 1] += p.to_local().numel()
    counts = torch.tensor(list(per_layer.values())).reshape(-1, 2)  # [layers, 2]
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)  # equal pieces: the largest rank's when a dim does not divide
    per_layer = dict(zip(per_layer, counts.tolist()))
    groups = []  # (own [c], gathered [size * c], group ranks, process group), layer order
    for sharded, replicated in per_layer.values():
        if sharded:
            groups.append((torch.randn(sharded), torch.empty(k * sharded), list(range(rank // k * k, rank // k * k + k)), micro_group))
        if replicated:
            groups.append((torch.randn(replicated), torch.empty(world * replicated), list(range(world)), None))
    received = sum(out.numel() - own.numel() for own, out, _, _ in groups) * 4

    def allgather() -> None:
        for own, out, _, group in groups:
            dist.all_gather_into_tensor(out, own, group=group)

    def p2p() -> None:
        works = []
        for own, out, ranks, group in groups:
            pieces = out.view(len(ranks), -1)
            for j, peer in enumerate(ranks):
                if peer != rank:
                    works += [dist.isend(own, peer, group=group), dist.irecv(pieces[j], peer, group=group)]
        for w in works:
            w.wait()

    return {"allgather": allgather, "p2p": p2p}, received


def timing_worker(rank: int, world: int, port: int, path: str, repeats: int, out_file: str) -> None:
    """The timing pass, under the trainer's worker environment (`trainer_env`): per generation TP,
    the optimized switch (`HybridEngine.reshard`, layer granularity, generation buffers kept: what
    the trainer runs), the bench's `floor` (`floor_seconds`: the plan's per-layer gathers), and the
    independent floors (`independent_floors`), one of each per round, `repeats` rounds after a
    warm-up; the best round of each (the least disturbed by other processes on the machine) and
    the median. The weights are checked bit-exact after the last switch."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from hybridflow.config.schema import HybridEngineConfig
    from hybridflow.hybrid_engine.executor import HybridEngine
    from hybridflow.parallel.fsdp import apply_fsdp2, make_mesh
    from hybridflow.parallel.tensor_parallel import fsdp_shard_placement_fn, gen_shard_dims

    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ, "the timing pass runs under the trainer's environment"
    hf_logging.disable_progress_bar()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    actor = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dims = gen_shard_dims(actor)
    apply_fsdp2(actor, make_mesh("cpu", world), shard_placement_fn=fsdp_shard_placement_fn(actor, world))
    with torch.no_grad():  # trained weights that differ from the checkpoint the rollout loads
        gen = torch.Generator().manual_seed(rank)
        for p in actor.parameters():
            p.to_local().add_(torch.randn(p.to_local().shape, generator=gen) * 0.01)
    cfg, rows = actor.config, []
    for tp in (1, 2, 4):
        if world % tp or cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp:
            continue
        rollout = gen_model(path, world, tp)
        engine = HybridEngine(actor, rollout, dims, tp, HybridEngineConfig(granularity="layer", keep_generation_buffers=True), "cpu")
        floors, indep_bytes = independent_floors(actor, rollout, world, tp, rank, engine.micro_group)
        runs: dict[str, list[float]] = {name: [] for name in ("optimized", "gather_path", "floor", "allgather", "p2p")}
        stats = {}

        def gather_path(engine: HybridEngine = engine) -> dict:  # the all-gather path (what NCCL runs; gloo's before point-to-point)
            engine.p2p = False
            try:
                return engine.reshard()
            finally:
                engine.p2p = True

        measure = {"optimized": engine.reshard, "gather_path": gather_path, "floor": floor_gathers(engine)[0], **floors}
        order = list(measure)
        for i in range(1 + repeats):
            times = {}
            for name in order[i % len(order) :] + order[: i % len(order)]:  # each round starts with the next one
                engine.release()  # the trainer's release after rollout (buffers kept: nothing freed)
                dist.barrier()
                t = time.perf_counter()
                out = measure[name]()
                times[name] = time.perf_counter() - t
                stats = out if name in ("optimized", "gather_path") else stats
                if name in ("optimized", "gather_path") and out["bytes_received"] != engine.plan.min_bytes(rank):
                    raise RuntimeError(f"N={world} gen_tp={tp} {name}: {out['bytes_received']} bytes, the plan's minimum {engine.plan.min_bytes(rank)}")
            if i:
                for name, v in times.items():
                    runs[name].append(v)
        for buf in engine.gen_buffers():  # the check sees what the point-to-point switch itself wrote
            buf.fill_(float("nan"))
        engine.reshard()
        diff = torch.tensor([engine.max_abs_diff()])
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        if diff.item() != 0.0:
            raise RuntimeError(f"N={world} gen_tp={tp}: generation weights differ from training (max |diff| = {diff.item()})")
        rows.append(dict(world_size=world, train_layout=f"dp{world}", gen_tp=tp, mode="timing", rank=rank, bytes_received=stats["bytes_received"],
                         min_bytes=engine.plan.min_bytes(rank), independent_bytes=indep_bytes, runs=runs))
        engine.release()
        del engine, rollout
    write_gathered(rows, world, rank, out_file)
    dist.destroy_process_group()


def timing_rows(per_rank: list[dict]) -> list[dict]:
    """One row per layout: per round the slowest rank of each measurement (a switch ends when its
    last rank does), then the best round and the median round of each."""
    rows = []
    for key in sorted({(r["world_size"], r["gen_tp"]) for r in per_rank}):
        rs = [r for r in per_rank if (r["world_size"], r["gen_tp"]) == key]
        row = dict(world_size=key[0], train_layout=rs[0]["train_layout"], gen_tp=key[1], mode="timing",
                   bytes_per_rank=max(r["bytes_received"] for r in rs), min_bytes_per_rank=max(r["min_bytes"] for r in rs),
                   independent_bytes_per_rank=max(r["independent_bytes"] for r in rs))
        for name in rs[0]["runs"]:
            rounds = [max(r["runs"][name][i] for r in rs) for i in range(len(rs[0]["runs"][name]))]
            row[f"{name}_s"], row[f"{name}_median_s"] = min(rounds), statistics.median(rounds)
        row["ratio"] = row["optimized_s"] / row["floor_s"]
        row["ratio_allgather"] = row["optimized_s"] / row["allgather_s"]
        rows.append(row)
    return rows


def print_timing(rows: list[dict], repeats: int, load: tuple[float, float]) -> None:
    print(f"\nthe switch under the trainer's worker environment (config.schema.DEFAULT_WORKER_ENV, no MALLOC_* setting), FSDP layouts: "
          f"best of {repeats} rounds (median in brackets), the slowest rank per round; load average (1 min) {load[0]:.2f} before, {load[1]:.2f} after")
    head = (f"{'N':>2} {'train':<6} {'gen_tp':>6} {'MB/rank':>8} {'optimized s':>15} {'gather path s':>15} {'floor s':>15} {'ratio':>6} "
            f"{'all-gather floor s':>18} {'ratio':>6} {'p2p floor s':>15}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        cell = lambda name: f"{r[name + '_s']:.3f} ({r[name + '_median_s']:.3f})"  # noqa: E731
        print(f"{r['world_size']:>2} {r['train_layout']:<6} {r['gen_tp']:>6} {r['bytes_per_rank'] / MB:>8.2f} {cell('optimized'):>15} "
              f"{cell('gather_path'):>15} {cell('floor'):>15} {r['ratio']:>5.2f}x {cell('allgather'):>18} {r['ratio_allgather']:>5.2f}x {cell('p2p'):>15}")
    yes = lambda ok: "yes" if ok else "no"  # noqa: E731
    big = [r for r in rows if r["bytes_per_rank"] > MB]
    print(f"bytes == the planner's minimum == the independent floors' in every layout: "
          f"{yes(all(r['bytes_per_rank'] == r['min_bytes_per_rank'] == r['independent_bytes_per_rank'] for r in rows))}")
    if big:
        print(f"optimized <= 1.2x floor in every FSDP layout moving > 1 MB per rank: {yes(all(r['ratio'] <= 1.2 for r in big))} "
              f"(worst {max(r['ratio'] for r in big):.2f}x; against the independent all-gather floor, worst {max(r['ratio_allgather'] for r in big):.2f}x)")


def buffer_rows(path: str, actor, dims: dict, world: int, rank: int, repeats: int, percents: tuple) -> list[dict]:
    """`resharding_buffer_percent` at gen_tp 1 (module docstring): one engine per setting (None =
    unset), generation buffers kept. Each engine's first switch gives its peak extra memory (its
    staging pages touched for the first time); then, after a warm-up round, `repeats` rounds switch
    every engine in turn (interleaved, so load from other processes on this shared machine falls on
    every setting alike): median seconds, checked bit-exact after each engine's last switch."""
    import torch.distributed as dist

    from hybridflow.config.schema import HybridEngineConfig
    from hybridflow.hybrid_engine.executor import HybridEngine
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.hybrid_engine.staging import staging_plan
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import plan_for

    start = time.perf_counter()
    rollout = gen_model(path, world, 1)  # every engine writes into its parameters
    planned = plan_for(load_arch(path), ParallelDims(dp=world), 1, 4)  # `hybridflow plan`, from config.json alone
    engines, rows = [], []
    for percent in percents:
        engine = HybridEngine(actor, rollout, dims, 1, HybridEngineConfig(keep_generation_buffers=True, resharding_buffer_percent=percent), "cpu")
        dist.barrier()
        first = engine.reshard()
        predicted = staging_plan(planned, percent)
        engines.append(engine)
        rows.append(dict(world_size=world, train_layout=f"dp{world}", gen_tp=1, mode="buffer", rank=rank,
                         percent="unset" if percent is None else percent, first_peak_extra_bytes=first["peak_extra_bytes"],
                         layers_in_flight=first["layers_in_flight"], staging_bytes=engine.staging_bytes, planned_layers=predicted.slots,
                         planned_staging_bytes=predicted.staging_bytes(rank), note=engine.staging_plan.note, runs=[]))
    for i in range(1 + repeats):
        for engine, row in zip(engines, rows):
            dist.barrier()
            stats = engine.reshard()
            if i:
                row["runs"].append(stats)
            if i == repeats:  # its generation weights are the trained ones, bit for bit (every rank aborts together)
                diff = torch.tensor([engine.max_abs_diff()])
                dist.all_reduce(diff, op=dist.ReduceOp.MAX)
                if diff.item() != 0.0:
                    raise RuntimeError(f"resharding_buffer_percent={row['percent']}: generation weights differ from training (max |diff| = {diff.item()})")
    for row in rows:
        runs = row.pop("runs")
        row.update(seconds=statistics.median(s["seconds"] for s in runs), bytes_received=max(s["bytes_received"] for s in runs),
                   warm_peak_extra_bytes=max(s["peak_extra_bytes"] for s in runs), rows_seconds=time.perf_counter() - start)
    for engine in engines:
        engine.release()
    return rows


def print_buffer(rows: list[dict]) -> None:
    """One row per setting (the slowest / largest rank of each quantity) and the notes."""
    if not rows:
        return
    n = rows[0]["world_size"]
    print(f"\nresharding_buffer_percent: N={n} dp{n} -> gen_tp 1 (every rank gathers the whole model), layer granularity, "
          f"generation buffers kept; peak extra = the first switch (staging pages touched), seconds = median of the later ones "
          f"(these rows: {max(r['rows_seconds'] for r in rows):.1f}s)")
    head = (f"{'percent':>7} {'layers in flight':>16} {'planned':>7} {'staging MB':>10} {'planned MB':>10} {'peak extra MB':>13} "
            f"{'warm peak MB':>12} {'seconds':>8}")
    print(head + "\n" + "-" * len(head))
    order = list(dict.fromkeys(r["percent"] for r in rows))
    merged = []
    for pct in order:
        rs = [r for r in rows if r["percent"] == pct]
        m = {k: max(r[k] for r in rs) for k in ("layers_in_flight", "planned_layers", "staging_bytes", "planned_staging_bytes",
                                                 "first_peak_extra_bytes", "warm_peak_extra_bytes", "seconds")}
        merged.append(dict(m, percent=pct, note=rs[0]["note"]))
        print(f"{str(pct):>7} {m['layers_in_flight']:>16} {m['planned_layers']:>7} {m['staging_bytes'] / MB:>10.2f} {m['planned_staging_bytes'] / MB:>10.2f} "
              f"{m['first_peak_extra_bytes'] / MB:>13.2f} {m['warm_peak_extra_bytes'] / MB:>12.2f} {m['seconds']:>8.3f}")
    for m in merged:
        if m["note"]:
            print(f"  {m['note']}")
    yes = lambda ok: "yes" if ok else "no"  # noqa: E731
    print(f"engine's layers in flight and staging == hybridflow plan's in every row: "
          f"{yes(all((m['layers_in_flight'], m['staging_bytes']) == (m['planned_layers'], m['planned_staging_bytes']) for m in merged))}")


def bf16_row(path: str, actor, dims: dict, world: int, tp: int, rank: int, repeats: int, cluster) -> dict:
    """`bf16`: the same fp32 training shards to bf16 generation weights (mixed-precision training
    generates in bf16): each shard is cast once before it is sent, so the wire carries 2 bytes per
    element; checked bit-exact against the trained weights rounded to bf16."""
    from hybridflow.config.schema import HybridEngineConfig
    from hybridflow.hybrid_engine.executor import HybridEngine
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import plan_for, predict_switch

    rollout = gen_model(path, world, tp, torch.bfloat16)
    engine = HybridEngine(actor, rollout, dims, tp, HybridEngineConfig(granularity="layer", keep_generation_buffers=True), "cpu", dtype=torch.bfloat16)
    planned = plan_for(load_arch(path), ParallelDims(dp=world), tp, 2)
    row = dict(world_size=world, train_layout=f"dp{world}", gen_tp=tp, mode="bf16", rank=rank,
               **timed_switches(engine, True, repeats, f"N={world} gen_tp={tp} bf16"),
               min_bytes=engine.plan.min_bytes(rank), naive_bytes=engine.plan.naive_bytes(rank), planner_bytes=planned.min_bytes(rank),
               predicted_seconds=predict_switch(planned, cluster)["optimized"].predicted_seconds)
    engine.release()
    return row


def delta_row(path: str, actor, dims: dict, world: int, tp: int, rank: int, opt) -> dict:
    """`delta`: what the delta sync (`hybrid_engine/delta.py`, as the cross-pool sync sends it) would
    send of this layout's bf16 generation slices across one real AdamW step at lr 1e-6 (`opt`, kept
    across the layouts, so each is a later step): each slice switched before and after the step,
    the new one encoded against the old (`delta.encode`), every rebuilt piece checked bit for bit;
    next to it `hybridflow plan`'s delta bytes at the measured changed fraction."""
    import torch.distributed as dist

    from hybridflow.config.schema import HybridEngineConfig
    from hybridflow.hybrid_engine.delta import apply, encode, payload_bytes
    from hybridflow.hybrid_engine.executor import HybridEngine
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import delta_sync_bytes, plan_for

    rollout = gen_model(path, world, tp, torch.bfloat16)
    engine = HybridEngine(actor, rollout, dims, tp, HybridEngineConfig(granularity="layer", keep_generation_buffers=True), "cpu", dtype=torch.bfloat16)
    pieces = lambda: {w.name: w.tensor.clone() for w in engine.pieces()}  # noqa: E731
    before = pieces()
    ids = torch.randint(3, 250, (2, 32), generator=torch.Generator().manual_seed(tp))
    actor(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    after = pieces()
    dist.barrier()
    start = time.perf_counter()
    payloads = {n: encode(after[n], before[n], False) for n in after}
    seconds = time.perf_counter() - start
    assert all(torch.equal(apply(payloads[n][0], before[n]), after[n]) for n in after)  # rebuilt bit for bit, CRC checked
    changed, elements = sum(k for _, k in payloads.values()), sum(t.numel() for t in after.values())
    planned = plan_for(load_arch(path), ParallelDims(dp=world), tp, 2)
    engine.release()
    return dict(world_size=world, train_layout=f"dp{world}", gen_tp=tp, mode="delta", rank=rank, changed=changed / elements,
                full_bytes=sum(t.numel() * 2 for t in after.values()), delta_bytes=sum(payload_bytes(p) for p, _ in payloads.values()),
                planned_bytes=delta_sync_bytes(planned, changed / elements, rank), seconds=seconds)


def print_delta(rows: list[dict]) -> None:
    print("\ndelta sync of the bf16 generation slices across one AdamW step at lr 1e-6 (worst rank; every piece rebuilt bit for bit)")
    head = f"{'N':>2} {'gen_tp':>6} {'changed':>8} {'whole MB/rank':>13} {'delta MB/rank':>13} {'delta/whole':>11} {'planned MB':>10} {'encode s':>8}"
    print(head + "\n" + "-" * len(head))
    for key in sorted({(r["world_size"], r["gen_tp"]) for r in rows}):
        rs = [r for r in rows if (r["world_size"], r["gen_tp"]) == key]
        full, delta = max(r["full_bytes"] for r in rs), max(r["delta_bytes"] for r in rs)
        print(f"{key[0]:>2} {key[1]:>6} {max(r['changed'] for r in rs):>8.4f} {full / MB:>13.2f} {delta / MB:>13.2f} {delta / full:>11.3f} "
              f"{max(r['planned_bytes'] for r in rs) / MB:>10.2f} {max(r['seconds'] for r in rs):>8.3f}")


PREFILL = (4, 64)  # the generation's first forward: 4 prompts x 64 tokens


def overlap_row(path: str, actor, dims: dict, world: int, tp: int, rank: int, repeats: int) -> dict:
    """`overlap`: the switch followed by the generation's first forward (prefill, PREFILL), run one
    after the other (`reshard()`, then the forward) and streamed (`HybridEngine.stream()`: forward
    pre-hooks complete each layer just before it runs, so layer i+1's gathers are in flight while
    layer i computes). Medians of `repeats` after a warm-up; the streamed logits must equal the
    sequential ones."""
    import torch.distributed as dist

    from hybridflow.config.schema import HybridEngineConfig
    from hybridflow.hybrid_engine.executor import HybridEngine

    rollout = gen_model(path, world, tp)
    engine = HybridEngine(actor, rollout, dims, tp, HybridEngineConfig(granularity="layer", keep_generation_buffers=True), "cpu")
    ids = torch.randint(3, rollout.config.vocab_size, PREFILL, generator=torch.Generator().manual_seed(0))

    def timed(fn) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def prefill():
        with torch.no_grad():
            return rollout(input_ids=ids).logits

    def streamed():
        stream = engine.stream()
        handles = stream.hooks(rollout)
        try:
            out = prefill()
        finally:
            for h in handles:
                h.remove()
        stream.finish()
        return out

    runs = {"switch": [], "prefill": [], "sequential": [], "overlapped": []}
    for i in range(1 + repeats):
        times = {"switch": timed(engine.reshard), "prefill": timed(prefill)}
        want = prefill()
        times["sequential"] = timed(lambda: (engine.reshard(), prefill()))
        got = []
        times["overlapped"] = timed(lambda: got.append(streamed()))
        if not torch.equal(got[0], want):
            raise RuntimeError(f"N={world} gen_tp={tp}: the streamed switch's prefill logits differ from the sequential ones")
        if i:
            for k, v in times.items():
                runs[k].append(v)
    engine.release()
    return dict(world_size=world, train_layout=f"dp{world}", gen_tp=tp, mode="overlap", rank=rank, **{k: statistics.median(v) for k, v in runs.items()})


def print_overlap(rows: list[dict]) -> None:
    """One row per layout (the slowest rank of each quantity): hidden = the part of the switch's
    time the overlap removed from switch + prefill."""
    print(f"\nswitch + prefill ({PREFILL[0]} prompts x {PREFILL[1]} tokens), sequential vs streamed behind the prefill's layers")
    head = f"{'N':>2} {'gen_tp':>6} {'switch s':>8} {'prefill s':>9} {'sequential s':>12} {'overlapped s':>12} {'hidden':>7}"
    print(head + "\n" + "-" * len(head))
    keys = sorted({(r["world_size"], r["gen_tp"]) for r in rows})
    for n, tp in keys:
        rs = [r for r in rows if (r["world_size"], r["gen_tp"]) == (n, tp)]
        w = {k: max(r[k] for r in rs) for k in ("switch", "prefill", "sequential", "overlapped")}
        hidden = (w["sequential"] - w["overlapped"]) / w["switch"] if w["switch"] > 0 else float("nan")
        print(f"{n:>2} {tp:>6} {w['switch']:>8.3f} {w['prefill']:>9.3f} {w['sequential']:>12.3f} {w['overlapped']:>12.3f} {hidden:>7.0%}")


def lora_rows(path: str, world: int, rank: int, repeats: int, cluster, lora_rank: int) -> list[dict]:
    """LoRA (all-linear) on the same model, generation TP 1 (what LoRA runs today): `lora-first` is the
    first switch (the frozen base moves, once), `lora` the steady one (the adapters alone)."""
    from transformers import AutoModelForCausalLM

    from hybridflow.config.schema import HybridEngineConfig, ModelConfig
    from hybridflow.hybrid_engine.executor import HybridEngine
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.models.lora import apply_lora
    from hybridflow.parallel.fsdp import apply_fsdp2, make_mesh
    from hybridflow.parallel.tensor_parallel import fsdp_shard_placement_fn, gen_shard_dims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import MemoryInputs, frozen_params, plan_for, predict_switch

    mcfg = ModelConfig(path=path, lora_rank=lora_rank, lora_alpha=2 * lora_rank)
    actor = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), mcfg)
    dims = gen_shard_dims(actor)
    apply_fsdp2(actor, make_mesh("cpu", world), shard_placement_fn=fsdp_shard_placement_fn(actor, world))
    with torch.no_grad():  # trained adapters (B is 0 at init)
        gen = torch.Generator().manual_seed(rank)
        for p in actor.parameters():
            if p.requires_grad:
                p.to_local().add_(torch.randn(p.to_local().shape, generator=gen) * 0.01)
    rollout = apply_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), mcfg).eval().requires_grad_(False)
    engine = HybridEngine(actor, rollout, dims, 1, HybridEngineConfig(granularity="layer", keep_generation_buffers=True), "cpu")
    planned = plan_for(load_arch(path), ParallelDims(dp=world), 1, 4, lora_rank=lora_rank)
    frozen = frozen_params(planned, MemoryInputs(lora_rank=lora_rank))
    first = engine.reshard(optimized=True)
    common = dict(world_size=world, train_layout=f"dp{world}", gen_tp=1, rank=rank, naive_bytes=engine.plan.naive_bytes(rank))
    rows = [dict(common, mode="lora-first", seconds=first["seconds"], bytes_received=first["bytes_received"], peak_extra_bytes=first["peak_extra_bytes"],
                 theory_extra_bytes=first["theory_extra_bytes"], min_bytes=engine.plan.min_bytes(rank), planner_bytes=planned.min_bytes(rank),
                 predicted_seconds=predict_switch(planned, cluster)["optimized"].predicted_seconds)]
    steady = timed_switches(engine, True, repeats, f"N={world} LoRA rank {lora_rank}")
    rows.append(dict(common, mode="lora", **steady, min_bytes=engine.plan.min_bytes(rank, engine.frozen), planner_bytes=planned.min_bytes(rank, frozen),
                     predicted_seconds=predict_switch(planned, cluster, frozen)["optimized"].predicted_seconds))
    engine.release()
    return rows


def timed_switches(engine, optimized: bool, repeats: int, what: str) -> dict:
    """`repeats` timed switches after one warm-up, checked bit-exact (every rank aborts together):
    median seconds and the worst bytes and memory of this rank."""
    import torch.distributed as dist

    runs = []
    for i in range(1 + repeats):
        engine.release()
        dist.barrier()
        stats = engine.reshard(optimized=optimized)
        if i:
            runs.append(stats)
    diff = torch.tensor([engine.max_abs_diff()])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if diff.item() != 0.0:
        raise RuntimeError(f"{what}: generation weights differ from training (max |diff| = {diff.item()})")
    return dict(seconds=statistics.median(s["seconds"] for s in runs), bytes_received=max(s["bytes_received"] for s in runs),
                peak_extra_bytes=max(s["peak_extra_bytes"] for s in runs), theory_extra_bytes=max(s["theory_extra_bytes"] for s in runs))


def write_gathered(results: list[dict], world: int, rank: int, out_file: str) -> None:
    """Every rank's rows, pickled by rank 0 (a collective)."""
    import torch.distributed as dist

    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out_file, "wb") as f:
            pickle.dump([r for per_rank in gathered for r in per_rank], f)


LAYOUTS_3D = ("tp2xdp2", "pp2xdp2", "pp2xtp2")  # at N = 4, on MODEL_3D (16 layers: two equal stages)
MODEL_3D = dict(MODEL, num_hidden_layers=16)


def worker_3d(rank: int, world: int, port: int, path: str, repeats: int, out_file: str) -> None:
    """3D training layouts (TP x FSDP2, pipeline stages) built as the actor worker builds them
    (`parallel/layout.py`), into every generation TP the layout allows: optimized vs naive."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from hybridflow.config.schema import FSDPConfig, HybridEngineConfig
    from hybridflow.engine.train_engine import token_head
    from hybridflow.hybrid_engine.executor import HybridEngine, local
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.parallel.layout import build_train_model, train_mesh
    from hybridflow.parallel.tensor_parallel import apply_tensor_parallel, gen_mesh, gen_shard_dims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.calibrate import measure
    from hybridflow.planning.cost import Cluster, plan_for, predict_switch

    hf_logging.disable_progress_bar()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cal = measure()
    cluster = Cluster(nodes=1, gpus_per_node=world, intra_node_bw=cal["bandwidth"], inter_node_bw=cal["bandwidth"],
                      latency_s=cal["latency_s"], copy_bw=cal["copy_bw"])
    results = []
    for label in LAYOUTS_3D:
        layout = ParallelDims.parse(label)
        dims = train_mesh(layout, "cpu")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        gdims = gen_shard_dims(model)
        full_shapes = {n: (tuple(p.shape), p.element_size()) for n, p in model.named_parameters()}
        actor, _ = build_train_model(model, dims, "cpu", FSDPConfig(), head=token_head)
        with torch.no_grad():  # the trained weights differ from the checkpoint the rollout loads
            # one seed per (stage, dp rank, parameter): TP ranks holding replicas of a norm stay equal
            for i, p in enumerate(actor.parameters()):
                gen = torch.Generator().manual_seed((dims.pp_i * 1000 + dims.dp_i) * 1000 + i)
                local(p.data).add_(torch.randn(local(p.data).shape, generator=gen) * 0.01)
        cfg = model.config
        for tp in (1, 2, 4):
            if cfg.num_attention_heads % tp or cfg.num_key_value_heads % tp or not layout.fits_gen_tp(tp):  # the layout's rule (parallel/dims.py)
                continue
            rollout = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
            if tp > 1:
                apply_tensor_parallel(rollout, gen_mesh("cpu", world, tp, layout)["tp"])
            engine = HybridEngine(actor, rollout, gdims, tp, HybridEngineConfig(granularity="layer", keep_generation_buffers=True), "cpu",
                                  None, layout, full_shapes)
            planned = plan_for(load_arch(path), layout, tp, 4)
            predicted = predict_switch(planned, cluster)
            for mode in ("optimized", "naive"):
                results.append(dict(
                    world_size=world, train_layout=label, gen_tp=tp, mode=mode, rank=rank,
                    **timed_switches(engine, mode == "optimized", repeats, f"{label} gen_tp={tp} {mode}"),
                    min_bytes=engine.plan.min_bytes(rank), naive_bytes=engine.plan.naive_bytes(rank),
                    planner_bytes=planned.naive_bytes(rank) if mode == "naive" else planned.min_bytes(rank),
                    predicted_seconds=predicted[mode].predicted_seconds,
                ))
            engine.release()
            del engine, rollout
        del actor, model
    write_gathered(results, world, rank, out_file)
    dist.destroy_process_group()


def floor_gathers(engine) -> tuple:
    """The collectives alone (module docstring), ready to run: (fn, bytes a rank receives in it).
    Independent of the engine's code: the buffers are sized from the plan's boxes here and
    allocated now, and `fn` runs nothing but the all-gathers."""
    import torch.distributed as dist

    from hybridflow.hybrid_engine.plan import volume

    plan, n, k = engine.plan, engine.world, engine.plan.k
    layers: dict[str, list[int]] = {}  # layer -> [TP-sharded numel per rank, replicated numel per rank]
    for p in plan.params:
        c = layers.setdefault(p.layer, [0, 0])
        if p.moves:
            c[0 if p.tp_sharded else 1] += max(volume(b) for b in p.own)  # equal pieces (the largest when uneven)
    gathers = []  # (send, receive, group), in layer order
    for sharded, replicated in layers.values():
        if k > 1 and sharded:
            gathers.append((torch.empty(sharded), torch.empty(k * sharded), engine.micro_group))
        if replicated:
            gathers.append((torch.empty(replicated), torch.empty(n * replicated), None))
    received = sum(out.numel() - send.numel() for send, out, _ in gathers) * 4

    def fn() -> None:
        for send, out, group in gathers:
            dist.all_gather_into_tensor(out, send, group=group)

    return fn, received


def floor_seconds(engine, repeats: int) -> tuple[list[float], int]:
    """`floor_gathers`: `repeats` timed runs after a warm-up, and the bytes a rank receives in them."""
    import torch.distributed as dist

    fn, received = floor_gathers(engine)
    times = []
    for i in range(1 + repeats):
        dist.barrier()
        t = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t)
    return times, received


MODES = ("optimized", "released", "frozen", "naive", "floor", "bf16", "lora-first", "lora")


def rows_from(per_rank: list[dict]) -> list[dict]:
    """One row per (world_size, gen_tp, mode): the worst rank of each quantity."""
    order = {}  # FSDP rows first (by N), then the 3D layouts in the order they ran
    for r in per_rank:
        order.setdefault((r["world_size"], r["train_layout"]), len(order))
    keys = sorted({(order[r["world_size"], r["train_layout"]], r["world_size"], r["train_layout"], r["gen_tp"], MODES.index(r["mode"])) for r in per_rank})
    rows = []
    for _, n, lay, tp, mode in keys:
        rs = [r for r in per_rank if (r["world_size"], r["train_layout"], r["gen_tp"], r["mode"]) == (n, lay, tp, MODES[mode])]
        rows.append(dict(
            world_size=n, train_layout=lay, gen_tp=tp, mode=MODES[mode],
            bytes_per_rank=max(r["bytes_received"] for r in rs), min_bytes_per_rank=max(r["min_bytes"] for r in rs),
            naive_bytes_per_rank=max(r["naive_bytes"] for r in rs), seconds=max(r["seconds"] for r in rs),
            peak_extra_bytes=max(r["peak_extra_bytes"] for r in rs), theory_extra_bytes=max(r["theory_extra_bytes"] for r in rs),
            planner_bytes_per_rank=max(r["planner_bytes"] for r in rs), predicted_seconds=max(r["predicted_seconds"] for r in rs),
        ))
    for row in rows:
        same = {r["mode"]: r for r in rows if (r["world_size"], r["train_layout"], r["gen_tp"]) == (row["world_size"], row["train_layout"], row["gen_tp"])}
        if row["mode"] in ("optimized", "released", "frozen", "bf16"):
            row["speedup"] = same["naive"]["seconds"] / row["seconds"] if row["seconds"] > 0 else float("inf")
            if "floor" in same and row["mode"] != "bf16":  # the floor moves fp32 bytes
                row["ratio_vs_floor"] = row["seconds"] / same["floor"]["seconds"] if same["floor"]["seconds"] > 0 else float("inf")
    return rows


def print_table(rows: list[dict]) -> None:
    head = (f"{'N':>2} {'train':<8} {'gen_tp':>6} {'mode':<9} {'recv MB/rank':>12} {'min MB/rank':>11} {'naive MB/rank':>13} {'planned MB':>10} {'seconds':>8} "
            f"{'predicted':>9} {'speedup':>7} {'vs floor':>8} {'peak extra MB':>13} {'theory MB':>9}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        floor = f"{r['ratio_vs_floor']:.2f}x" if "ratio_vs_floor" in r else ""
        print(f"{r['world_size']:>2} {r['train_layout']:<8} {r['gen_tp']:>6} {r['mode']:<9} {r['bytes_per_rank'] / MB:>12.2f} "
              f"{r['min_bytes_per_rank'] / MB:>11.2f} "
              f"{r['naive_bytes_per_rank'] / MB:>13.2f} {r['planner_bytes_per_rank'] / MB:>10.2f} {r['seconds']:>8.3f} {r['predicted_seconds']:>9.3f} "
              f"{speed:>7} {floor:>8} {r['peak_extra_bytes'] / MB:>13.2f} {r['theory_extra_bytes'] / MB:>9.2f}")
    opt = [r for r in rows if r["mode"] == "optimized"]
    yes = lambda ok: "yes" if ok else "no"  # noqa: E731
    MINIMAL_MODES = ("optimized", "released", "frozen", "bf16", "lora-first", "lora")  # the modes that move the planner's minimum
    print(f"bytes == theoretical minimum in every optimized layout: "
          f"{yes(all(r['bytes_per_rank'] == r['min_bytes_per_rank'] for r in rows if r['mode'] in MINIMAL_MODES))}")
    halves = [(r, next(o for o in opt if (o["world_size"], o["train_layout"], o["gen_tp"]) == (r["world_size"], r["train_layout"], r["gen_tp"])))
              for r in rows if r["mode"] == "bf16"]
    if halves:
        halved = all(2 * b["bytes_per_rank"] == o["bytes_per_rank"] for b, o in halves)
        print(f"bf16 bytes == exactly half the fp32 optimized bytes in every layout: {yes(halved)}")
    print(f"hybridflow plan's bytes (config.json only) == measured in every layout and mode: "
          f"{yes(all(r['bytes_per_rank'] == r['planner_bytes_per_rank'] for r in rows))}")
    target = [r for r in opt if (r["train_layout"], r["gen_tp"]) == ("dp4", 2)]
    if target:
        print(f"N=4 gen_tp=2 speedup >= 2x: {yes(target[0]['speedup'] >= 2)} ({target[0]['speedup']:.2f})")
    floored = [r for r in opt if "ratio_vs_floor" in r]
    if floored:
        print(f"optimized <= 1.2x floor in every FSDP layout (memory pass: both slowed by its malloc): {yes(all(r['ratio_vs_floor'] <= 1.2 for r in floored))} "
              f"(worst {max(r['ratio_vs_floor'] for r in floored):.2f}x)")
    print(f"optimized peak extra <= theory in every layout: {yes(all(r['peak_extra_bytes'] <= r['theory_extra_bytes'] for r in opt))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes (gloo processes)")
    ap.add_argument("--repeats", type=int, default=3, help="timed reshards per layout and mode (after 1 warm-up)")
    ap.add_argument("--model-dir", default=None, help="reuse (or build into) this directory instead of a temp dir")
    ap.add_argument("--json", default=None, help="write the rows as a JSON list to this path")
    ap.add_argument("--no-3d", action="store_true", help=f"skip the 3D training layouts {LAYOUTS_3D} at N=4")
    ap.add_argument("--lora-rank", type=int, default=16, help="LoRA rows (first and steady switch, gen TP 1) at this rank; 0: none")
    ap.add_argument("--buffer-percents", default="unset,0.1,0.3",
                    help="resharding_buffer_percent rows at the smallest world size, gen TP 1 (comma separated, 'unset' = the default; '' = none)")
    ap.add_argument("--buffer-only", action="store_true", help="only the resharding_buffer_percent rows (N = 2, no 3D layouts)")
    ap.add_argument("--timing-repeats", type=int, default=5, help="rounds of the timing pass (best and median reported, after 1 warm-up)")
    ap.add_argument("--timing-only", action="store_true", help="only the timing pass (the trainer's worker environment)")
    args = ap.parse_args()
    percents = tuple(None if p.strip() == "unset" else float(p) for p in args.buffer_percents.split(",") if p.strip())
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.buffer_only:
        worlds, args.no_3d = [min(worlds)], True

    from hybridflow.models.tiny import make_tiny_model

    tmp = tempfile.TemporaryDirectory()
    path = args.model_dir or os.path.join(tmp.name, "model")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(path, **MODEL)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).parameters())
    print(f"model: {path} ({n_params / 1e6:.1f}M parameters, {n_params * 4 / MB:.1f} MB fp32)")
    if n_params < 50e6:
        print("WARNING: fewer than 50M parameters", file=sys.stderr)

    import torch.multiprocessing as mp

    start = time.perf_counter()
    timing = []
    if not args.buffer_only:  # the timing pass: the trainer's worker environment, inherited by the spawned workers
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(trainer_env())
        load_before = os.getloadavg()[0]
        per_rank = []
        for world in worlds:
            t0 = time.perf_counter()
            out_file = os.path.join(tmp.name, f"timing_{world}.pkl")
            mp.spawn(timing_worker, args=(world, free_port(), path, args.timing_repeats, out_file), nprocs=world)
            with open(out_file, "rb") as f:
                per_rank += pickle.load(f)
            print(f"timing pass N={world}: done in {time.perf_counter() - t0:.1f}s")
        timing = timing_rows(per_rank)
        print_timing(timing, args.timing_repeats, (load_before, os.getloadavg()[0]))
        os.environ.clear()
        os.environ.update(saved)
        if args.timing_only:
            if args.json:
                write_rows(args.json, timing)
            return

    # The memory pass (every table below): MALLOC_MMAP_THRESHOLD_=65536, inherited by the spawned
    # workers (utils/memory.py: one mmap per large tensor, so RSS is exact). It makes every large
    # temporary fresh zeroed pages, gloo's included, so its seconds are slower than the trainer's
    # (the timing pass above); its `vs floor` compares two numbers slowed alike.
    os.environ.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    print("\nmemory pass (MALLOC_MMAP_THRESHOLD_=65536 for exact RSS; its seconds are not the trainer's: see the timing pass)")
    per_rank = []
    for world in worlds:
        t0 = time.perf_counter()
        out_file = os.path.join(tmp.name, f"result_{world}.pkl")
        buffers = percents if world == min(worlds) else ()
        mp.spawn(worker, args=(world, free_port(), path, args.repeats, out_file, args.lora_rank, buffers, args.buffer_only), nprocs=world)
        with open(out_file, "rb") as f:
            per_rank += pickle.load(f)
        print(f"N={world}: done in {time.perf_counter() - t0:.1f}s")
    if not args.no_3d:
        path3 = path + "_16layers"
        if not os.path.exists(os.path.join(path3, "config.json")):
            make_tiny_model(path3, **MODEL_3D)
        t0 = time.perf_counter()
        out_file = os.path.join(tmp.name, "result_3d.pkl")
        mp.spawn(worker_3d, args=(4, free_port(), path3, args.repeats, out_file), nprocs=4)
        with open(out_file, "rb") as f:
            per_rank += pickle.load(f)
        print(f"3D layouts {', '.join(LAYOUTS_3D)} (N=4, {MODEL_3D['num_hidden_layers']} layers): done in {time.perf_counter() - t0:.1f}s")
    print(f"total {time.perf_counter() - start:.1f}s\n")

    overlap = [r for r in per_rank if r["mode"] == "overlap"]
    buffer = [r for r in per_rank if r["mode"] == "buffer"]
    delta = [r for r in per_rank if r["mode"] == "delta"]
    rows = rows_from([r for r in per_rank if r["mode"] not in ("overlap", "buffer", "delta")])
    if rows:
        print_table(rows)
    if overlap:
        print_overlap(overlap)
    if delta:
        print_delta(delta)
    print_buffer(buffer)
    if args.json:
        write_rows(args.json, timing + rows + overlap + buffer + delta)


if __name__ == "__main__":
    main()
