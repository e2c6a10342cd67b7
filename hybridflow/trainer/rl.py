"""The RL trainer (PPO, GRPO, RLOO, REINFORCE++, ReMax): a driver that runs a DataFlow.

    trainer = RLTrainer(cfg)        # config, roles, memory and data checked before any worker starts
    trainer.init_workers()          # pools reserved, one worker group per pool holding its roles
    summary = trainer.fit()         # the flow, the loop, checkpoints

Construction reads top to bottom: the config (a parallel config and engine switches applied, then
validated) -> the layout (which roles run, on which pools: `roles.py`, computed once) -> the
pre-flight memory check -> the data and rewards. All of that happens before Ray or any worker
starts; `init_workers` then places the pools and the roles' workers (`placement.py`: Ray or
torchrun), and `fit` builds the flow. Next to this file: `weight_sync.py` (the reshard stage, its
metrics and log lines, overlap with the next batch, the cross-pool sync), `validation.py`.

One step (see `build_dataflow`):
    gen -> reward -> old_log_prob -> ref -> values -> adv -> update_critic -> update_actor -> reshard
Stages that the algorithm does not need are disabled (no critic for GRPO, no ref without KL). The
DataFlow scheduler runs stages of disjoint pools concurrently (values on the critic pool while the
actor pool computes log-probs; both updates together) and driver stages alongside worker stages.
With trainer.async_rollout the rollout pool generates ahead of training: the rollout service
(`hybridflow/service/`: take a step's batch, publish an update's weights, generate for validation,
stop), with multi-turn rollouts on its rollout managers, off the driver.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import os
import sys
import time
from typing import TYPE_CHECKING

import numpy as np
from transformers import AutoTokenizer

from hybridflow.algorithms import make_kl_controller
from hybridflow.algorithms.rollout_correction import resolve as resolve_correction
from hybridflow.config import ConfigError, HybridFlowConfig, save_config, to_dict, validate_config
from hybridflow.config.pools import Role, pool_specs
from hybridflow.data.dataset import RLDataset
from hybridflow.data.vision import RAW_IMAGES_KEY
from hybridflow.models.vlm import image_keys, prompt_collate, prompt_dataset
from hybridflow.planning.preflight import check_memory
from hybridflow.protocol import Batch
from hybridflow.rewards.loader import load_custom_reward_fn
from hybridflow.rewards.manager import RewardManager
from hybridflow.protocol import SamplingParams
from hybridflow.run_plan import resolve
from hybridflow.trainer import checkpoints, driver_stages, validation
from hybridflow.service import AgentRollout, RolloutService, rollout_replicas, served_model_name, start_rollout_service
from hybridflow.service.async_rollout import AsyncRollout
from hybridflow.service.managers import ManagerPool
from hybridflow.trainer.dataflow import DataFlow, Stage
from hybridflow.trainer.keys import GEN_OUTPUTS, PROMPT_KEYS, REWARD_KEYS, SAMPLE_INFO_KEYS, TRAIN_KEYS, with_sample_info
from hybridflow.trainer.loader import PromptLoader
from hybridflow.trainer.metrics import MismatchAlarm, compute_data_metrics
from hybridflow.trainer.placement import WorkerGroups, start_groups
from hybridflow.trainer.roles import RunRoles, role_classes
from hybridflow.service.replicas import REQUEST_TIMEOUT_KEY
from hybridflow.trainer.weight_sync import WeightSync
from hybridflow.utils.tracking import CONSOLE_COLUMNS, Tracker

if TYPE_CHECKING:
    from hybridflow.config.parallel import ParallelConfig

__all__ = ["GEN_OUTPUTS", "PROMPT_KEYS", "REWARD_KEYS", "SAMPLE_INFO_KEYS", "TRAIN_KEYS", "NonFiniteError", "RLTrainer", "resolve_config"]

logger = logging.getLogger("hybridflow")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a nan/inf loss (trainer.max_nonfinite_steps)."""


