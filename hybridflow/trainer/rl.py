"""The RL trainer (PPO, GRPO, RLOO, REINFORCE++, ReMax): a driver that runs a DataFlow.

    trainer = RLTrainer(cfg)        # validates the config and loads data before any worker starts
    trainer.init_workers()          # Ray cluster, one worker group per resource pool, roles placed by the mapping
    summary = trainer.fit()

One step (see `build_dataflow`):
    gen -> reward -> old_log_prob -> ref -> values -> adv -> update_critic -> update_actor -> reshard
Stages that the algorithm does not need are disabled (no critic for GRPO, no ref without KL). The
DataFlow scheduler runs stages of disjoint pools concurrently (values on the critic pool while the
actor pool computes log-probs; both updates together) and driver stages alongside worker stages.

Async rollout (trainer.async_rollout, the rollout on its own pool): generation of batch k+1 runs on
the rollout pool while the trainer updates on batch k; after the update the actor's pool publishes
exactly the pieces each generation rank needs (`hybrid_engine/cross_pool.py`). One-step off-policy:
the PPO ratio's old log-probs are the rollout policy's (`rollout_log_probs`), and
`rollout/staleness` = policy versions between generation and update (0 on the first step, then 1).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import sys
import time
from collections import defaultdict

import numpy as np
import torch
from transformers import AutoTokenizer

from hybridflow import profiler
from hybridflow.algorithms import get_adv_estimator, make_kl_controller, apply_kl_penalty, masked_mean
from hybridflow.config import ConfigError, HybridFlowConfig, save_config, to_dict, validate_config
from hybridflow.planning.preflight import check_memory
from hybridflow.controller.resource_pool import Role, pool_specs, role_pools
from hybridflow.controller.worker import pick_device
from hybridflow.controller.worker_group import ColocatedWorkerGroup, ResourcePool, init_ray, place_pools
from hybridflow.data.dataset import RLDataset, collate_rl
from hybridflow.protocol import Batch
from hybridflow.rewards.loader import load_custom_reward_fn
from hybridflow.rewards.manager import RewardManager
from hybridflow.rollout.base import SamplingParams
from hybridflow.trainer.dataflow import DataFlow, Stage
from hybridflow.trainer.loader import PromptLoader
from hybridflow.trainer.metrics import compute_data_metrics
from hybridflow.utils.tracking import CONSOLE_COLUMNS, Tracker

logger = logging.getLogger("hybridflow")

PROMPT_KEYS = ["input_ids", "attention_mask", "position_ids"]
SAMPLE_INFO_KEYS = ["data_source", "reward_model", "extra_info", "raw_prompt"]
REWARD_KEYS = ["responses", "response_mask"] + SAMPLE_INFO_KEYS
GEN_OUTPUTS = ["prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids", "rollout_log_probs"]
TRAIN_KEYS = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]
LATEST = "latest_checkpointed_iteration.txt"


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a nan/inf loss (trainer.max_nonfinite_steps)."""


