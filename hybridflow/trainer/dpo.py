"""DPO on the RL trainer's workers and DataFlow: offline (preference parquet) and online.

    trainer = DPOTrainer(cfg)   # `hybridflow dpo CONFIG`; validates before any worker starts
    summary = trainer.fit()     # checkpoints, resume, validation and logging as RLTrainer

Offline, one step is a DataFlow over a pair batch (chosen and rejected interleaved, 2P rows):
    ref (reference sequence log-probs, or the cached ones) -> update_actor (DPO loss)
The rollout (hybrid engine) is only resharded before validation, which generates greedily on
data.val_files and scores with the rule scorer, like RL.

Online (`dpo.online=true`), a step is two DataFlows with the pairing between them:
    sample: gen (n >= 2 samples per prompt) -> rm (reward model, if enabled) -> reward
    pair (driver): per prompt, the best and the worst sample by reward; a tie gives pair_weight 0
    update: ref -> update_actor -> reshard (the next step samples from the updated policy)
"""

from __future__ import annotations

import time

import torch

from hybridflow.config.pools import Role
from hybridflow.data.preference import PreferenceDataset, collate_pairs
from hybridflow.protocol import Batch
from hybridflow.trainer.dataflow import DataFlow, Stage
from hybridflow.trainer.rl import GEN_OUTPUTS, PROMPT_KEYS, TRAIN_KEYS, RLTrainer
from hybridflow.utils.tracking import DPO_CONSOLE_COLUMNS

PAIR_KEYS = TRAIN_KEYS + ["pair_weight"]


def best_vs_worst(samples: Batch, n: int) -> tuple[Batch, dict[str, float]]:
    """n samples per prompt (consecutive rows sharing a uid) -> one pair per prompt: the best and
    the worst sample by summed reward (the first of equals), pair_weight 0 when they tie (nothing
    to prefer). Returns the pair batch (2B rows: c0, r0, c1, r1, ...) and reward metrics."""
    seq = samples["token_level_scores"].sum(-1)
    scores = seq.view(-1, n)  # [B, n]
    uids = samples["uid"].reshape(-1, n)
    if not (uids == uids[:, :1]).all():
        raise ValueError("online DPO: the n samples of a prompt must be consecutive rows with one uid")
    best, worst = scores.argmax(1), scores.argmin(1)
    base = torch.arange(len(scores)) * n
    pairs = samples.index(torch.stack([base + best, base + worst], 1).reshape(-1)).select(TRAIN_KEYS)
    valid = (scores.gather(1, best[:, None]) > scores.gather(1, worst[:, None])).squeeze(1).float()
    pairs["pair_weight"] = valid.repeat_interleave(2)
    return pairs, {"critic/score/mean": float(seq.mean()), "critic/score/max": float(seq.max()), "critic/score/min": float(seq.min()),
                   "dpo/tie_fraction": 1.0 - float(valid.mean())}


