"""One GRPO step, hybridflow vs TRL's GRPOTrainer, side by side in one run.

    .venv/bin/pip install -e .[bench]                     # trl + gguf (bench only)
    .venv/bin/python scripts/get_smollm2.py runs/models/smollm2-135m
    .venv/bin/python bench/e2e.py --model runs/models/smollm2-135m --json runs/bench_e2e.json

The same step for both: 8 arithmetic prompts x 4 samples, 16 new tokens at temperature 1, the
exact-answer reward, lr 2e-6, no KL term, one on-policy update on all 32 sequences, in fp32
and/or bf16 (`--precision fp32,bf16`: hybridflow with `fsdp_config.mixed_precision=bf16`, so bf16
compute over fp32 shards and bf16 generation weights; TRL with `bf16=True`).
hybridflow runs 2 workers (Ray, FSDP2, HF rollout through the hybrid engine) with its speed
switches on (prompts padded to the batch's longest, padding removed, no separate old-log-prob
pass, generation buffers kept); TRL runs one process (its default). Also the pair on the demo's
tiny model (`model: tiny`), where a step is mostly fixed overhead. `--async-rollout` adds
`hybridflow async`: async rollout on split pools, one worker training on batch k while the other
generates batch k+1 (staleness 1; its stages are the update, `gen_wait` and `sync_weights`). Rows: system, model,
step_seconds (median over the steps after the first), tokens_per_second (generated tokens / step
seconds), and hybridflow's per-stage medians (timing_s/*). FLOP accounting (`flops.py`): this
machine's matmul peak is measured in the same run (fp32 and bf16, on 1 thread as each of
hybridflow's 2 workers runs, and on torch's thread count as TRL's one process runs); each row gets
the FLOPs of its generation and update (from the step's mean prompt and response lengths) and the
achieved fraction of the peak (MFU) per stage and for the whole step.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_rows  # noqa: E402
from flops import forward_flops, generation_flops, matmul_peak  # noqa: E402

PROMPTS, SAMPLES, NEW_TOKENS, LR = 8, 4, 16, 2e-6
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip().split("<")[0].strip() == str(ground_truth))
'''
STAGES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "reshard", "gen_wait", "sync_weights")
# Async rollout on split pools: 1 actor rank trains while 1 rollout rank generates the next batch (staleness 1).
SPLIT_POOLS = ("trainer.async_rollout=true", "resource_pool.pools.actor_pool.workers_per_node=1",
               "resource_pool.pools.rollout_pool.workers_per_node=1", "resource_pool.mapping.actor_rollout=actor_pool",
               "resource_pool.mapping.rollout=rollout_pool")


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = rng.choice("+-")
        rows.append({"data_source": "arith", "prompt": [{"role": "user", "content": f"What is {a} {op} {b}? Reply with only the number."}],
                     "reward_model": {"style": "rule", "ground_truth": str(a + b if op == "+" else a - b)}, "answer": str(a + b if op == "+" else a - b)})
    return rows


LORA_KEYS = ("param_bytes", "grad_bytes", "optimizer_bytes")
COMPILE_KEYS = ("compile/graphs", "compile/graph_breaks", "compile/recompiles")


def planned_state(model: str, lora_rank: int, dp: int = 2) -> dict:
    """The planner's parameters / gradients / optimizer bytes per rank for this bench's layout (fp32, FSDP over `dp`)."""
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import MemoryInputs, plan_for, worst_memory

    arch, layout = load_arch(model), ParallelDims(dp=dp)
    mem = worst_memory(plan_for(arch, layout, 1, 4, lora_rank=lora_rank), arch, layout, MemoryInputs(param_bytes=4, lora_rank=lora_rank))
    return {"plan/param_bytes": mem["params"], "plan/grad_bytes": mem["grads"], "plan/optimizer_bytes": mem["optimizer"]}


def bf16_units() -> str:
    """Which bf16 matmul units this CPU has (/proc/cpuinfo's flags): AMX tiles, AVX-512-BF16, or neither."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return "unknown (no /proc/cpuinfo)"
    return "AMX (amx_bf16)" if "amx_bf16" in flags else "AVX-512-BF16, no AMX" if "avx512_bf16" in flags else "no bf16 matmul units"


def run_hybridflow(model: str, train: str, reward: str, out: str, steps: int, lora_rank: int = 0, precision: str = "fp32",
                   split: bool = False, compile: bool = False, variant: tuple[str, list[str]] | None = None) -> dict:
    """split: async rollout on split pools (1 + 1 workers) instead of 2 colocated workers; compile:
    the actor's decoder layers torch.compile'd (actor.use_torch_compile); variant: (label, config
    overrides) applied last, the row named "hybridflow <label>"."""
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.trainer.rl import RLTrainer

    cfg = load_config(None, [
        f"data.train_files=[{train}]", f"data.train_batch_size={PROMPTS}", "data.max_prompt_length=96", f"data.max_response_length={NEW_TOKENS}",
        "data.prompt_padding=longest", f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.rollout.n={SAMPLES}", "actor_rollout_ref.rollout.temperature=1.0", f"actor_rollout_ref.actor.optim.lr={LR}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}", f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={PROMPTS * SAMPLES // 2}",
        # one on-policy pass needs no separate old-log-prob pass; split pools are off-policy (staleness 1): they need it
        f"actor_rollout_ref.actor.recompute_old_log_prob={str(split).lower()}", "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.adv_estimator=grpo",
        f"custom_reward_function.path={reward}", f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.progress_bar=false", "trainer.logger=[jsonl]", f"trainer.default_local_dir={out}", "trainer.device=cpu",
        "actor_rollout_ref.hybrid_engine.measure_baseline=false", f"actor_rollout_ref.model.lora_rank={lora_rank}",
        *(["actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16"] if precision == "bf16" else []),  # bf16 compute and generation
        *(SPLIT_POOLS if split else ()), f"actor_rollout_ref.actor.use_torch_compile={str(compile).lower()}",
        *(variant[1] if variant else ()),
    ], schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        first, *hist = [h for h in trainer.fit()["history"] if h["step"] > 0]  # the first step warms up (and compiles)
        stats = trainer.actor.shard_stats()  # per rank, after the last optimizer step
    finally:
        trainer.shutdown()
    step = statistics.median(h["timing_s/step"] for h in hist)
    tokens = statistics.median(h["response_length/mean"] * PROMPTS * SAMPLES for h in hist)
    system = f"hybridflow+lora{lora_rank}" if lora_rank else "hybridflow async" if split else "hybridflow"
    system += " compiled" if compile else ""
    system += f" {variant[0]}" if variant else ""
    row = {"system": system, "step_seconds": step, "tokens_per_second": tokens / step,
           "prompt_len": statistics.median(h["prompt_length/mean"] for h in hist), "response_len": statistics.median(h["response_length/mean"] for h in hist),
           **{k: max(s[k] for s in stats) for k in LORA_KEYS}, **planned_state(model, lora_rank, dp=1 if split else 2)}
    for k in COMPILE_KEYS:  # dynamo's counts on the workers after the last step (the ranks' mean), and the first step's time (compiling)
        if f"actor/{k}" in hist[-1]:
            row[k] = hist[-1][f"actor/{k}"]
    if compile:
        row["first_step_seconds"] = first["timing_s/step"]
    for s in STAGES:
        if f"timing_s/{s}" in hist[0]:
            row[f"timing_s/{s}"] = statistics.median(h[f"timing_s/{s}"] for h in hist)
    return row


def run_trl(model: str, rows: list[dict], out: str, steps: int, precision: str = "fp32") -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import torch

    def exact(completions, answer, **_):
        return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]

    times, lengths = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    tok = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    args = GRPOConfig(output_dir=out, use_cpu=True, bf16=precision == "bf16", report_to="none", learning_rate=LR, beta=0.0, num_generations=SAMPLES,
                      per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1, max_completion_length=NEW_TOKENS,
                      temperature=1.0, max_steps=steps, logging_steps=1, save_strategy="no", seed=1, disable_tqdm=True)
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    trainer = GRPOTrainer(model=policy, reward_funcs=exact, args=args, train_dataset=data, processing_class=tok, callbacks=[Clock()])
    trainer.train()
    step = statistics.median(times[1:])
    tokens = statistics.median(lengths[1:]) * PROMPTS * SAMPLES if lengths else float("nan")
    # tokens of each chat-formatted prompt (transformers 5 returns a dict here by default: count its input_ids)
    prompt_len = statistics.mean(len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"]) for r in rows)
    return {"system": "trl", "step_seconds": step, "tokens_per_second": tokens / step, "prompt_len": prompt_len,
            "response_len": statistics.median(lengths[1:]) if lengths else float("nan")}


def add_mfu(row: dict, arch, peak: float, update_peak: float | None = None) -> None:
    """The row's step FLOPs (generation + one forward and backward over every sequence, from its
    mean lengths) and MFU against `peak` FLOP/s, per stage where the stage was timed (the update
    against `update_peak` when it runs on fewer threads than the step: split pools)."""
    n = PROMPTS * SAMPLES
    p, r = round(row["prompt_len"]), round(row["response_len"])
    gen = generation_flops(arch, [p] * n, [r] * n)
    update = 3 * forward_flops(arch, [p + r] * n, logits=[r] * n)  # the head projects the response positions only
    row.update({"gflop/gen": gen / 1e9, "gflop/update": update / 1e9, "mfu/step": (gen + update) / row["step_seconds"] / peak})
    if "timing_s/gen" in row:  # split pools generate behind the update: no gen stage of their own
        row["mfu/gen"] = gen / row["timing_s/gen"] / peak
    if "timing_s/update_actor" in row:
        row["mfu/update"] = update / row["timing_s/update_actor"] / (update_peak or peak)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a real HF checkpoint (scripts/get_smollm2.py); omitted: tiny model only")
    ap.add_argument("--steps", type=int, default=4, help="steps per system (the first is not timed)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--lora-rank", type=int, default=0, help="also run hybridflow with LoRA adapters of this rank (all-linear)")
    ap.add_argument("--no-trl", action="store_true", help="hybridflow rows only")
    ap.add_argument("--no-tiny", action="store_true", help="only the --model rows (not the demo's tiny model)")
    ap.add_argument("--async-rollout", action="store_true", help="also hybridflow with async rollout on split pools (1 worker trains, 1 generates)")
    ap.add_argument("--compile", default="0", help="comma-separated 0 / 1: hybridflow rows without / with actor.use_torch_compile (compiled "
                    "decoder layers; the rows print dynamo's graph, graph-break and recompile counts and the first step's seconds)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE,...",
                    help="also a hybridflow row with these config overrides, named 'hybridflow LABEL' (repeatable), e.g. "
                    "sgo:actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false")
    ap.add_argument("--precision", default="fp32", help="comma-separated: fp32 and/or bf16 (hybridflow: fsdp_config.mixed_precision=bf16, "
                    "bf16 generation; TRL: bf16=True); each precision's MFU is against that dtype's measured peak")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from hybridflow.data.tasks import write_parquet
    from hybridflow.models.tiny import make_tiny_model
    from hybridflow.planning.arch import load_arch

    tmp = tempfile.mkdtemp(prefix="bench_e2e_")
    reward = os.path.join(tmp, "exact.py")
    with open(reward, "w") as f:
        f.write(REWARD)
    rows = arithmetic_rows(PROMPTS * (args.steps + 1))
    train = str(write_parquet(rows, os.path.join(tmp, "train.parquet")))
    models = {} if args.no_tiny and args.model else {"tiny": make_tiny_model(os.path.join(tmp, "tiny"), hidden_size=128, intermediate_size=256,
                                                                             num_hidden_layers=2)}
    if args.model:
        models[os.path.basename(os.path.normpath(args.model))] = args.model
    # This machine's matmul peak, measured now: hybridflow's 2 workers run 1 thread each, TRL one process with torch's threads.
    peaks = {(dt, th): matmul_peak(dt, th) for dt in (torch.float32, torch.bfloat16) for th in (1, torch.get_num_threads())}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    precisions = args.precision.split(",")
    hybridflow_peak, trl_peak = 2 * peaks[(torch.float32, 1)], peaks[(torch.float32, torch.get_num_threads())]
    print("matmul peak (GFLOP/s): " + ", ".join(f"{str(dt).split('.')[-1]} x {th} thread(s) {v / 1e9:.1f}" for (dt, th), v in peaks.items())
          + f"; this CPU: {bf16_units()} (the bf16 update MFU goal: 0.4 with AMX, 0.6 without)", flush=True)
    out = []
    for name, path in models.items():
        for prec in precisions:
            systems = [("hybridflow", lambda c=c: run_hybridflow(str(path), train, reward, os.path.join(tmp, f"hf_{name}_{prec}_{c}"), args.steps,
                                                                 precision=prec, compile=c == "1")) for c in args.compile.split(",")]
            for v in args.variant:
                label, _, sets = v.partition(":")
                systems.append(("hybridflow", lambda label=label, sets=sets: run_hybridflow(
                    str(path), train, reward, os.path.join(tmp, f"hf_{name}_{prec}_{label}"), args.steps, precision=prec,
                    variant=(label, [kv for kv in sets.split(",") if kv]))))
            if args.lora_rank:
                systems.append(("hybridflow+lora", lambda: run_hybridflow(str(path), train, reward, os.path.join(tmp, f"lora_{name}_{prec}"), args.steps,
                                                                          args.lora_rank, precision=prec)))
            if args.async_rollout:
                systems.append(("hybridflow async", lambda: run_hybridflow(str(path), train, reward, os.path.join(tmp, f"async_{name}_{prec}"), args.steps,
                                                                           precision=prec, split=True)))
            if not args.no_trl:
                systems.append(("trl", lambda: run_trl(str(path), rows, os.path.join(tmp, f"trl_{name}_{prec}"), args.steps, precision=prec)))
            for system, run in systems:
                t = time.perf_counter()
                row = {"model": name, "precision": prec, **run()}
                if system == "trl":  # one process on torch's threads
                    add_mfu(row, load_arch(str(path)), peaks[(dtypes[prec], torch.get_num_threads())])
                else:  # 2 workers x 1 thread; split pools train on one of them
                    one = peaks[(dtypes[prec], 1)]
                    add_mfu(row, load_arch(str(path)), 2 * one, update_peak=one if system == "hybridflow async" else None)
                print(f"{system} on {name} ({prec}): {row['step_seconds']:.2f} s/step ({time.perf_counter() - t:.0f} s)", flush=True)
                out.append(row)
    for name in models:
        for prec in precisions:
            trl = next((r for r in out if (r["model"], r["precision"], r["system"]) == (name, prec, "trl")), None)
            for r in out:
                if trl and (r["model"], r["precision"]) == (name, prec) and r is not trl:
                    r["vs_trl"] = r["step_seconds"] / trl["step_seconds"]
    for r in out:
        r.setdefault("vs_trl", float("nan"))
        for s in (*(f"timing_s/{s}" for s in STAGES), *LORA_KEYS, *(f"plan/{k}" for k in LORA_KEYS), "mfu/gen", "mfu/update", *COMPILE_KEYS,
                  "first_step_seconds"):
            r.setdefault(s, float("nan"))
        for k in (*LORA_KEYS, *(f"plan/{k}" for k in LORA_KEYS)):
            r[k] = r[k] / 2**20  # MiB
    columns = [("system", "system", "<19"), ("model", "model", "<14"), ("precision", "prec", "<5"), ("step_seconds", "step s", ">7.2f"),
               ("tokens_per_second", "tok/s", ">7.1f"), ("vs_trl", "vs TRL", ">7.2f")]
    columns += [(f"timing_s/{s}", s, f">{max(7, len(s))}.2f") for s in STAGES]
    # FLOPs per step (GFLOP) and the fraction of this machine's fp32 matmul peak reached (MFU)
    columns += [("gflop/gen", "GF gen", ">7.2f"), ("gflop/update", "GF upd", ">7.2f"), ("mfu/gen", "MFU gen", ">7.3f"),
                ("mfu/update", "MFU upd", ">7.3f"), ("mfu/step", "MFU step", ">8.3f")]
    # compiled rows: dynamo's graphs / graph breaks / recompiles on the workers, and the first (compiling) step's seconds
    columns += [("compile/graphs", "graphs", ">6.0f"), ("compile/graph_breaks", "breaks", ">6.0f"), ("compile/recompiles", "recomp", ">6.0f"),
                ("first_step_seconds", "1st step", ">8.1f")]
    # trainable state per rank (MiB): measured on the workers after the last step, and the planner's figure
    columns += [("param_bytes", "params", ">8.2f"), ("plan/param_bytes", "plan", ">8.2f"), ("grad_bytes", "grads", ">8.2f"),
                ("plan/grad_bytes", "plan", ">8.2f"), ("optimizer_bytes", "optim", ">8.2f"), ("plan/optimizer_bytes", "plan", ">8.2f")]
    print_rows("one GRPO step (8 prompts x 4 samples, 16 new tokens), median over the timed steps; trainable state per rank in MiB "
               f"(measured / the planner's); MFU against the row precision's matmul peak measured now (fp32: hybridflow 2 x 1 thread = "
               f"{hybridflow_peak / 1e9:.1f} GFLOP/s, TRL {torch.get_num_threads()} threads = {trl_peak / 1e9:.1f} GFLOP/s)", columns, out, args.json)


if __name__ == "__main__":
    main()
