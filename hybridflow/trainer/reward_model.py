"""Reward-model training (`hybridflow rm`): Bradley-Terry on preference pairs, FSDP2 workers.

The driver tokenizes pairs with the RM's own tokenizer and chat template, cycles through seeded
shuffled batches of `train_batch_size` pairs (each worker gets whole pairs) and calls `update_rm`;
every `trainer.test_freq` steps and at the end it scores the held-out pairs (`val_files`) and
reports their pairwise accuracy (chosen scored above rejected). The result is an HF sequence
classifier in `save_dir`, ready for `reward_model.model.path`. The workers are placed like the RL
trainer's (`placement.py`): a reserved Ray pool `rm_pool` of trainer.nnodes x
trainer.n_gpus_per_node, or the torchrun ranks with trainer.launcher=torchrun.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoTokenizer

from hybridflow.config import RewardTrainConfig, validate_rm_config
from hybridflow.config.derive import derive_rm_defaults
from hybridflow.config.schema import PoolSpec
from hybridflow.data.preference import PreferenceDataset, collate_pairs
from hybridflow.run_plan import RewardModelSpec
from hybridflow.trainer.loader import PromptLoader
from hybridflow.trainer.placement import start_groups
from hybridflow.utils.tracking import Tracker


def pair_accuracy(scores: torch.Tensor) -> float:
    """scores [2P], chosen and rejected interleaved -> share of pairs with chosen > rejected."""
    return float((scores[0::2] > scores[1::2]).float().mean())


def run_rm(cfg: RewardTrainConfig, log_every: int = 25) -> dict:
    cfg = derive_rm_defaults(cfg)  # an unset micro-batch from the workers (logged once)
    validate_rm_config(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_source())
    P, R = cfg.max_prompt_length, cfg.max_response_length

    def dataset(files):
        return PreferenceDataset(files, tokenizer, P, R, cfg.prompt_key, cfg.chosen_key, cfg.rejected_key)

    collate = lambda items: collate_pairs(items, tokenizer.pad_token_id, P, R)  # noqa: E731
    train = dataset(cfg.train_files)
    val = collate(list(dataset(cfg.val_files))) if cfg.val_files else None
    loader = PromptLoader(train, cfg.train_batch_size, collate, shuffle=True, seed=cfg.trainer.seed)
    t = cfg.trainer
    from hybridflow.workers.reward_model import RewardModelWorker

    worker = (RewardModelWorker, {"spec": RewardModelSpec.for_training(cfg), "total_training_steps": cfg.total_steps})
    # trainer.launcher: Ray workers on a reserved pool, or this process as one torchrun rank.
    placed = start_groups(t, cfg.ray_init, {"rm_pool": PoolSpec(workers_per_node=t.n_gpus_per_node, nnodes=t.nnodes)},
                          lambda pool, procs_per_node: {"reward_model": worker}, name=lambda pool: f"rm_{os.getpid()}")
    main, tracker, wg = placed.is_main, None, placed.groups["rm_pool"].role("reward_model")

    def validate() -> dict[str, float]:
        return {"val/pair_acc": pair_accuracy(wg.score_sequences(val)["scores"])} if val is not None else {}

    curve = []
    try:
        tracker = Tracker([x for x in t.logger if x == "jsonl"] if main else [], t.log_dir or cfg.save_dir)
        wg.init_model()
        first = validate()
        if first:
            curve.append((0, first["val/pair_acc"]))
        losses = []
        for step in range(1, cfg.total_steps + 1):
            metrics = wg.update_rm(loader.next_batch())
            losses.append(metrics["train/loss"])
            last = step == cfg.total_steps
            if val is not None and (last or (t.test_freq > 0 and step % t.test_freq == 0)):
                metrics.update(validate())
                curve.append((step, metrics["val/pair_acc"]))
            tracker.log(metrics, step=step)
            if main and "console" in t.logger and (step % log_every == 0 or last):
                acc = f"  val pair acc {metrics['val/pair_acc']:.3f}" if "val/pair_acc" in metrics else ""
                print(f"rm step {step:>4d}/{cfg.total_steps}  loss {metrics['train/loss']:.4f}  train acc {metrics['train/accuracy']:.3f}{acc}", flush=True)
        wg.save_hf_model(os.path.abspath(cfg.save_dir))
    finally:  # whatever failed, no worker or reserved slot outlives the run
        if tracker is not None:
            tracker.close()
        placed.shutdown()
    return {"steps": cfg.total_steps, "first_loss": losses[0], "final_loss": losses[-1], "val_pair_acc": curve[-1][1] if curve else None,
            "val_curve": curve, "model_dir": cfg.save_dir}