def resolve_config(cfg: HybridFlowConfig, parallel_config: str | dict | ParallelConfig | None, engine_kwargs: dict, kind: str) -> HybridFlowConfig:
    """`cfg` with a parallel config (only the keys it sets) and hybrid-engine switches applied, the
    unset batch sizes derived from the layout (`config/derive.py`), validated."""
    from hybridflow.config.derive import derive_defaults
    from hybridflow.config.parallel import apply_engine_kwargs, apply_parallel_config, as_parallel_config

    if parallel_config is not None:
        cfg = apply_parallel_config(cfg, as_parallel_config(parallel_config))
    if engine_kwargs:
        cfg = apply_engine_kwargs(cfg, **engine_kwargs)
    cfg = derive_defaults(cfg, kind)  # what the workers get: every size set
    validate_config(cfg, kind)  # before any worker (or Ray) starts
    return cfg


class RLTrainer:
    KIND = "rl"  # which checks `validate_config` runs and which roles run (`trainer/dpo.py` sets "dpo")
    CONSOLE_COLUMNS = CONSOLE_COLUMNS

    def __init__(self, cfg: HybridFlowConfig, parallel_config: str | dict | ParallelConfig | None = None, **engine_kwargs):
        """parallel_config: a parallel config file, a dict of its keys or a ParallelConfig, mapped
        onto `cfg` (only the keys it sets); engine_kwargs: hybrid-engine switches
        (enable_resharding_opt, resharding_overlap_with_compute, granularity). Both are applied
        before validation."""
        self.cfg = cfg = resolve_config(cfg, parallel_config, engine_kwargs, self.KIND)
        self.roles = RunRoles.of(cfg, self.KIND)  # which roles run, on which pools: computed once, here
        check_memory(cfg, self.roles.roles)  # the estimated peak per worker fits the device (planning/preflight.py)
        self.run_plan = resolve(cfg)  # every role's spec (run_plan.py), after the last derived value: what its workers receive
        self._load_data()
        if cfg.trainer.resume_mode == "auto" and (found := checkpoints.resume_path(cfg.trainer)):
            checkpoints.check_same_run(found, cfg)  # never resume from another run's checkpoints (on by default)
        a = cfg.algorithm
        self.kl_ctrl = make_kl_controller(a.kl_ctrl.type, a.kl_ctrl.kl_coef, a.kl_ctrl.target_kl, a.kl_ctrl.horizon)
        # "auto" decided once, here: off-policy only when the rollout pool may lag (async, max_staleness > 0)
        lagging = cfg.trainer.async_rollout and cfg.async_training.max_staleness > 0
        self.correction = resolve_correction(a.rollout_correction, lagging)
        # bypass: the PPO ratio against the policy that sampled (the rollout's log-probs as the old ones)
        self.old_from_rollout = lagging and not self.correction.active
        self.sample_flow: DataFlow | None = None  # dynamic sampling: gen + reward, rerun until the batch is full
        self._gen_round = 0  # dynamic sampling: which generation round of the step (its own sampling seed)
        self.underfilled_batches = 0  # dynamic sampling: steps that trained on fewer groups than a batch (data/underfilled_batches)
        self.mismatch_alarm = MismatchAlarm(cfg.trainer.mismatch_alarm_factor)
        self.global_step = 0
        self.log_dir = cfg.trainer.log_dir or cfg.trainer.default_local_dir
        self.placed: WorkerGroups | None = None  # set by init_workers
        self.wg = None  # the actor's worker group
        self.weight_sync: WeightSync | None = None
        self.service: RolloutService | None = None  # trainer.async_rollout: generation on a pool of its own
        self._next_batch: Batch | None = None  # prepared while the workers reshard (overlap mode)
        self._loader_state_at_prefetch: dict | None = None  # a checkpoint must not skip a prefetched batch

    def _load_data(self) -> None:
        """The tokenizer, the datasets and their loader, the reward function: all read and checked
        before any worker starts."""
        d, mcfg, crf = self.cfg.data, self.run_plan.actor.model, self.cfg.custom_reward_function
        self.tokenizer = AutoTokenizer.from_pretrained(mcfg.tokenizer_source())
        # A vision-language model's prompts carry their images (data/vision.py): its datasets, collate and batch keys.
        self.image_keys = image_keys(mcfg.path)
        self.val_ds = prompt_dataset(d.val_files, self.tokenizer, mcfg.path, d.max_prompt_length, d.prompt_key, d.filter_overlong_prompts,
                                     d.truncation) if d.val_files else None
        self.collate = prompt_collate(self.tokenizer.pad_token_id, mcfg.path, d.max_prompt_length, d.prompt_padding)
        self.train_ds, train_collate = self._train_data()
        self.loader = PromptLoader(self.train_ds, d.train_batch_size, train_collate, d.shuffle, d.seed)
        self.total_steps = self.cfg.trainer.total_training_steps or self.loader.batches_per_epoch * self.cfg.trainer.total_epochs
        # reward_model.num_workers: the reward on a pool of reward workers (Ray actors), started at the first reward call
        self.reward_fn = RewardManager(self.tokenizer, load_custom_reward_fn(crf.path, crf.name), timeout_s=crf.timeout_s,
                                       code_strict=crf.code_strict, num_workers=self.cfg.reward_model.num_workers)
        self._check_scorers()
        # Multi-turn (tools / environments): the agent loop on the driver; tool config read now.
        mt = self.run_plan.rollout.rollout.multi_turn
        self.agent = AgentRollout(mt, d.max_response_length, self.tokenizer, self.run_plan.rollout.rollout.agent, d.max_prompt_length,
                                  served_model_name(mcfg.path), mcfg.path) if mt.enable else None
        # a VLM's multi-turn rollout renders each row's prompt from its decoded images (the driver's gen stage only)
        self.raw_image_keys = [RAW_IMAGES_KEY] if self.image_keys and self.agent is not None else []

    def _train_data(self):
        """The training dataset and its collate function (RL: prompts)."""
        d = self.cfg.data
        return prompt_dataset(d.train_files, self.tokenizer, self.run_plan.actor.model.path, d.max_prompt_length, d.prompt_key,
                              d.filter_overlong_prompts, d.truncation), self.collate

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

    # ------------------------------------------------------------------ roles and workers
    @property
    def role_pool(self) -> dict[Role, str]:
        return self.roles.pools

    @property
    def async_rollout(self) -> bool:
        return self.roles.async_rollout

    def pool_of(self, role: Role) -> str:
        return self.roles.pool_of(role)

    @property
    def groups(self) -> dict:
        return self.placed.groups if self.placed else {}

    @property
    def pools(self) -> dict:
        return self.placed.pools if self.placed else {}

    def init_workers(self) -> None:
        """Reserve the pools (Ray; checked against the cluster first) or join torchrun's group, one
        worker group per pool holding the roles mapped to it (colocated in one process per rank),
        then start every model."""
        cfg, roles = self.cfg, self.roles
        if cfg.trainer.check_weight_sync and self.run_plan.rollout.name == "vllm":
            logger.warning("trainer.check_weight_sync compares generation buffers with the trained weights on the hf "
                           "backend; vLLM repacks its weights, so with vllm the check is rollout/logprob_diff_max")
        specs = pool_specs(cfg)
        self.placed = start_groups(cfg.trainer, cfg.ray_init, {name: specs[name] for name in roles.pool_names()},
                                   lambda pool, procs_per_node: role_classes(self.run_plan, roles, roles.on(pool), self.total_steps),
                                   name=lambda pool: f"{cfg.trainer.experiment_name}_{pool}_{os.getpid()}")
        self.wg = self.groups[self.pool_of(Role.ACTOR_ROLLOUT)]
        views = self.placed.views()
        self.actor = views["actor"]
        self.ref = views.get("ref", self.actor) if roles.ref_log_prob else None
        self.rollout = views["rollout"] if roles.async_rollout else self.actor
        if roles.async_rollout:  # the rollout service's replicas (restarted when they fail, where each is one process)
            self.rollout = rollout_replicas(self.groups[self.pool_of(Role.ROLLOUT)], self.rollout, self.run_plan.rollout,
                                            cfg.async_training.max_replica_restarts)
        self.critic = views.get("critic")
        self.rm = views.get("reward_model")
        self.teacher = views.get("teacher")
        pending = [v.submit("init_model") for v in views.values()]  # pools start their models at the same time
        for p in pending:
            p.result()
        self.plan_summary = None if roles.async_rollout else self.actor.reshard_plan()
        self.weight_sync = WeightSync(self.run_plan.actor, cfg.trainer, self.actor, self.plan_summary, self.rollout,
                                      (self.pool_of(Role.ACTOR_ROLLOUT), roles.pools.get(Role.ROLLOUT, "")))
        if roles.async_rollout:
            self.service = start_rollout_service(self.rollout, self.run_plan.rollout, cfg.async_training, self.weight_sync, self.agent,
                                                 self._prepare_batch, lambda step: self._sampling(step=step), self.total_steps,
                                                 self.loader.state_dict, self.tokenizer.pad_token_id, cfg.data.max_prompt_length)
            if self.service.managers is not None:
                logger.info("%d rollout manager(s) run the agent loops off the driver%s", len(self.service.managers.actors),
                            "; agent endpoints: " + ", ".join(self.service.managers.urls) if any(self.service.managers.urls) else "")

    @property
    def async_gen(self) -> AsyncRollout | None:
        """The rollout service's scheduler (its batches in flight), with trainer.async_rollout."""
        return self.service.scheduler if self.service is not None else None

    @property
    def managers(self) -> ManagerPool | None:
        return self.service.managers if self.service is not None else None

    @property
    def is_main(self) -> bool:
        """torchrun: every rank runs this driver; files are written by rank 0, the others wait for it."""
        return self.placed is None or self.placed.is_main

    def shutdown(self) -> None:
        if self.service is not None:
            self.service.stop()
        if getattr(self, "reward_fn", None) is not None and hasattr(self.reward_fn, "close"):  # its reward workers, if it started any
            self.reward_fn.close()
        if self.placed is not None:
            self.placed.shutdown()  # the groups, then every pool (also one whose group failed to start)
        self.wg = None

    # ------------------------------------------------------------------ stages
    def _generate(self, batch: Batch) -> Batch:
        """Sample the step's responses; the generation buffers are freed afterwards (colocated), or
        with dynamic sampling after the step's last generation round (`_sample_groups`)."""
        return self._rollout_on(self.actor, batch, self._sampling(), release_after=self.sample_flow is None)

    def _rollout_on(self, group, batch: Batch, params: SamplingParams, release_after: bool = False) -> Batch:
        """One response (single-turn) or one trajectory (multi-turn: the agent loop) per row."""
        waiting_for = f"step {self.global_step}'s generation"
        if self.service is not None and group is self.rollout:  # validation on the rollout service: any version its replicas hold
            return self.service.generate(batch, params, waiting_for, self.run_plan.rollout.rollout.request_timeout_s)
        if self.agent is None:
            call = group.submit("generate_sequences", batch.select(PROMPT_KEYS + self.image_keys), params, release_after=release_after)
            return call.result(self.run_plan.rollout.rollout.request_timeout_s, waiting_for, REQUEST_TIMEOUT_KEY)
        out = self.agent.generate(group, batch, params)
        if release_after:
            group.sleep_rollout()
        return out

    def _reward_stages(self) -> list[Stage]:
        """The reward model (on its pool) and the driver's reward stage that combines it with the rule."""
        use_rm = self.roles.use_rm
        reward = functools.partial(driver_stages.reward, reward_fn=self.reward_fn, rm=self.cfg.reward_model, use_rm=use_rm,
                                   max_response_length=self.cfg.data.max_response_length)
        return [
            Stage("rm", self.rm.compute_rm_score if self.rm else None, ["responses", "response_mask", "raw_prompt"], ["rm_scores"], enabled=use_rm),
            Stage("reward", reward, REWARD_KEYS + (["rm_scores"] if use_rm else []) + (["agent_reward"] if self.agent is not None else []),
                  ["token_level_scores"]),
        ]

    def _reward_baseline(self, batch: Batch) -> Batch:
        """ReMax: the reward of the greedy response to the same prompt, one scalar per sample."""
        greedy = self.actor.generate_sequences(batch.select(PROMPT_KEYS + self.image_keys), dataclasses.replace(self._sampling(), do_sample=False))
        scores, _ = self.reward_fn(with_sample_info(greedy, batch))
        return Batch.from_dict(tensors={"reward_baselines": scores.sum(-1)})

    def _sync_rollout(self, batch: Batch | None = None) -> dict[str, float]:
        """Async rollout: the trained weights -> the rollout pool (the flow's "sync_weights" stage)."""
        return self.service.publish(self.global_step)

    def build_dataflow(self) -> DataFlow:
        a, roles, c = self.cfg.algorithm, self.roles, self.correction
        actor, ref, critic = self.actor, self.ref, self.critic
        actor_pool = self.pool_of(Role.ACTOR_ROLLOUT)
        images = self.image_keys  # a VLM's rows' image inputs, to generation and every training forward
        # multi-turn: a trajectory's images (the prompt's, then its tools' / environment's) replace the row's image inputs
        agent_keys = (["raw_prompt", "extra_info"] + self.raw_image_keys, ["agent_reward"] + images) if self.agent is not None else ([], [])
        routes = self._route_keys()
        gen_stages = [Stage("gen", self._generate, PROMPT_KEYS + images + agent_keys[0], GEN_OUTPUTS + agent_keys[1] + routes, pool=actor_pool)]
        # The trainer's old log-probs: recomputed when asked, with async rollout, for rollout correction
        # and for distillation (its advantage is teacher - student log-prob).
        recompute = self.run_plan.actor.actor.recompute_old_log_prob or roles.async_rollout or c.active or roles.use_teacher
        old_log_prob = Stage("old_log_prob", actor.compute_log_prob, TRAIN_KEYS + images + routes, ["old_log_probs"], enabled=recompute)
        sync = Stage("reshard", self.weight_sync.reshard, [], [], pool=actor_pool)
        if roles.async_rollout:  # generation happens outside the flow, one batch ahead (train_step)
            gen_stages = []
            if self.old_from_rollout:
                old_log_prob = Stage("old_log_prob", driver_stages.behaviour_log_probs, ["rollout_log_probs"], ["old_log_probs"])
            sync = Stage("sync_weights", self._sync_rollout, [], [], pool=actor_pool)
        correction_keys = ["rollout_is_weights", "rollout_rs_mask"] if c.active else []
        stages = [
            Stage("reward_baseline", self._reward_baseline, PROMPT_KEYS + SAMPLE_INFO_KEYS, ["reward_baselines"], enabled=a.adv_estimator == "remax",
                  pool=actor_pool),
            *gen_stages,
            *self._reward_stages(),
            old_log_prob,
            Stage("rollout_correction", functools.partial(driver_stages.rollout_correction, correction=c),
                  ["old_log_probs", "rollout_log_probs", "response_mask"], correction_keys, enabled=c.active),
            Stage("ref", ref.compute_ref_log_prob if ref else None, TRAIN_KEYS + images, ["ref_log_prob"], enabled=roles.ref_log_prob),
            Stage("teacher", self.teacher.compute_teacher_log_prob if self.teacher else None, TRAIN_KEYS, ["teacher_log_prob"], enabled=roles.use_teacher),
            Stage("values", critic.compute_values if critic else None, TRAIN_KEYS, ["values"], enabled=roles.use_critic),
            Stage("adv", functools.partial(driver_stages.advantage, a=a, kl_ctrl=self.kl_ctrl), driver_stages.advantage_inputs(a, roles.use_critic),
                  ["token_level_rewards", "advantages", "returns"]),
            Stage("update_critic", critic.update_critic if critic else None, TRAIN_KEYS + ["values", "returns"], [], enabled=roles.use_critic),
            Stage("update_actor", actor.update_actor, TRAIN_KEYS + images + routes + (["old_log_probs"] if recompute else []) + ["advantages"]
                  + (["ref_log_prob"] if roles.ref_log_prob else []) + correction_keys, []),
            sync,
        ]
        if a.filter_groups.enable:  # dynamic sampling: generation and reward run (maybe several times) before the rest
            sampling = {"gen", "rm", "reward"}
            self.sample_flow = DataFlow([s for s in stages if s.name in sampling])
            stages = [s for s in stages if s.name not in sampling]
        return DataFlow(stages)

    # ------------------------------------------------------------------ loop
    def _sampling(self, greedy: bool = False, step: int | None = None) -> SamplingParams:
        seed = self.cfg.trainer.seed * 100_003 + (self.global_step if step is None else step) + 1_000_003 * self._gen_round
        return self.run_plan.rollout.sampling_params(greedy, seed)

    def _prepare_batch(self) -> Batch:
        n = self.run_plan.rollout.rollout.n
        batch = self.loader.next_batch()
        # Group id per prompt, then n interleaved samples per prompt: [p0, p0, ..., p1, p1, ...].
        batch["uid"] = [f"{self.loader.epoch}-{self.loader.position}-{i}" for i in range(len(batch))]
        return batch.repeat(n, interleave=True)

    def _route_keys(self) -> list[str]:
        """MoE routing replay (actor.router_replay): the rollout's experts per token, to the actor's forwards."""
        return ["routed_experts"] if self.run_plan.actor.actor.router_replay.mode != "disabled" else []

    def _prepare_batch_keys(self) -> list[str]:
        """The keys a step's batch starts with (the loader's columns and the group ids)."""
        keys = PROMPT_KEYS + self.image_keys + self.raw_image_keys + SAMPLE_INFO_KEYS + ["uid"]
        if self.async_rollout:  # generated outside the flow (with its version per token; agents: their reward)
            keys += GEN_OUTPUTS + ["rollout_policy_version"] + (["agent_reward"] if self.agent is not None else []) + self._route_keys()
        if self.sample_flow is not None:  # dynamic sampling: generated and scored before the flow
            keys += [k for s in self.sample_flow.stages if s.enabled for k in s.outputs]
        return keys

    def _sample_groups(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """DAPO's dynamic sampling: generate and score `batch`, keep the groups whose rewards vary,
        and draw more prompts until data.train_batch_size groups are kept (the first ones, in order).
        After max_num_gen_batches rounds with fewer: the groups kept (`_underfilled`), or with
        algorithm.filter_groups.strict an error, as verl's."""
        fg, n = self.cfg.algorithm.filter_groups, self.run_plan.rollout.rollout.n
        want = self.cfg.data.train_batch_size * n  # rows
        kept: list[Batch] = []
        merged: dict[str, float] = {}  # the rounds' metrics
        generated = 0
        try:
            for self._gen_round in itertools.count():
                out, metrics = self.sample_flow.run(batch)
                generated += len(out)
                rule_ran = not self.roles.use_rm or self.cfg.reward_model.rule_weight
                values = driver_stages.group_values(out, fg.metric, self.reward_fn.last_scores if rule_ran else None,
                                                    self.reward_fn.last_extras if rule_ran else {})
                kept.append(out.index(driver_stages.varied_groups(values, out["uid"])))
                for k, v in metrics.items():  # the rounds' times add up; other metrics are the last round's
                    if k.startswith("perf/pool_busy"):
                        continue
                    k = "timing_s/sampling" if k == "timing_s/dataflow" else k
                    merged[k] = merged.get(k, 0.0) + v if k.startswith("timing_s/") else v
                have = sum(len(b) for b in kept)
                if have >= want:
                    break
                if 0 < fg.max_num_gen_batches <= self._gen_round + 1:
                    if fg.strict:
                        raise RuntimeError(
                            f"dynamic sampling (algorithm.filter_groups) kept {have // n} of the {want // n} groups a step needs after "
                            f"{self._gen_round + 1} generation rounds (max_num_gen_batches={fg.max_num_gen_batches}), and "
                            f"algorithm.filter_groups.strict=true stops the run there, as verl does: too many prompts have the same "
                            f"reward for every sample (all solved or all failed). Set algorithm.filter_groups.strict=false to train "
                            f"on the groups kept, raise algorithm.filter_groups.max_num_gen_batches (0 = no limit), raise "
                            f"actor_rollout_ref.rollout.n, or use data of a difficulty the policy sometimes solves")
                    break
                batch = self._prepare_batch()
            rounds = self._gen_round + 1
        finally:
            self._gen_round = 0
            self.actor.sleep_rollout()  # the generation buffers, kept over the rounds, are freed now
        out = Batch.concat(kept)
        out = out.index(slice(0, want)) if have >= want else self._underfilled(out, rounds)
        merged.update({"data/num_gen_batches": float(rounds), "data/kept_groups_frac": have / generated,
                       "data/train_groups": float(len(out) // n), "data/underfilled_batches": float(self.underfilled_batches)})
        return out, merged

    def _underfilled(self, kept: Batch, rounds: int) -> Batch:
        """The step's batch when dynamic sampling kept fewer groups than it needs: every kept group,
        less the fewest needed for the rows to split evenly over the data-parallel ranks of each
        update (the dispatch would otherwise pad, training some rows twice). Each mini-batch's loss
        is a mean over its own tokens / sequences (`agg_loss`, `micro_weight`), so a smaller batch
        needs no rescaling: its update has the same scale, from fewer samples."""
        fg, n = self.cfg.algorithm.filter_groups, self.run_plan.rollout.rollout.n
        self.underfilled_batches += 1
        groups, multiple = len(kept) // n, self._train_rows_multiple()
        step = multiple // math.gcd(multiple, n)  # groups whose rows split over `multiple` ranks come in steps of this
        usable = groups // step * step
        dropped = (f"; {groups - usable} more dropped so that the {usable * n} rows split evenly over {multiple} data-parallel "
                   f"ranks" if usable < groups else "")
        what = (f"training on {usable} group{'s' * (usable != 1)} ({usable * n} sequences){dropped}" if usable
                else f"no group left to train on{dropped}: the step's update is skipped")
        logger.warning("step %d: dynamic sampling kept %d of the %d groups a step needs after %d generation rounds "
                       "(algorithm.filter_groups.max_num_gen_batches=%d); %s (data/underfilled_batches=%d; "
                       "algorithm.filter_groups.strict=true stops instead)", self.global_step, groups, self.cfg.data.train_batch_size,
                       rounds, fg.max_num_gen_batches, what, self.underfilled_batches)
        return kept.index(slice(0, usable * n))

    def _train_rows_multiple(self) -> int:
        """Rows a training batch must be a multiple of: the data-parallel ranks of the actor's update
        (workers / (pp x tp)) and, with a critic, of its update."""
        a, c = self.run_plan.actor.actor, self.run_plan.critic.critic
        multiple = self.actor.world_size // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size)
        if getattr(self, "critic", None) is not None:
            multiple = math.lcm(multiple, self.critic.world_size // c.tensor_model_parallel_size)
        return multiple

    def _mark_prefetch(self) -> None:
        """The loader is about to hand out the next step's batch early: a checkpoint saves the state before it."""
        self._loader_state_at_prefetch = self.loader.state_dict()

    def _prefetch_next(self) -> None:
        """Overlap mode: the next step's batch, prepared while the workers reshard (none after the last step)."""
        if self.global_step < self.total_steps:
            self._mark_prefetch()
            self._next_batch = self._prepare_batch()

    def train_step(self, flow: DataFlow) -> dict[str, float]:
        start = time.perf_counter()
        if self.async_rollout:  # the batch generated during the previous step; the next one starts now
            batch, gen_metrics = self.service.take(self.global_step)
            batch.meta.update(trainer_version=self.global_step - 1, old_log_probs="rollout" if self.old_from_rollout else "trainer")
            batch, metrics = flow.run(batch)
            metrics.update(gen_metrics)
        else:
            batch = self._next_batch if self._next_batch is not None else self._prepare_batch()
            self._next_batch = None
            sampled: dict[str, float] = {}
            if self.sample_flow is not None:
                batch, sampled = self._sample_groups(batch)
                if not len(batch):  # dynamic sampling kept no group to train on (warned): no update this step
                    return {**sampled, "train/skipped_updates": 1.0, "timing_s/step": time.perf_counter() - start}
            batch, metrics = flow.run(batch)
            metrics.update(sampled)
        if self.weight_sync.pending is not None:  # overlapped: prepare the next batch, then collect
            metrics.update(self.weight_sync.finish_overlapped(self._prefetch_next))
        metrics["timing_s/step"] = time.perf_counter() - start
        if "timing_s/reshard" in metrics:
            metrics["reshard/comm_fraction"] = metrics["timing_s/reshard"] / metrics["timing_s/step"]
        metrics.update(compute_data_metrics(batch, self.actor.world_size, metrics["timing_s/step"]))
        return metrics

    def validate(self) -> dict[str, float]:
        """Greedy (val_kwargs) generation on the validation set; accuracy per data source."""
        if self.val_ds is None:
            return {}
        return validation.validate(self.run_plan.rollout.rollout.val_kwargs, self.cfg.data.val_batch_size, self.val_ds, self.collate,
                                   functools.partial(self._rollout_on, self.rollout), self.reward_fn,
                                   self._sampling(greedy=True))

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
        if self.sample_flow is not None:
            self.sample_flow.check(PROMPT_KEYS + SAMPLE_INFO_KEYS + ["uid"])
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
                if (alarm := self.mismatch_alarm.check(self.global_step, metrics)) is not None:
                    logger.warning(alarm)
                last = self.global_step == self.total_steps
                if t.test_freq > 0 and (self.global_step % t.test_freq == 0 or last):
                    val_metrics = self.validate()
                    metrics.update(val_metrics)
                # Logged before the checkpoint: a kill between the two then repeats the step's line after the
                # resume (readers keep a step's last line) instead of losing it (the resume starts after it).
                tracker.log(metrics, step=self.global_step)
                if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or last):
                    self.save_checkpoint()
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
        """The workers' parts and the trainer state of this step, written atomically (`checkpoints.py`)."""
        root = os.path.abspath(self.cfg.trainer.default_local_dir)
        tmp = checkpoints.begin(root, self.global_step, clear=self.is_main)  # rank 0 removes a partial one from a crash
        self.placed.barrier()
        self.actor.save_checkpoint(tmp)
        if self.critic:
            self.critic.save_checkpoint(tmp)
        if self.async_gen is not None and self.async_gen.pending:  # batches queued ahead: resume before the oldest
            loader_state = self.async_gen.resume_loader_state()
        else:
            loader_state = self._loader_state_at_prefetch if self._next_batch is not None else self.loader.state_dict()
        state = {"global_step": self.global_step, "loader": loader_state, "kl_ctrl": self.kl_ctrl.state_dict(),
                 "underfilled_batches": self.underfilled_batches, "run_keys": checkpoints.run_keys(self.cfg),
                 "mismatch_history": list(self.mismatch_alarm.history), **self._extra_state()}
        if self.is_main:
            checkpoints.commit(root, self.global_step, state, self.cfg.trainer.max_ckpt_to_keep)
        self.placed.barrier()  # torchrun: rank 0 completes the checkpoint before anyone goes on
        return checkpoints.step_dir(root, self.global_step)

    def _maybe_resume(self) -> None:
        path = checkpoints.resume_path(self.cfg.trainer)
        if path is None:
            return
        state = checkpoints.load_state(path)
        self.actor.load_checkpoint(path)
        if self.critic:
            self.critic.load_checkpoint(path)
        self.global_step = int(state["global_step"])
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.underfilled_batches = int(state.get("underfilled_batches", 0))  # a checkpoint from before the count: 0
        self.mismatch_alarm.history = list(state.get("mismatch_history", []))
        self._load_extra_state(state)
        if self.async_rollout:  # the rollout pool starts from the restored policy
            self._sync_rollout()
        logger.info("resumed from %s at step %d", path, self.global_step)
        if self.global_step >= self.total_steps:
            logger.warning("the checkpoint in %s is step %d of trainer.total_training_steps=%d: this run is complete, nothing to "
                           "train. Raise trainer.total_training_steps to go on; to start over, give trainer.default_local_dir "
                           "another directory or set trainer.resume_mode=disable", self.cfg.trainer.default_local_dir,
                           self.global_step, self.total_steps)

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


def _progress(enabled: bool, total: int, initial: int):
    if not enabled or not sys.stderr.isatty():  # a bar in a log file interleaves with the step table
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="rl steps", unit="step", dynamic_ncols=True, leave=False)
