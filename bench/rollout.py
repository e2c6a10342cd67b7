"""Rollout backends side by side: HF `generate` vs vLLM, in the same 2 actor workers.

For each backend it starts the real worker group (FSDP2 actor + rollout, colocated), times the
first weight sync from the training shards into the rollout engine (`sync_seconds`), then
generates the same prompts with the same sampling settings and reports generated tokens per
second (all workers together; prompts are split over them). The model is a randomly initialised
tiny Qwen2 (its answers run to the token limit, so both backends generate the same lengths).

Run (vLLM on CPU lives in its own venv):
    bash scripts/bootstrap_vllm.sh
    .venv-vllm/bin/python bench/rollout.py --json runs/bench_rollout.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from common import print_rows



def overrides(name: str, model_dir, data_dir, out_dir, max_tokens: int) -> list[str]:
    return [
        f"data.train_files=[{data_dir}/train.parquet]", "data.train_batch_size=4", "data.max_prompt_length=32",
        f"data.max_response_length={max_tokens}", f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.n=2", f"actor_rollout_ref.rollout.name={name}", "trainer.progress_bar=false",
        "trainer.logger=[]", f"trainer.default_local_dir={out_dir}",
    ]


def run_backend(name: str, model_dir, data_dir, out_dir, prompts: int, max_tokens: int, repeats: int) -> dict:
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.trainer.rl import PROMPT_KEYS, RLTrainer

    cfg = load_config(None, overrides(name, model_dir, data_dir, out_dir, max_tokens), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        trainer.init_workers()
        sync = max(r["seconds"] for r in trainer.actor.reshard())
        batch = trainer.collate([trainer.train_ds[i % len(trainer.train_ds)] for i in range(prompts)])
        params = trainer._sampling()  # temperature 1.0 sampling
        trainer.actor.generate_sequences(batch.select(PROMPT_KEYS), params)  # warm-up
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = trainer.actor.generate_sequences(batch.select(PROMPT_KEYS), params)
            seconds = time.perf_counter() - start
            rates.append(float(out["response_mask"].sum()) / seconds)
        return {"backend": name, "tokens_per_second": sorted(rates)[len(rates) // 2], "sync_seconds": sync,
                "prompts": prompts, "max_new_tokens": max_tokens, "mean_response_tokens": float(out["response_mask"].sum(-1).float().mean())}
    finally:
        trainer.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default="hf,vllm")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from hybridflow.controller.worker_group import init_ray
    from hybridflow.data.tasks import make_max_task
    from hybridflow.models.tiny import make_tiny_model

    tmp = tempfile.mkdtemp(prefix="bench_rollout_")
    model = make_tiny_model(os.path.join(tmp, "model"), hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    make_max_task(os.path.join(tmp, "data"))
    init_ray(num_cpus=2)
    rows = [run_backend(b, model, os.path.join(tmp, "data"), os.path.join(tmp, b), args.prompts, args.max_tokens,
                        args.repeats) for b in args.backends.split(",")]

    print_rows(f"{args.prompts} prompts, up to {args.max_tokens} new tokens, temperature 1.0, 2 workers, fp32 tiny Qwen2 (0.36M params)",
               [("backend", "backend", "<8"), ("tokens_per_second", "tokens/s", ">10.1f"), ("sync_seconds", "sync s", ">8.3f"),
                ("mean_response_tokens", "mean resp len", ">14.1f")], rows, args.json)

if __name__ == "__main__":
    main()
