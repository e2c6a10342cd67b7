"""`hybridflow plan`: predict a layout's weight switch and per-rank memory from a model config alone.

    hybridflow plan --preset llama3-8b --nodes 8 --gpus-per-node 8 --train-layout pp2xtp8xdp4 --gen-tp 4 --json plan.json
    hybridflow plan --model path/to/hf_checkpoint --gpus-per-node 4 --search
    hybridflow plan --calibrate --out runs/calibration.json        (then: --calibration runs/calibration.json)
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridflow.parallel.dims import ParallelDims
from hybridflow.planning.arch import PRESETS, load_arch
from hybridflow.planning.cost import DTYPE_BYTES, GIB, Cluster, MemoryInputs
from hybridflow.planning.search import gen_tp_problems, layout_problems, search

GB = 1e9
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "fsdp_unshard", "gen_weights", "kv_cache")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybridflow plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=sorted(PRESETS), help="built-in architecture numbers")
    model.add_argument("--model", help="an HF checkpoint directory or its config.json")
    c = ap.add_argument_group("cluster (defaults: A100 80 GB nodes, NVLink + one 200 Gb/s InfiniBand NIC per GPU)")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--intra-bw-gbs", type=float, default=200.0, help="GB/s each device receives inside a node")
    c.add_argument("--inter-bw-gbs", type=float, default=25.0, help="GB/s each device receives across nodes")
    c.add_argument("--latency-us", type=float, default=20.0, help="per collective step")
    c.add_argument("--copy-bw-gbs", type=float, default=1500.0, help="device-local copy speed")
    c.add_argument("--gpu-memory-gib", type=float, default=80.0)
    c.add_argument("--calibration", metavar="PATH", help="bandwidth/latency/copy measured by --calibrate (replaces the four above)")
    lay = ap.add_argument_group("layouts")
    lay.add_argument("--train-layout", help="pp x tp x dp, e.g. pp2xtp8xdp4 (default: FSDP over every device, dp<N>)")
    lay.add_argument("--gen-tp", default=None, help="generation TP size(s), comma separated (default: every valid one)")
    lay.add_argument("--fsdp", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
    lay.add_argument("--search", action="store_true", help="rank every valid training layout (unless --train-layout) and gen_tp")
    w = ap.add_argument_group("workload")
    w.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="weights moved by the switch, generation weights, KV cache, activations")
    w.add_argument("--param-dtype", default="fp32", choices=["bf16", "fp16", "fp32"], help="training shards and gradients")
    w.add_argument("--batch-size", type=int, default=128, help="prompts per step (data.train_batch_size)")
    w.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n)")
    w.add_argument("--prompt-length", type=int, default=1024)
    w.add_argument("--response-length", type=int, default=1024)
    w.add_argument("--micro-batch", type=int, default=1, help="sequences per training micro-batch per device")
    w.add_argument("--gradient-checkpointing", action="store_true")
    w.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"],
                   help="the attention kernel outside Ulysses (sp > 1 layouts run Ulysses'): eager keeps [heads, s, s] probabilities "
                        "per layer (what the engine runs for bf16 on CPU)")
    w.add_argument("--remove-padding", action="store_true", help="actor_rollout_ref.model.use_remove_padding: a micro-batch's "
                                                                 "sequences packed into one row (the mask / scores then span b x s tokens)")
    w.add_argument("--logits-chunk", type=int, default=1024, metavar="N",
                   help="tokens per chunk of the chunked log-prob pass (actor_rollout_ref.model.fused_kernel_chunk_size); "
                        "0: the plain [tokens, vocab] logits pass (actor_rollout_ref.model.use_fused_kernels=false)")
    w.add_argument("--resharding-buffer-percent", type=float, default=None, metavar="P",
                   help="the layer-wise switch's staging budget, 0 < P <= 1 of a rank's generation weights "
                        "(actor_rollout_ref.hybrid_engine.resharding_buffer_percent; default: 2 layers in flight)")
    w.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on every projection (all-linear): "
                                                            "grads and optimizer state for the adapters only; the base moves on the first switch only")
    w.add_argument("--delta-changed-fraction", type=float, default=None, metavar="F",
                   help="fraction of the weights' elements that change between two syncs, for the delta sync's bytes "
                        "(actor_rollout_ref.hybrid_engine.delta_sync; default: measured, 0.02 in bf16/fp16, 1.0 in fp32)")
    ap.add_argument("--json", metavar="PATH", help="write the rows (and invalid layouts) as JSON")
    cal = ap.add_argument_group("calibration")
    cal.add_argument("--calibrate", action="store_true", help="measure this machine's all-gather bandwidth/latency and copy speed")
    cal.add_argument("--procs", type=int, default=2, help="processes for --calibrate")
    cal.add_argument("--out", default="runs/calibration.json", help="where --calibrate writes")
    return ap


def cluster_from(args) -> Cluster:
    c = Cluster(args.nodes, args.gpus_per_node, args.intra_bw_gbs * GB, args.inter_bw_gbs * GB, args.latency_us * 1e-6,
                args.copy_bw_gbs * GB, args.gpu_memory_gib * GIB)
    if args.calibration:
        from hybridflow.planning.calibrate import load_calibration

        cal = load_calibration(args.calibration)
        c.intra_node_bw, c.inter_node_bw, c.latency_s, c.copy_bw = cal["intra_node_bw"], cal["inter_node_bw"], cal["latency_s"], cal["copy_bw"]
    return c


def memory_from(args) -> MemoryInputs:
    return MemoryInputs(param_bytes=DTYPE_BYTES[args.param_dtype], compute_bytes=DTYPE_BYTES[args.dtype], gen_bytes=DTYPE_BYTES[args.dtype],
                        strategy=args.fsdp, micro_batch=args.micro_batch, seq_len=args.prompt_length + args.response_length,
                        response_len=args.response_length, logits_chunk=args.logits_chunk or None,
                        rollout_seqs=args.batch_size * args.n, gradient_checkpointing=args.gradient_checkpointing, lora_rank=args.lora_rank,
                        attention=args.attention, packed=args.remove_padding,
                        buffer_percent=args.resharding_buffer_percent)


def print_rows(rows: list[dict], title: str) -> None:
    print(title)
    head = (f"{'train':<14} {'gen':>9} {'mode':<9} {'recv GB/rank max':>16} {'mean':>8} {'cross-node GB':>13} {'predicted s':>11} "
            f"{'memory GiB/rank':>15} {'fits':>4}")
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['train_layout']:<14} {'tp' + str(r['gen_tp']) + 'xdp' + str(r['gen_dp']):>9} {r['mode']:<9} {r['bytes_per_rank'] / GB:>16.3f} "
              f"{r['bytes_per_rank_mean'] / GB:>8.3f} {r['cross_node_bytes'] / GB:>13.2f} {r['predicted_seconds']:>11.3f} "
              f"{r['memory_per_rank_bytes'] / GIB:>15.2f} {'yes' if r['fits'] else 'NO':>4}")


def print_delta(rows: list[dict]) -> None:
    """The cross-pool sync per generation layout, whole and as a delta (one line each)."""
    for r in rows:
        f, full, delta = r["delta_changed_fraction"], r["full_sync_bytes_per_rank"], r["delta_bytes_per_rank"]
        print(f"cross-pool sync to gen tp{r['gen_tp']} (async rollout): {full / GB:.3f} GB per rank whole; as a delta "
              f"(actor_rollout_ref.hybrid_engine.delta_sync) at {f:.3g} of the elements changed: {delta / GB:.3f} GB "
              f"({delta / full if full else 0:.3f} of whole)")


def print_memory(row: dict) -> None:
    mem = row["memory"]
    parts = ", ".join(f"{k} {mem[k] / GIB:.2f}" for k in MEMORY_PARTS)
    print(f"memory plan per rank, worst rank, GiB ({row['train_layout']} -> gen tp{row['gen_tp']}): {parts}; "
          f"training phase {mem['train_peak'] / GIB:.2f}, generation phase {mem['gen_peak'] / GIB:.2f}, "
          f"peak {mem['peak'] / GIB:.2f} of {row['cluster']['memory_bytes'] / GIB:.0f}")
    if row["mode"] == "optimized":
        print(f"staging (layer granularity, optimized): {row['layers_in_flight']} layer(s) in flight, "
              f"{row['staging_bytes_per_rank'] / 2**20:.2f} MiB per rank (worst rank; not in the peak above)"
              + (f" -- {row['staging_note']}" if row["staging_note"] else ""))


def main_plan(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.calibrate:
        from hybridflow.planning.calibrate import calibrate

        cal = calibrate(args.procs, args.out)
        print(f"calibrated on {cal['procs']} gloo processes: all-gather {cal['bandwidth'] / GB:.3f} GB/s received per rank, latency "
              f"{cal['latency_s'] * 1e6:.0f} us per step, copy {cal['copy_bw'] / GB:.2f} GB/s -> {args.out}")
        return 0
    if not (args.preset or args.model):
        sys.exit("plan: give --preset NAME or --model PATH (or --calibrate)")
    if args.delta_changed_fraction is not None and not 0 <= args.delta_changed_fraction <= 1:
        sys.exit(f"plan: --delta-changed-fraction must be a fraction in [0, 1], got {args.delta_changed_fraction}")
    bp = args.resharding_buffer_percent
    if bp is not None and not 0 < bp <= 1:
        sys.exit(f"plan: --resharding-buffer-percent (actor_rollout_ref.hybrid_engine.resharding_buffer_percent) must be a fraction in (0, 1], got {bp}")
    try:
        arch = load_arch(args.preset or args.model)
        cluster = cluster_from(args)
        layout = ParallelDims.parse(args.train_layout) if args.train_layout else ParallelDims(dp=cluster.world)
    except ValueError as e:
        sys.exit(f"plan: {e}")
    if layout.world != cluster.world:
        sys.exit(f"plan: training layout {layout.label} has {layout.world} ranks but the cluster has {cluster.world} devices "
                 f"(--nodes {cluster.nodes} x --gpus-per-node {cluster.gpus_per_node})")
    gen_tps = [int(g) for g in args.gen_tp.split(",")] if args.gen_tp else None
    m = memory_from(args)
    layouts = None if args.search and not args.train_layout else [layout]
    if not args.search and gen_tps:  # asked-for layouts must be valid: say why not
        bad = layout_problems(arch, layout) + [p for g in gen_tps for p in gen_tp_problems(arch, layout, g)]
        if bad:
            sys.exit("plan: " + "; ".join(bad))
    ranked, invalid = search(arch, cluster, m, args.dtype, layouts, gen_tps)
    if not args.search:  # the naive row next to each optimized one, in gen_tp order; non-fitting layouts shown too
        from hybridflow.planning.cost import rows as plan_rows

        out = [r for g in sorted({r["gen_tp"] for r in ranked} | {i.gen_tp for i in invalid if i.reason.startswith("does not fit")})
               for r in plan_rows(arch, layout, g, cluster, m, args.dtype, args.delta_changed_fraction)]
    else:
        out = ranked
    print(f"model {arch.name}: {arch.num_params() / 1e9:.2f}B parameters ({arch.model_type}, {arch.layers} layers, {arch.heads} heads, "
          f"{arch.kv_heads} KV heads); cluster {cluster.nodes} x {cluster.gpus_per_node} devices, {cluster.intra_node_bw / GB:.3g} GB/s "
          f"intra-node, {cluster.inter_node_bw / GB:.3g} GB/s inter-node, {cluster.latency_s * 1e6:.3g} us latency; switch dtype {args.dtype}")
    if m.lora_rank:
        first = out[0]["first_switch_bytes_per_rank"] if out else 0
        print(f"LoRA rank {m.lora_rank} (all-linear): the optimized rows move the adapters per switch; the first switch moves "
              f"{first / GB:.3f} GB per rank (the base, once)")
    if arch.experts:
        print(f"MoE: {arch.experts} experts, top-{arch.top_k}, {arch.active_params() / 1e9:.2f}B of the {arch.num_params() / 1e9:.2f}B "
              f"parameters active per token; expert weights sharded over ep, whole in generation")
    title = ("ranked by predicted switch + expert communication seconds per step (FSDP / EP layouts first), then memory headroom:"
             if arch.experts else "ranked by predicted switch seconds, then memory headroom:")
    print_rows(out, title if args.search else "")
    if out:
        print_memory(out[0])
        if arch.experts:
            r = out[0]
            print(f"expert communication per step and rank ({r['train_layout']}): FSDP2 gathers of the experts "
                  f"{r['expert_fsdp_bytes_per_step'] / GB:.1f} GB, token all-to-all {r['a2a_bytes_per_step'] / GB:.1f} GB, "
                  f"{r['expert_comm_seconds']:.2f} s predicted" + ("" if r["expert_comm_modelled"] else " (TP / PP activations not modelled)"))
    if not args.search:
        print_delta([r for r in out if r["mode"] == "optimized"])
    for i in invalid:
        if args.search or gen_tps is None or not i.reason.startswith("does not fit"):
            print(f"invalid: {i.train_layout} gen_tp={i.gen_tp if i.gen_tp else '-'}: {i.reason}")
    if args.json:
        import os

        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rows": out, "invalid": [vars(i) for i in invalid]}, f, indent=1)
    return 0