class RLTrainer:
    KIND = "rl"  # which checks `validate_config` runs (`trainer/dpo.py` sets "dpo")
    CONSOLE_COLUMNS = CONSOLE_COLUMNS

    def __init__(self, cfg: HybridFlowConfig, parallel_config: str | dict | ParallelConfig | None = None, **engine_kwargs):
        """parallel_config: a parallel config file, a dict of its keys or a ParallelConfig, mapped
        onto `cfg` (only the keys it sets); engine_kwargs: hybrid-engine switches
        (enable_resharding_opt, resharding_overlap_with_compute, granularity). Both are applied
        before validation."""
        from hybridflow.config.parallel import apply_engine_kwargs, apply_parallel_config, as_parallel_config

        if parallel_config is not None:
            cfg = apply_parallel_config(cfg, as_parallel_config(parallel_config))
        if engine_kwargs:
            cfg = apply_engine_kwargs(cfg, **engine_kwargs)
        validate_config(cfg, self.KIND)  # before any worker (or Ray) starts
        self.cfg = cfg
        check_memory(cfg, self._roles())  # the estimated peak per worker fits the device (planning/preflight.py)
        mcfg = cfg.actor_rollout_ref.model
        self.tokenizer = AutoTokenizer.from_pretrained(mcfg.tokenizer_path or mcfg.path)
        d = cfg.data
        self.val_ds = RLDataset(d.val_files, self.tokenizer, d.max_prompt_length, d.prompt_key, d.filter_overlong_prompts, d.truncation) if d.val_files else None
        self.collate = lambda items: collate_rl(items, self.tokenizer.pad_token_id, d.max_prompt_length, d.prompt_padding)
        self.train_ds, train_collate = self._train_data()
        self.loader = PromptLoader(self.train_ds, d.train_batch_size, train_collate, d.shuffle, d.seed)
        self.total_steps = cfg.trainer.total_training_steps or self.loader.batches_per_epoch * cfg.trainer.total_epochs
        crf = cfg.custom_reward_function
        self.reward_fn = RewardManager(self.tokenizer, load_custom_reward_fn(crf.path, crf.name), timeout_s=crf.timeout_s)
        self._check_scorers()
        a = cfg.algorithm
        self.use_critic = a.adv_estimator == "gae"
        self.use_ref = cfg.actor_rollout_ref.actor.use_kl_loss or a.use_kl_in_reward
        self.kl_ctrl = make_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl, a.kl_ctrl.horizon)
        self.global_step = 0
        self.log_dir = cfg.trainer.log_dir or cfg.trainer.default_local_dir
        self.async_rollout = cfg.trainer.async_rollout
        self.torchrun = cfg.trainer.launcher == "torchrun"
        self.role_pool = role_pools(cfg, self._roles())
        self.use_rm = Role.REWARD_MODEL in self.role_pool
        self.groups: dict[str, ColocatedWorkerGroup] = {}
        self.pools: dict[str, ResourcePool] = {}
        self.wg = None
        self._gen_pending = None  # async rollout: the next batch's generation, in flight
        self._gen_version = 0  # async rollout: policy version of the weights the rollout pool holds
        self._reshard_logged = False
        self._pending_reshard = None
        self._next_batch: Batch | None = None  # prepared while the workers reshard (overlap mode)
        self._loader_state_at_prefetch: dict | None = None

    def _train_data(self):
        """The training dataset and its collate function (RL: prompts)."""
        d = self.cfg.data
        return RLDataset(d.train_files, self.tokenizer, d.max_prompt_length, d.prompt_key, d.filter_overlong_prompts, d.truncation), self.collate

    def _check_scorers(self) -> None:
        """Every data_source the rule reward will see has a scorer: checked on the data before any
        worker starts (a built-in scorer raises NotImplementedError for an unknown one)."""
        if self.cfg.custom_reward_function.path:
            return
        datasets = [ds for ds in (self.train_ds, self.val_ds) if isinstance(ds, RLDataset)]
        sources = {item["data_source"]: item["reward_model"]["ground_truth"] for ds in datasets for item in ds.items}
        for source, truth in sources.items():
            try:
                self.reward_fn.compute_score(data_source=source, solution_str="", ground_truth=truth, extra_info=None)
            except NotImplementedError as e:
                raise ConfigError(f"data: {e}") from None

    def _roles(self) -> list[Role] | None:
        """The roles to place (None: `active_roles` of the config)."""
        return None

    # ------------------------------------------------------------------ workers
    def init_workers(self) -> None:
        """Start Ray, check the pools against the cluster, then one worker group per pool holding
        the roles mapped to it (colocated in one process per rank)."""
        if self.cfg.trainer.check_weight_sync and self.cfg.actor_rollout_ref.rollout.name == "vllm":
            logger.warning("trainer.check_weight_sync compares generation buffers with the trained weights on the hf "
                           "backend; vLLM repacks its weights, so with vllm the check is rollout/logprob_diff_max")
        t, ri = self.cfg.trainer, self.cfg.ray_init
        device = pick_device(t.device)
        if self.torchrun:  # every rank is a worker of the one pool, in this process
            from hybridflow.controller.local_group import LocalColocatedGroup, init_torchrun

            _, world = init_torchrun(device, t.collective_timeout_s)
            if world != t.nnodes * t.n_gpus_per_node:
                raise ConfigError(f"torchrun started {world} processes but trainer.nnodes * trainer.n_gpus_per_node = "
                                  f"{t.nnodes} * {t.n_gpus_per_node}; make them equal (--nnodes / --nproc_per_node)")
            name = self.role_pool[Role.ACTOR_ROLLOUT]
            # torchrun numbers the ranks of a node consecutively, n_gpus_per_node of them (checked above)
            self.groups[name] = LocalColocatedGroup(self._role_classes(list(self.role_pool), t.n_gpus_per_node), name=name)
        else:
            init_ray(ri.address, ri.num_cpus, ri.resources or None)
            specs = pool_specs(self.cfg)
            # Checked against the cluster before any placement group or worker: never a hang.
            self.pools = place_pools({name: specs[name] for name in dict.fromkeys(self.role_pool.values())}, ri.cpus_per_worker, device)
        for name, pool in self.pools.items():
            classes = self._role_classes([r for r, p in self.role_pool.items() if p == name], pool.procs_per_node)
            try:
                self.groups[name] = ColocatedWorkerGroup(pool, classes, name=f"{t.experiment_name}_{name}_{os.getpid()}", device=device,
                                                         worker_env=t.worker_env, straggler_timeout_s=t.collective_timeout_s)
            except BaseException:
                self.shutdown()  # release every pool and the groups already started
                raise
        self.wg = self.groups[self.role_pool[Role.ACTOR_ROLLOUT]]
        views = {role: g.role(role) for g in self.groups.values() for role in g.role_classes}
        self.actor = views["actor"]
        self.ref = views.get("ref", self.actor) if Role.REF in self.role_pool else None
        self.rollout = views["rollout"] if self.async_rollout else self.actor
        self.critic = views.get("critic")
        self.rm = views.get("reward_model")
        # Pools start their models at the same time.
        pending = [v.submit("init_model") for v in views.values()]
        for p in pending:
            p.result()
        self.plan_summary = None if self.async_rollout else self.actor.reshard_plan()

    def _role_classes(self, roles: list[Role], procs_per_node: int) -> dict[str, tuple[type, dict]]:
        """The worker classes (and their arguments) that hold `roles` in one process; procs_per_node:
        the pool's ranks per node (consecutive), the hybrid engine's node boundary."""
        from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
        from hybridflow.workers.critic import CriticWorker
        from hybridflow.workers.reward_model import RewardModelWorker
        from hybridflow.workers.rollout import RolloutWorker

        t, steps = self.cfg.trainer, self.total_steps
        classes: dict[str, tuple[type, dict]] = {}
        if Role.ACTOR_ROLLOUT in roles:
            role = "actor" + ("" if self.async_rollout else "_rollout") + ("_ref" if Role.REF in roles else "")
            classes["actor"] = (ActorRolloutRefWorker, {"config": self.cfg, "role": role, "total_training_steps": steps, "procs_per_node": procs_per_node})
        elif Role.REF in roles:
            classes["ref"] = (ActorRolloutRefWorker, {"config": self.cfg, "role": "ref"})
        if Role.ROLLOUT in roles:
            classes["rollout"] = (RolloutWorker, {"config": self.cfg})
        if Role.CRITIC in roles:
            classes["critic"] = (CriticWorker, {"config": self.cfg, "total_training_steps": steps})
        if Role.REWARD_MODEL in roles:
            rm, mcfg = self.cfg.reward_model, self.cfg.actor_rollout_ref.model
            classes["reward_model"] = (RewardModelWorker, {"model": rm.model, "fsdp": rm.fsdp_config, "micro_batch_size": rm.micro_batch_size_per_gpu,
                                                           "device": t.device, "seed": t.seed, "policy_tokenizer": mcfg.tokenizer_path or mcfg.path,
                                                           "collective_timeout_s": t.collective_timeout_s})
        return classes

    # torchrun: every rank runs this driver; files are written by rank 0, the others wait for it.
    @property
    def is_main(self) -> bool:
        return not self.torchrun or torch.distributed.get_rank() == 0

    def _barrier(self) -> None:
        if self.torchrun:
            torch.distributed.barrier()

    def shutdown(self) -> None:
        for name in list(self.groups):
            self.groups.pop(name).shutdown()
        for name in list(self.pools):  # also a pool whose group failed to start
            self.pools.pop(name).release()
        self.wg = None

    def pool_of(self, role: Role) -> str:
        return self.role_pool[role]

    # ------------------------------------------------------------------ stages
    def _generate(self, batch: Batch) -> Batch:
        """Sample the step's responses; the generation buffers are freed afterwards (colocated)."""
        return self.actor.generate_sequences(batch, self._sampling(), release_after=True)

    def _reward(self, batch: Batch) -> Batch:
        """token_level_scores [B, R]: the rule reward, or with a reward model
        score_weight * rm_scores + rule_weight * rule (rule_weight 0: the rule is not run)."""
        rm = self.cfg.reward_model
        if not self.use_rm:
            scores, metrics = self.reward_fn(batch)
            return Batch.from_dict(tensors={"token_level_scores": scores}, meta={"metrics": metrics})
        scores, metrics = rm.score_weight * batch["rm_scores"], {}
        if rm.rule_weight:
            rule, metrics = self.reward_fn(batch)
            scores = scores + rm.rule_weight * rule
        return Batch.from_dict(tensors={"token_level_scores": scores}, meta={"metrics": metrics})

    def _reward_stages(self) -> list[Stage]:
        """The reward model (on its pool) and the driver's reward stage that combines it with the rule."""
        return [
            Stage("rm", self.rm.compute_rm_score if self.rm else None, ["responses", "response_mask", "raw_prompt"], ["rm_scores"], enabled=self.use_rm),
            Stage("reward", self._reward, REWARD_KEYS + (["rm_scores"] if self.use_rm else []), ["token_level_scores"]),
        ]

    def _reward_baseline(self, batch: Batch) -> Batch:
        """ReMax: the reward of the greedy response to the same prompt, one scalar per sample."""
        greedy = self.actor.generate_sequences(batch.select(PROMPT_KEYS), dataclasses.replace(self._sampling(), do_sample=False))
        scores, _ = self.reward_fn(_with_sample_info(greedy, batch))
        return Batch.from_dict(tensors={"reward_baselines": scores.sum(-1)})

    def _behaviour_log_probs(self, batch: Batch) -> Batch:
        """Async rollout: the PPO ratio is against the policy that sampled (one version behind)."""
        return Batch.from_dict(tensors={"old_log_probs": batch["rollout_log_probs"]})

    def _advantage(self, batch: Batch) -> Batch:
        a = self.cfg.algorithm
        metrics: dict[str, float] = {}
        rewards = batch["token_level_scores"]
        if a.use_kl_in_reward:
            rewards, metrics = apply_kl_penalty(rewards, batch["old_log_probs"], batch["ref_log_prob"], batch["response_mask"], self.kl_ctrl, a.kl_penalty)
        adv, returns = get_adv_estimator(a.adv_estimator)(
            rewards,
            batch["response_mask"],
            index=batch["uid"],
            values=batch["values"] if "values" in batch else None,
            reward_baselines=batch["reward_baselines"] if "reward_baselines" in batch else None,
            gamma=a.gamma,
            lam=a.lam,
            norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
        )
        return Batch.from_dict(tensors={"token_level_rewards": rewards, "advantages": adv, "returns": returns}, meta={"metrics": metrics})

    def _adv_inputs(self) -> list[str]:
        a = self.cfg.algorithm
        return (["token_level_scores", "response_mask", "uid"] + (["old_log_probs", "ref_log_prob"] if a.use_kl_in_reward else [])
                + (["values"] if self.use_critic else []) + (["reward_baselines"] if a.adv_estimator == "remax" else []))

    def _reshard(self, batch: Batch) -> dict[str, float]:
        """Training -> generation layout. With overlap on, only start it: `train_step` prepares the
        next batch while the workers reshard, then collects the result."""
        he = self.cfg.actor_rollout_ref.hybrid_engine
        first = not self._reshard_logged
        if first:
            r = self.cfg.actor_rollout_ref.rollout
            a, n = self.cfg.actor_rollout_ref.actor, self.actor.world_size
            pp, tp = a.pipeline_model_parallel_size, a.tensor_model_parallel_size
            train = f"FSDP(dp={n})" if pp == tp == 1 else f"PP={pp} x TP={tp} x FSDP(dp={n // (pp * tp)})"
            logger.info("Starting resharding from %s to TP=%d x DP=%d...", train, r.tensor_model_parallel_size, n // r.tensor_model_parallel_size)
            logger.info("Resharding plan: %s per rank at minimum (naive: %s), %s crossing nodes (%d node(s) x %d workers)",
                        _human_bytes(max(self.plan_summary["min_bytes_per_rank"])), _human_bytes(max(self.plan_summary["naive_bytes_per_rank"])),
                        _human_bytes(self.plan_summary["cross_node_bytes"]), self.cfg.trainer.nnodes, self.cfg.trainer.n_gpus_per_node)
        kwargs = {"measure_baseline": first and he.measure_baseline, "check": self.cfg.trainer.check_weight_sync, "trace": profiler.active_session() is not None}
        self._pending_reshard = self.actor.submit("reshard", **kwargs)
        if he.resharding_overlap_with_compute:
            return {}
        return self._finish_reshard()

    def _finish_reshard(self, prep_seconds: float | None = None) -> dict[str, float]:
        wait_start = time.perf_counter()
        per_rank = self._pending_reshard.result()
        waited = time.perf_counter() - wait_start
        self._pending_reshard = None
        seconds = max(r["seconds"] for r in per_rank)
        m = {
            "timing_s/reshard": seconds,
            "reshard/bytes_per_rank": float(max(r["bytes_received"] for r in per_rank)),
            "reshard/min_bytes_per_rank": float(max(self.plan_summary["min_bytes_per_rank"])),
            "reshard/skipped_bytes_per_rank": float(max(r.get("skipped_bytes", 0) for r in per_rank)),  # frozen parameters
            "reshard/naive_bytes_per_rank": float(max(self.plan_summary["naive_bytes_per_rank"])),
            "reshard/cross_node_bytes": float(self.plan_summary["cross_node_bytes"]),
            "reshard/peak_extra_gb": max(r["peak_extra_bytes"] for r in per_rank) / 2**30,
            "perf/max_memory_rss_gb": max(r["rss_bytes"] for r in per_rank) / 2**30,
        }
        if "max_diff" in per_rank[0]:
            diff = max(r["max_diff"] for r in per_rank)
            if diff != 0.0:
                raise RuntimeError(f"weight sync check failed: generation weights differ from the trained ones by {diff}")
            m["reshard/weight_max_diff"] = diff
        if prep_seconds is not None:
            # The part of the workers' resharding time the driver spent preparing the next batch.
            m["reshard/overlap_ratio"] = max(0.0, min(1.0, (seconds - waited) / seconds)) if seconds > 0 else 1.0
        session = profiler.active_session()
        if session is not None:
            for r in per_rank:
                session.events.extend(r.get("trace", []))
        if not self._reshard_logged:
            logger.debug("Layer-wise migration: %s", " -> ".join(per_rank[0]["layers"]))
            if "baseline" in per_rank[0]:
                base = max(r["baseline"]["seconds"] for r in per_rank)
                m["reshard/baseline_seconds"] = base
                logger.info("Resharding completed in %.3fs (vs %.3fs baseline), %s received per rank (naive: %s)",
                            seconds, base, _human_bytes(m["reshard/bytes_per_rank"]), _human_bytes(m["reshard/naive_bytes_per_rank"]))
            else:
                logger.info("Resharding completed in %.3fs, %s received per rank", seconds, _human_bytes(m["reshard/bytes_per_rank"]))
            if prep_seconds is not None:
                logger.info("Overlapped %d%% of resharding time with data loading", round(100 * m["reshard/overlap_ratio"]))
            self._reshard_logged = True
        return m

    def _sync_rollout(self, batch: Batch | None = None) -> dict[str, float]:
        """Async rollout: trained weights -> the rollout pool, once it has finished the batch it is
        generating with the previous weights. Each generation rank fetches only its own pieces."""
        if self._gen_pending is not None:
            self._gen_pending.result()
        r, check = self.cfg.actor_rollout_ref.rollout, self.cfg.trainer.check_weight_sync
        start = time.perf_counter()
        refs = self.actor.publish_weights(r.tensor_model_parallel_size, self.rollout.world_size)
        per_rank = self.rollout.receive_weights(refs, check=check)
        m = {"timing_s/sync_weights": time.perf_counter() - start,
             "reshard/bytes_per_rank": float(max(x["bytes_received"] for x in per_rank))}
        if check:
            trained = self.actor.weight_fingerprints(r.tensor_model_parallel_size, self.rollout.world_size)
            mismatched = [k for fp in self.rollout.weight_fingerprints() for k, v in fp.items() if trained.get(k) != v]
            diff = max(x["max_diff"] for x in per_rank)
            if mismatched or diff != 0.0:
                raise RuntimeError(f"weight sync check failed: rollout weights differ from the trained ones ({mismatched[:3]}, max diff {diff})")
            m["reshard/weight_max_diff"] = 0.0
        if not self._reshard_logged:
            tp, world = r.tensor_model_parallel_size, self.rollout.world_size
            logger.info("Cross-pool weight sync from FSDP(dp=%d) on %s to TP=%d x DP=%d on %s: %s received per generation rank "
                        "(its generation slice) in %.3fs", self.actor.world_size, self.pool_of(Role.ACTOR_ROLLOUT), tp, world // tp,
                        self.pool_of(Role.ROLLOUT), _human_bytes(m["reshard/bytes_per_rank"]), m["timing_s/sync_weights"])
            self._reshard_logged = True
        self._gen_version = self.global_step  # the rollout now holds the policy after this many updates
        return m

    def build_dataflow(self) -> DataFlow:
        a = self.cfg.algorithm
        actor, ref, critic = self.actor, self.ref, self.critic
        actor_pool = self.pool_of(Role.ACTOR_ROLLOUT)
        gen_stages = [Stage("gen", self._generate, PROMPT_KEYS, GEN_OUTPUTS, pool=actor_pool)]
        recompute = self.cfg.actor_rollout_ref.actor.recompute_old_log_prob or self.async_rollout
        old_log_prob = Stage("old_log_prob", actor.compute_log_prob, TRAIN_KEYS, ["old_log_probs"], enabled=recompute)
        sync = Stage("reshard", self._reshard, [], [], pool=actor_pool)
        if self.async_rollout:  # generation happens outside the flow, one batch ahead (train_step)
            gen_stages = []
            old_log_prob = Stage("old_log_prob", self._behaviour_log_probs, ["rollout_log_probs"], ["old_log_probs"])
            sync = Stage("sync_weights", self._sync_rollout, [], [], pool=actor_pool)
        return DataFlow([
            Stage("reward_baseline", self._reward_baseline, PROMPT_KEYS + SAMPLE_INFO_KEYS, ["reward_baselines"], enabled=a.adv_estimator == "remax", pool=actor_pool),
            *gen_stages,
            *self._reward_stages(),
            old_log_prob,
            Stage("ref", ref.compute_ref_log_prob if ref else None, TRAIN_KEYS, ["ref_log_prob"], enabled=self.use_ref),
            Stage("values", critic.compute_values if critic else None, TRAIN_KEYS, ["values"], enabled=self.use_critic),
            Stage("adv", self._advantage, self._adv_inputs(), ["token_level_rewards", "advantages", "returns"]),
            Stage("update_critic", critic.update_critic if critic else None, TRAIN_KEYS + ["values", "returns"], [], enabled=self.use_critic),
            Stage("update_actor", actor.update_actor, TRAIN_KEYS + (["old_log_probs"] if recompute else []) + ["advantages"]
                  + (["ref_log_prob"] if self.use_ref else []), []),
            sync,
        ])

    # ------------------------------------------------------------------ loop
    def _sampling(self, greedy: bool = False, step: int | None = None) -> SamplingParams:
        seed = self.cfg.trainer.seed * 100_003 + (self.global_step if step is None else step)
        return SamplingParams.from_config(self.cfg, greedy, seed)

    def _prepare_batch(self) -> Batch:
        n = self.cfg.actor_rollout_ref.rollout.n
        batch = self.loader.next_batch()
        # Group id per prompt, then n interleaved samples per prompt: [p0, p0, ..., p1, p1, ...].
        batch["uid"] = [f"{self.loader.epoch}-{self.loader.position}-{i}" for i in range(len(batch))]
        return batch.repeat(n, interleave=True)

    def _prepare_batch_keys(self) -> list[str]:
        """The keys a step's batch starts with (the loader's columns and the group ids)."""
        return PROMPT_KEYS + SAMPLE_INFO_KEYS + ["uid"] + (GEN_OUTPUTS if self.async_rollout else [])  # async: generated outside the flow

    def _submit_generation(self, step: int) -> "_InFlight":
        """Async rollout: start generating the prompts of `step` on the rollout pool."""
        prompts = self._prepare_batch()
        pending = self.rollout.submit("generate_sequences", prompts.select(PROMPT_KEYS), self._sampling(step=step))
        return _InFlight(prompts, pending, self._gen_version)

    def train_step(self, flow: DataFlow) -> dict[str, float]:
        start = time.perf_counter()
        if self.async_rollout:
            batch, metrics = self._async_step(flow)
        else:
            batch = self._next_batch if self._next_batch is not None else self._prepare_batch()
            self._next_batch = None
            batch, metrics = flow.run(batch)
        if self._pending_reshard is not None:  # overlapped: prepare the next batch, then collect
            prep_start = time.perf_counter()
            if self.global_step < self.total_steps:
                self._loader_state_at_prefetch = self.loader.state_dict()  # a checkpoint must not skip it
                self._next_batch = self._prepare_batch()
            metrics.update(self._finish_reshard(prep_seconds=time.perf_counter() - prep_start))
        metrics["timing_s/step"] = time.perf_counter() - start
        if "timing_s/reshard" in metrics:
            metrics["reshard/comm_fraction"] = metrics["timing_s/reshard"] / metrics["timing_s/step"]
        metrics.update(compute_data_metrics(batch, self.actor.world_size, metrics["timing_s/step"]))
        return metrics

    def _async_step(self, flow: DataFlow) -> tuple[Batch, dict[str, float]]:
        """Train on the batch generated during the previous step while the rollout pool generates
        the next one with the weights it holds (one update behind)."""
        if self._gen_pending is None:  # the first step (or after a resume): nothing in flight yet
            self._gen_pending = self._submit_generation(self.global_step)
        wait_start = time.perf_counter()
        batch, version = self._gen_pending.result()
        gen_wait = time.perf_counter() - wait_start
        self._gen_pending = None
        if self.global_step < self.total_steps:
            self._loader_state_at_prefetch = self.loader.state_dict()  # a checkpoint must not skip it
            self._gen_pending = self._submit_generation(self.global_step + 1)
        batch, metrics = flow.run(batch)
        metrics["timing_s/gen_wait"] = gen_wait
        metrics["rollout/staleness"] = float(self.global_step - 1 - version)  # updates since the sampling policy
        return batch, metrics

    def validate(self) -> dict[str, float]:
        """Greedy (val_kwargs) generation on the validation set; accuracy per data source."""
        if self.val_ds is None:
            return {}
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        size = self.cfg.data.val_batch_size or len(self.val_ds)
        scores: dict[str, list[float]] = defaultdict(list)
        for start in range(0, len(self.val_ds), size):
            batch = self.collate([self.val_ds[i] for i in range(start, min(start + size, len(self.val_ds)))])
            batch = batch.repeat(vk.n, interleave=True)
            out = self.rollout.generate_sequences(batch.select(PROMPT_KEYS), self._sampling(greedy=True))
            seq_scores = self.reward_fn(_with_sample_info(out, batch))[0].sum(-1).tolist()
            for ds, s in zip(batch["data_source"], seq_scores):
                scores[ds].append(s)
        return {f"val-core/{ds}/acc/mean@{vk.n}": float(np.mean(v)) for ds, v in scores.items()}

    def fit(self) -> dict:
        t = self.cfg.trainer
        if self.wg is None:
            self.init_workers()
        if self.is_main:
            os.makedirs(t.default_local_dir, exist_ok=True)
            save_config(self.cfg, os.path.join(t.default_local_dir, "config.yaml"))
        self._maybe_resume()
        self._before_training()
        tracker = self._tracker()
        flow = self.flow = self.build_dataflow()
        flow.check(self._prepare_batch_keys())  # the whole graph, before the first step
        history: list[dict] = []
        val_metrics: dict[str, float] = {}
        if t.val_before_train and self.global_step == 0:
            val_metrics = self.validate()
            if val_metrics:
                tracker.log(val_metrics, step=0)
                history.append({"step": 0, **val_metrics})
        if self.train_ds.num_filtered:
            logger.info("filtered %d over-long prompts (data.max_prompt_length=%d)", self.train_ds.num_filtered, self.cfg.data.max_prompt_length)
        progress = _progress(t.progress_bar and self.is_main, self.total_steps, self.global_step)
        nonfinite = 0  # consecutive steps whose update was skipped
        try:
            while self.global_step < self.total_steps:
                self.global_step += 1
                metrics = self.train_step(flow)
                metrics["data/num_filtered_prompts"] = float(self.train_ds.num_filtered)
                nonfinite = self._check_finite(metrics, nonfinite)
                last = self.global_step == self.total_steps
                if t.test_freq > 0 and (self.global_step % t.test_freq == 0 or last):
                    val_metrics = self.validate()
                    metrics.update(val_metrics)
                if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or last):
                    self.save_checkpoint()
                tracker.log(metrics, step=self.global_step)
                history.append({"step": self.global_step, **metrics})
                if progress:
                    progress.update(1)
            if t.save_hf_model:
                out = self.actor.save_hf_model(os.path.abspath(os.path.join(t.default_local_dir, "hf_model")))
                logger.info("wrote the trained actor as an HF checkpoint to %s", out)
        finally:
            if progress:
                progress.close()
            tracker.close()
        return {"steps": self.global_step, "final_val": val_metrics, "history": history}

    def _check_finite(self, metrics: dict[str, float], nonfinite: int) -> int:
        """A non-finite gradient norm means that update was skipped (`clip_and_step`); abort after
        trainer.max_nonfinite_steps such steps in a row. Returns the new count."""
        bad = [k for k in ("actor/grad_norm", "critic/grad_norm") if k in metrics and not np.isfinite(metrics[k])]
        if not bad:
            return 0
        nonfinite += 1
        limit = self.cfg.trainer.max_nonfinite_steps
        logger.warning("step %d: non-finite %s (a nan/inf loss): the update was skipped (%d in a row, abort at %d)",
                       self.global_step, ", ".join(bad), nonfinite, limit)
        metrics["train/skipped_updates"] = 1.0
        if nonfinite >= limit:
            raise NonFiniteError(f"{nonfinite} consecutive steps (up to step {self.global_step}) had a nan/inf loss, so their updates were "
                                 f"skipped; aborting (trainer.max_nonfinite_steps={limit}). Check the reward function and lower the "
                                 f"learning rate; the last checkpoint in {self.cfg.trainer.default_local_dir} is unaffected and resumes "
                                 f"with the same command")
        return nonfinite

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        """Atomically: every part is written into `global_step_<k>.tmp`, which is renamed once
        complete; only then does the latest-step file (itself replaced atomically) point at it. A
        crash at any moment leaves the previous checkpoint as the latest. Old ones beyond
        trainer.max_ckpt_to_keep are deleted afterwards."""
        t = self.cfg.trainer
        root = os.path.abspath(t.default_local_dir)
        path = os.path.join(root, f"global_step_{self.global_step}")
        tmp = path + ".tmp"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial one from a crash
        self._barrier()
        self.actor.save_checkpoint(tmp)
        if self.critic:
            self.critic.save_checkpoint(tmp)
        prefetched = self._next_batch is not None or self._gen_pending is not None
        loader_state = self._loader_state_at_prefetch if prefetched else self.loader.state_dict()
        state = {"global_step": self.global_step, "loader": loader_state, "kl_ctrl": self.kl_ctrl.state_dict(), **self._extra_state()}
        if not self.is_main:
            self._barrier()  # rank 0 completes the checkpoint
            return path
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        shutil.rmtree(path, ignore_errors=True)  # the same step saved before (a re-run)
        os.replace(tmp, path)
        with open(os.path.join(root, LATEST + ".tmp"), "w") as f:
            f.write(str(self.global_step))
        os.replace(os.path.join(root, LATEST + ".tmp"), os.path.join(root, LATEST))
        if t.max_ckpt_to_keep:
            steps = sorted(int(d.split("_")[-1]) for d in os.listdir(root) if re.fullmatch(r"global_step_\d+", d))
            for old in steps[: -t.max_ckpt_to_keep]:
                if old != self.global_step:
                    shutil.rmtree(os.path.join(root, f"global_step_{old}"), ignore_errors=True)
        self._barrier()
        return path

    def _maybe_resume(self) -> None:
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return
        if t.resume_mode == "resume_path":
            path = t.resume_from_path
        else:
            latest = os.path.join(t.default_local_dir, LATEST)
            if not os.path.exists(latest):
                return
            path = os.path.join(t.default_local_dir, f"global_step_{open(latest).read().strip()}")
        path = os.path.abspath(path)
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)  # plain numbers and dicts
        self.actor.load_checkpoint(path)
        if self.critic:
            self.critic.load_checkpoint(path)
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self._load_extra_state(state)
        if self.async_rollout:  # the rollout pool starts from the restored policy
            self._sync_rollout()
        logger.info("resumed from %s at step %d", path, self.global_step)


    def _tracker(self) -> Tracker:
        t = self.cfg.trainer
        if not self.is_main:  # torchrun: rank 0 logs
            return Tracker([], None)
        exporter = None
        if t.prometheus.port is not None:
            from hybridflow.utils.prometheus import MetricsExporter

            exporter = self.metrics_exporter = MetricsExporter(t.prometheus.port, t.prometheus.host)
            logger.info("Prometheus metrics on http://%s:%d/metrics", t.prometheus.host, exporter.port)
        return Tracker(t.logger, self.log_dir, columns=self.CONSOLE_COLUMNS, project=t.project_name, run_name=t.experiment_name,
                       config=to_dict(self.cfg), prometheus=exporter)

    def _before_training(self) -> None:
        """After the workers started and a checkpoint was (maybe) restored, before step 1."""

    def _extra_state(self) -> dict:
        """What a subclass adds to trainer_state.pt (tensors and plain values only)."""
        return {}

    def _load_extra_state(self, state: dict) -> None:
        pass


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


def _with_sample_info(generated: Batch, prompts: Batch) -> Batch:
    """Attach the prompts' per-sample reward inputs to a generation result (same rows)."""
    for key in SAMPLE_INFO_KEYS:
        generated[key] = prompts[key]
    return generated


def _progress(enabled: bool, total: int, initial: int):
    if not enabled or not sys.stderr.isatty():  # a bar in a log file interleaves with the step table
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="rl steps", unit="step", dynamic_ncols=True, leave=False)


class _InFlight:
    """Async rollout: one batch's generation in flight on the rollout pool, and the policy version
    of the weights it samples with. `result()` waits once and merges the responses into the prompts."""

    def __init__(self, prompts: Batch, pending, version: int):
        self.prompts, self.pending, self.version = prompts, pending, version
        self._done: Batch | None = None

    def result(self) -> tuple[Batch, int]:
        if self._done is None:
            out = self.pending.result()
            for key in GEN_OUTPUTS:
                self.prompts[key] = out[key]
            self.prompts.meta.update(out.meta, policy_version=self.version)
            self._done = self.prompts
        return self._done, self.version
