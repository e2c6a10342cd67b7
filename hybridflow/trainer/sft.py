"""SFT on the same FSDP2 actor worker: loss on response tokens only, HF checkpoint at the end.

The driver reads (prompt, response) rows, cycles through them in seeded shuffled batches of
`train_batch_size` sequences and calls `sft_step` on the worker group (each rank gets 1/N).
"""

from __future__ import annotations

import dataclasses
import os

from transformers import AutoTokenizer

from hybridflow.config import HybridFlowConfig, SFTConfig, validate_sft_config
from hybridflow.config.schema import ActorConfig, ActorRolloutRefConfig
from hybridflow.controller.worker_group import RayWorkerGroup, ResourcePool, init_ray
from hybridflow.data.dataset import SFTDataset, collate_sft
from hybridflow.trainer.loader import PromptLoader
from hybridflow.utils.tracking import Tracker


def _actor_config(cfg: SFTConfig) -> HybridFlowConfig:
    """The actor worker's view of an SFT run (model, optimizer, micro batch, clipping)."""
    actor = ActorConfig(ppo_micro_batch_size_per_gpu=cfg.micro_batch_size_per_gpu, grad_clip=cfg.grad_clip, optim=cfg.optim)
    return HybridFlowConfig(actor_rollout_ref=ActorRolloutRefConfig(model=cfg.model, actor=actor), trainer=cfg.trainer, ray_init=cfg.ray_init)


def run_sft(cfg: SFTConfig, log_every: int = 50) -> dict:
    validate_sft_config(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    dataset = SFTDataset(cfg.train_files, tokenizer, cfg.max_length, cfg.prompt_key, cfg.response_key)
    loader = PromptLoader(dataset, cfg.train_batch_size, collate_sft, shuffle=True, seed=cfg.trainer.seed)
    t = cfg.trainer
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker

    kwargs = {"config": _actor_config(cfg), "role": "actor", "total_training_steps": cfg.total_steps}
    main = True
    if t.launcher == "torchrun":  # this process is one rank (see controller/local_group.py)
        from hybridflow.controller.local_group import LocalColocatedGroup, init_torchrun
        from hybridflow.controller.worker import pick_device

        rank, _ = init_torchrun(pick_device(t.device), t.collective_timeout_s)
        pool, main = None, rank == 0
        wg = LocalColocatedGroup({"actor": (ActorRolloutRefWorker, kwargs)}).role("actor")
    else:
        init_ray(cfg.ray_init.address, cfg.ray_init.num_cpus)
        pool = ResourcePool(t.nnodes, t.n_gpus_per_node, cfg.ray_init.cpus_per_worker)
        wg = RayWorkerGroup(pool, ActorRolloutRefWorker, name=f"sft_{os.getpid()}", worker_env=t.worker_env, **kwargs)
    tracker = Tracker([x for x in t.logger if x == "jsonl"] if main else [], t.log_dir or cfg.save_dir)
    try:
        wg.init_model()
        losses = []
        for step in range(1, cfg.total_steps + 1):
            metrics = wg.sft_step(loader.next_batch())
            losses.append(metrics["train/loss"])
            tracker.log(metrics, step=step)
            if main and "console" in t.logger and (step % log_every == 0 or step == cfg.total_steps):
                print(f"sft step {step:>4d}/{cfg.total_steps}  loss {metrics['train/loss']:.4f}  lr {metrics['train/lr']:.2e}", flush=True)
        wg.save_hf_model(os.path.abspath(cfg.save_dir))
    finally:
        tracker.close()
        if pool is not None:
            wg.shutdown()
            pool.release()
    return {"steps": cfg.total_steps, "first_loss": losses[0], "final_loss": losses[-1], "model_dir": cfg.save_dir, "config": dataclasses.asdict(cfg)}
