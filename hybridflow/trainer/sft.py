"""SFT on the same FSDP2 actor worker: loss on response tokens only, HF checkpoint at the end.

The driver reads (prompt, response) rows, cycles through them in seeded shuffled batches of
`train_batch_size` sequences and calls `sft_step` on the worker group (each rank gets 1/N). The
workers are placed like the RL trainer's (`placement.py`): a reserved Ray pool of trainer.nnodes x
trainer.n_gpus_per_node, or the torchrun ranks with trainer.launcher=torchrun.
"""

from __future__ import annotations

import dataclasses
import os

from transformers import AutoTokenizer

from hybridflow.agent.sft_data import MultiTurnSFTDataset
from hybridflow.config import HybridFlowConfig, SFTConfig, validate_sft_config
from hybridflow.config.derive import derive_sft_defaults
from hybridflow.config.schema import DEFAULT_POOL, ActorConfig, ActorRolloutRefConfig, PoolSpec
from hybridflow.config.pools import ModelPart
from hybridflow.data.dataset import SFTDataset, collate_sft
from hybridflow.models.vlm import save_processor, sft_data as vlm_sft_data
from hybridflow.trainer.loader import PromptLoader
from hybridflow.trainer.placement import start_groups
from hybridflow.run_plan import resolve
from hybridflow.trainer.roles import policy_worker
from hybridflow.utils.tracking import Tracker


def _actor_config(cfg: SFTConfig) -> HybridFlowConfig:
    """The actor worker's view of an SFT run (model, optimizer, micro batch, clipping)."""
    actor = ActorConfig(ppo_micro_batch_size_per_gpu=cfg.micro_batch_size_per_gpu, grad_clip=cfg.grad_clip, optim=cfg.optim)
    return HybridFlowConfig(actor_rollout_ref=ActorRolloutRefConfig(model=cfg.model, actor=actor), trainer=cfg.trainer, ray_init=cfg.ray_init)


def run_sft(cfg: SFTConfig, log_every: int = 50, stop_after: int | None = None) -> dict:
    """Train ``cfg.total_steps`` steps (or only the first ``stop_after`` of that schedule: a check that a
    run reproduces its first losses) and save the HF checkpoint to ``cfg.save_dir``. Returns steps,
    losses (one per step), first_loss, final_loss, model_dir and the config."""
    cfg = derive_sft_defaults(cfg)  # an unset micro-batch from the workers (logged once)
    validate_sft_config(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_source())
    mt = cfg.multiturn
    images = None if mt.enable else vlm_sft_data(cfg.train_files, cfg.model.path, cfg.max_length, cfg.prompt_key, cfg.response_key)  # a VLM's rows
    dataset, collate = images or ((MultiTurnSFTDataset(cfg.train_files, tokenizer, cfg.max_length, mt.messages_key, mt.tools_key, mt.format)
                                   if mt.enable else SFTDataset(cfg.train_files, tokenizer, cfg.max_length, cfg.prompt_key, cfg.response_key)),
                                  collate_sft)
    loader = PromptLoader(dataset, cfg.train_batch_size, collate, shuffle=True, seed=cfg.trainer.seed)
    t = cfg.trainer
    worker = policy_worker(resolve(_actor_config(cfg)).actor, {ModelPart.ACTOR}, total_training_steps=cfg.total_steps)
    # trainer.launcher: Ray workers on a reserved pool, or this process as one torchrun rank.
    placed = start_groups(t, cfg.ray_init, {DEFAULT_POOL: PoolSpec(workers_per_node=t.n_gpus_per_node, nnodes=t.nnodes)},
                          lambda pool, procs_per_node: {"actor": worker}, name=lambda pool: f"sft_{os.getpid()}")
    main, tracker = placed.is_main, None
    try:
        tracker = Tracker([x for x in t.logger if x == "jsonl"] if main else [], t.log_dir or cfg.save_dir)
        wg = placed.groups[DEFAULT_POOL].role("actor")
        wg.init_model()
        losses = []
        for step in range(1, min(cfg.total_steps, stop_after or cfg.total_steps) + 1):
            metrics = wg.sft_step(loader.next_batch())
            losses.append(metrics["train/loss"])
            tracker.log(metrics, step=step)
            if main and "console" in t.logger and (step % log_every == 0 or step == cfg.total_steps):
                print(f"sft step {step:>4d}/{cfg.total_steps}  loss {metrics['train/loss']:.4f}  lr {metrics['train/lr']:.2e}", flush=True)
        wg.save_hf_model(os.path.abspath(cfg.save_dir))
        save_processor(cfg.model.path, os.path.abspath(cfg.save_dir))  # a VLM's image processor beside its weights
    finally:
        if tracker is not None:
            tracker.close()
        placed.shutdown()  # the workers, then the reserved pool (nothing to stop under torchrun)
    return {"steps": len(losses), "losses": losses, "first_loss": losses[0], "final_loss": losses[-1], "model_dir": cfg.save_dir,
            "config": dataclasses.asdict(cfg)}