class DPOTrainer(RLTrainer):
    KIND = "dpo"  # validate_config's DPO checks; the roles are dpo_roles (trainer/roles.py)
    CONSOLE_COLUMNS = DPO_CONSOLE_COLUMNS

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.online = cfg.dpo.online
        self.ref_cache: torch.Tensor | None = None  # [N, 2] (chosen, rejected) per dataset row, precompute_ref_log_probs
        self.sample_flow: DataFlow | None = None

    def _train_data(self):
        if self.cfg.dpo.online:  # prompts, sampled from every step
            return super()._train_data()
        d = self.cfg.data
        ds = PreferenceDataset(d.train_files, self.tokenizer, d.max_prompt_length, d.max_response_length, d.prompt_key, d.chosen_key, d.rejected_key)
        return ds, lambda items: collate_pairs(items, self.tokenizer.pad_token_id, d.max_prompt_length, d.max_response_length)

    # ------------------------------------------------------------------ stages
    def _cached_ref(self, batch: Batch) -> Batch:
        """The precomputed reference log-probs of these pairs (rows interleaved like the batch)."""
        rows = torch.as_tensor([int(i) for i in batch["index"][0::2]])
        return Batch.from_dict(tensors={"ref_seq_log_prob": self.ref_cache[rows].reshape(-1)})

    def build_dataflow(self) -> DataFlow:
        ref = Stage("ref", self._cached_ref if self.ref_cache is not None else self.ref.compute_ref_seq_log_prob,
                    TRAIN_KEYS + (["index"] if self.ref_cache is not None else []), ["ref_seq_log_prob"])
        update = Stage("update_actor", self.actor.update_dpo, PAIR_KEYS + ["ref_seq_log_prob"], [])
        if not self.online:
            return DataFlow([ref, update])
        actor_pool = self.pool_of(Role.ACTOR_ROLLOUT)
        self.sample_flow = DataFlow([Stage("gen", self._generate, PROMPT_KEYS, GEN_OUTPUTS, pool=actor_pool), *self._reward_stages()])
        self.sample_flow.check(super()._prepare_batch_keys())
        return DataFlow([ref, update, Stage("reshard", self.weight_sync.reshard, [], [], pool=actor_pool)])

    # ------------------------------------------------------------------ loop
    def _prepare_batch(self) -> Batch:
        return super()._prepare_batch() if self.online else self.loader.next_batch()

    def _prepare_batch_keys(self) -> list[str]:
        """The keys the update flow starts with (online: the pairing's output)."""
        return PAIR_KEYS + ([] if self.online else ["index"])

    def train_step(self, flow: DataFlow) -> dict[str, float]:
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.online:
            samples, m = self.sample_flow.run(self._prepare_batch())
            batch, pair_metrics = best_vs_worst(samples, self.run_plan.rollout.rollout.n)
            metrics.update(m, **pair_metrics)
        else:
            batch = self._prepare_batch()
        batch, m = flow.run(batch)
        metrics.update(m)
        if self.weight_sync.pending is not None:  # hybrid_engine.resharding_overlap_with_compute
            metrics.update(self.weight_sync.finish())
        metrics["timing_s/step"] = time.perf_counter() - start
        metrics["dpo/pairs"] = float(batch["pair_weight"][0::2].sum())
        return metrics

    def validate(self) -> dict[str, float]:
        if not self.online and self.val_ds is not None:  # offline: the rollout is synced only to validate
            self.actor.reshard()
        return super().validate()

    # ------------------------------------------------------------------ reference cache
    def _before_training(self) -> None:
        if not self.cfg.dpo.precompute_ref_log_probs or self.ref_cache is not None:
            return
        if self.global_step:
            raise RuntimeError("resumed a DPO run with dpo.precompute_ref_log_probs but its checkpoint holds no reference cache")
        # The untrained policy IS the reference: score every pair once, before the first update.
        ds, cache = self.train_ds, torch.zeros(len(self.train_ds), 2)
        size = self.cfg.data.train_batch_size
        for start in range(0, len(ds), size):
            items = [ds[i] for i in range(start, min(start + size, len(ds)))]
            out = self.actor.compute_ref_seq_log_prob(self.loader.collate(items))
            cache[start:start + len(items)] = out["ref_seq_log_prob"].view(-1, 2)
        self.ref_cache = cache

    def _cache_key(self) -> dict:
        """What the cached log-probs depend on: the rows and sums vs means (IPO)."""
        return {"rows": len(self.train_ds), "average": self.cfg.dpo.loss_type == "ipo"}

    def _extra_state(self) -> dict:
        return {"ref_cache": self.ref_cache, "ref_cache_key": self._cache_key()} if self.ref_cache is not None else {}

    def _load_extra_state(self, state: dict) -> None:
        if not self.cfg.dpo.precompute_ref_log_probs or "ref_cache" not in state:
            return
        if state.get("ref_cache_key") != self._cache_key():
            raise RuntimeError(f"the checkpoint's reference cache was computed for {state.get('ref_cache_key')}, this run has "
                               f"{self._cache_key()} (data.train_files or dpo.loss_type changed); start a new run directory")
        self.ref_cache = state["ref_cache"]
