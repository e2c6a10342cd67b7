"""One GRPO step on one device without Ray (torchrun, world size 1): step time by stage, tokens/s, MFU.

    torchrun --standalone --nproc_per_node=1 bench/grpo_device.py --device cuda --json runs/gpu_check/grpo.json
    torchrun --standalone --nproc_per_node=1 bench/grpo_device.py --device cpu --tiny   # the CPU rehearsal (tiny shapes)
    python bench/grpo_device.py --print-plan [--tiny]                                    # shapes and step sizes only

The models are SmolLM2-135M- and Qwen2.5-0.5B-shaped (`planning.arch.PRESETS`: layers, widths, heads,
KV heads, vocabulary, tied embeddings) with random weights built from a config (no download: the
shapes are what step time and MFU need), and the character tokenizer: its 259 ids are a subset of the
vocabulary, sampled ids past it decode to nothing, so responses seldom end early and every step
generates about its full length. `--tiny`: two small shapes of the same families (the CPU rehearsal
of scripts/gpu_check.sh).

The step is the trainer's (`RLTrainer`, trainer.launcher=torchrun: the process is rank 0 of 1, NCCL
on a GPU, gloo on a CPU): P prompts x G samples (arithmetic prompts, the exact-answer reward), R new
tokens at temperature 1 from the HF rollout, bf16 compute over fp32 shards and bf16 generation
weights (fsdp_config.mixed_precision=bf16), the old log-probs recomputed (their own stage), one
update, and the switch (training shards -> generation weights, the hybrid engine) checked after every
step (trainer.check_weight_sync: every generation weight equals the trained one cast to bf16, bit for
bit, or the run stops). The first step warms up (kernels, allocator); the rows are medians of the rest.

Rows: model, parameters, step seconds, the stages' seconds (gen, log-probs, update, switch), generated
tokens per second, each stage's FLOPs (`flops.py`: generation with a KV cache, a forward for the
log-probs, 3 forwards for the update) over its seconds against the bf16 matmul peak measured first on
the same device (`flops.device_peak`), the switch's rate (bf16 generation weights written per second:
at world size 1 nothing crosses ranks, the switch casts and copies every weight on the device) and
its max |generation - trained| over every step (0.0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybridflow.planning.arch import PRESETS  # noqa: E402

SHAPES = {  # name -> its preset (the published config.json's numbers)
    "smollm2-135m": "smollm2-135m",
    "qwen2.5-0.5b": "qwen2.5-0.5b",
}
TINY = {  # the rehearsal's: the same families (llama, tied; qwen2 with q/k/v biases, tied), a few MB each
    "smollm2-135m": dict(arch="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=1024, tie_word_embeddings=True),
}
# (prompts, samples, new tokens, steps incl. the warm-up one, micro batch)
SIZES = {"full": (16, 8, 128, 4, 32), "tiny": (4, 4, 16, 2, 16)}
LR = 1e-6
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip().split("<")[0].strip() == str(ground_truth))
'''
STAGES = {"gen": "gen", "log_probs": "old_log_prob", "update": "update_actor", "switch": "reshard"}


def model_kwargs(name: str, tiny: bool) -> dict:
    """make_tiny_model's arguments for this shape."""
    if tiny:
        return dict(TINY[name])
    p = PRESETS[SHAPES[name]]
    return dict(arch=p["model_type"], hidden_size=p["hidden_size"], num_hidden_layers=p["num_hidden_layers"],
                num_attention_heads=p["num_attention_heads"], num_key_value_heads=p["num_key_value_heads"],
                intermediate_size=p["intermediate_size"], vocab_size=p["vocab_size"], tie_word_embeddings=p["tie_word_embeddings"],
                max_position_embeddings=2048)


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        answer = str(a + b)
        rows.append({"data_source": "arith", "prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}],
                     "reward_model": {"style": "rule", "ground_truth": answer}})
    return rows


def overrides(model: str, train: str, reward: str, out: str, device: str, size: str) -> list[str]:
    prompts, samples, new_tokens, steps, micro = SIZES[size]
    return [
        f"data.train_files=[{train}]", f"data.train_batch_size={prompts}", "data.max_prompt_length=96", f"data.max_response_length={new_tokens}",
        "data.prompt_padding=longest", f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.n={samples}",
        "actor_rollout_ref.rollout.temperature=1.0", f"actor_rollout_ref.actor.optim.lr={LR}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}", f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}", "actor_rollout_ref.actor.recompute_old_log_prob=true",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16", "algorithm.adv_estimator=grpo",
        f"custom_reward_function.path={reward}", f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.progress_bar=false", "trainer.logger=[jsonl]", f"trainer.default_local_dir={out}", f"trainer.device={device}",
        "trainer.launcher=torchrun", "trainer.n_gpus_per_node=1", "trainer.check_weight_sync=true", "trainer.save_freq=-1",
    ]


def run_model(name: str, path: str, train: str, reward: str, out: str, device: str, size: str) -> dict:
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.trainer.rl import RLTrainer

    trainer = RLTrainer(load_config(None, overrides(path, train, reward, out, device, size), schema=HybridFlowConfig))
    try:
        hist = [h for h in trainer.fit()["history"] if h["step"] > 0]
    finally:
        trainer.shutdown()
    timed = hist[1:] or hist  # the first step warms up
    med = {k: statistics.median(h[k] for h in timed) for k in timed[0] if isinstance(timed[0][k], (int, float))}
    prompts, samples, _, _, _ = SIZES[size]
    row = {"model": name, "step_s": med["timing_s/step"], "prompt_len": med["prompt_length/mean"], "response_len": med["response_length/mean"],
           "sequences": prompts * samples,
           "switch_max_diff": max(h.get("reshard/weight_max_diff", float("nan")) for h in hist), "steps_timed": len(timed)}
    for key, stage in STAGES.items():
        row[f"{key}_s"] = med.get(f"timing_s/{stage}", float("nan"))
    row["tok_s"] = row["response_len"] * row["sequences"] / row["step_s"]
    return row


def add_mfu(row: dict, arch, peak: float) -> None:
    from flops import forward_flops, generation_flops

    n, p, r = row["sequences"], round(row["prompt_len"]), round(row["response_len"])
    fwd = forward_flops(arch, [p + r] * n, logits=[r] * n)  # the head projects the response positions only
    flops = {"gen": generation_flops(arch, [p] * n, [r] * n), "log_probs": fwd, "update": 3 * fwd}
    for key, f in flops.items():
        row[f"mfu_{key}"] = f / row[f"{key}_s"] / peak
    row["mfu_step"] = sum(flops.values()) / row["step_s"] / peak
    row["gflop_step"] = sum(flops.values()) / 1e9


COLUMNS = [("model", "model", "<13"), ("params_m", "params M", ">8.1f"), ("step_s", "step s", ">7.3f"), ("gen_s", "gen s", ">7.3f"),
           ("log_probs_s", "logp s", ">7.3f"), ("update_s", "update s", ">8.3f"), ("switch_s", "switch s", ">8.4f"), ("tok_s", "tok/s", ">8.1f"),
           ("mfu_gen", "MFU gen", ">7.4f"), ("mfu_log_probs", "MFU logp", ">8.4f"), ("mfu_update", "MFU upd", ">7.4f"), ("mfu_step", "MFU step", ">8.4f"),
           ("switch_gbs", "switch GB/s", ">11.1f"), ("switch_max_diff", "max diff", ">8.3g")]


def print_plan(tiny: bool) -> None:
    prompts, samples, new_tokens, steps, micro = SIZES["tiny" if tiny else "full"]
    print(f"GRPO step: {prompts} prompts x {samples} samples, {new_tokens} new tokens, {steps} steps (1 warm-up), micro batch {micro}, "
          f"bf16 mixed precision, old log-probs recomputed, switch checked bit-exact")
    for name in SHAPES:
        kw = model_kwargs(name, tiny)
        print(f"  {name:<13} {kw['arch']}: hidden {kw['hidden_size']}, {kw['num_hidden_layers']} layers, {kw['num_attention_heads']} heads "
              f"/ {kw['num_key_value_heads']} KV, intermediate {kw['intermediate_size']}, vocab {kw['vocab_size']}, tied {kw['tie_word_embeddings']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--tiny", action="store_true", help="small shapes and steps (the CPU rehearsal)")
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--print-plan", action="store_true", help="print the shapes and step sizes, run nothing")
    a = ap.parse_args()
    if a.print_plan:
        print_plan(a.tiny)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch.distributed as dist

    from flops import device_peak
    from hybridflow.data.tasks import write_parquet
    from hybridflow.models.tiny import make_tiny_model
    from hybridflow.parallel.process_group import init_torchrun
    from hybridflow.planning.arch import load_arch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = "tiny" if a.tiny else "full"
    init_torchrun(device, 600)  # the trainer joins this group (trainer.launcher=torchrun)
    where = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}" if device == "cuda"
             else f"CPU ({torch.get_num_threads()} threads), torch {torch.__version__}")
    peak = device_peak(torch.bfloat16, device, torch.get_num_threads())
    print(f"{where}\nbf16 matmul peak (measured now): {peak / 1e12:.3f} TFLOP/s", flush=True)
    print_plan(a.tiny)
    tmp = tempfile.mkdtemp(prefix="grpo_device_")
    reward = os.path.join(tmp, "exact.py")
    with open(reward, "w") as f:
        f.write(REWARD)
    prompts, _, _, steps, _ = SIZES[size]
    train = str(write_parquet(arithmetic_rows(prompts * (steps + 1)), os.path.join(tmp, "train.parquet")))
    rows = []
    for name in a.models.split(","):
        t = time.perf_counter()
        path = make_tiny_model(os.path.join(tmp, name), **model_kwargs(name, a.tiny))
        arch = load_arch(str(path))
        row = run_model(name, str(path), train, reward, os.path.join(tmp, f"run_{name}"), device, size)
        row["params_m"] = arch.num_params() / 1e6
        row["switch_gbs"] = 2 * arch.num_params() / row["switch_s"] / 1e9  # bf16 generation weights written per second
        add_mfu(row, arch, peak)
        row.update(device=where, backend=dist.get_backend(), peak_tflops=peak / 1e12)
        print(f"{name}: {row['step_s']:.3f} s/step ({time.perf_counter() - t:.0f} s with model build)", flush=True)
        rows.append(row)
    title = (f"GRPO step, torchrun world size 1 on {where}: {SIZES[size][0]} prompts x {SIZES[size][1]} samples, {SIZES[size][2]} new tokens, "
             f"bf16; median of {rows[0]['steps_timed']} timed step(s); MFU against the bf16 matmul peak {peak / 1e12:.3f} TFLOP/s measured now")
    print(f"\n{title}")
    import re

    print(" ".join(f"{h:{re.match(r'[<>^]?[0-9]*', s).group()}}" for _, h, s in COLUMNS))
    for r in rows:
        print(" ".join(f"{r[k]:{s}}" for k, _, s in COLUMNS))
    ok = all(r["switch_max_diff"] == 0.0 for r in rows)
    print(f"switch bit-exact with the trainer's weights after every step: {'yes' if ok else 'no'}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
