"""A model as an `add_stage` module: the flow places it on a pool of its own and calls it.

    flow = DataFlow(config=cfg)
    flow.add_stage("rollout", "runs/sft_model", PROMPT_KEYS, GEN_OUTPUTS, num_workers=2)
    flow.add_stage("old_log_prob", "runs/sft_model", TRAIN_KEYS, ["old_log_probs"])
    flow.add_stage("update", "runs/sft_model", TRAIN_KEYS + ["old_log_probs", "advantages"], [])

Every stage naming the same model (a local HF checkpoint path, or a `PreTrainedModel`, which is
saved to a temporary checkpoint first) shares ONE worker group: `num_workers` processes running
the actor/rollout(/ref) worker with FSDP2 and the hybrid engine, on a pool named after the model.
What a stage does follows from its declared outputs (or `method=`): `responses` -> generate
(sampling from `actor_rollout_ref.rollout`), `old_log_probs` -> log-probs, `ref_log_prob` ->
reference log-probs, no outputs -> the PPO update. After an update the next generation first
syncs the trained weights into the generation layout (the reshard), so a flow never samples from
stale weights. `flow.close()` stops the groups.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

from hybridflow.config.schema import HybridFlowConfig
from hybridflow.protocol import Batch

METHOD_BY_OUTPUT = {"responses": "generate_sequences", "old_log_probs": "compute_log_prob", "ref_log_prob": "compute_ref_log_prob"}


def is_model(module: Any) -> bool:
    if isinstance(module, (str, os.PathLike)):
        return os.path.isfile(os.path.join(str(module), "config.json"))
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, PreTrainedModel)


def stage_method(outputs: list[str], method: str | None) -> str:
    if method:
        return method
    for key, m in METHOD_BY_OUTPUT.items():
        if key in outputs:
            return m
    return "update_actor"


class PolicyGroup:
    """One model's worker group, created by the flow on a pool of `num_workers` workers."""

    def __init__(self, cfg: HybridFlowConfig, model: Any, num_workers: int):
        from hybridflow.config import validate_config
        from hybridflow.config.derive import derive_defaults
        from hybridflow.config.schema import PoolSpec
        from hybridflow.config.pools import ModelPart, needs_ref_log_prob, ref_is_actor
        from hybridflow.trainer.placement import start_groups
        from hybridflow.run_plan import resolve
        from hybridflow.trainer.roles import policy_worker

        self._tmp = self.placed = None
        if not isinstance(model, (str, os.PathLike)):  # a PreTrainedModel: give the workers a checkpoint
            self._tmp = tempfile.TemporaryDirectory(prefix="hybridflow_model_")
            model.save_pretrained(self._tmp.name)
            model = self._tmp.name
        self.path = os.path.abspath(str(model))
        cfg = cfg.with_policy_model(self.path)
        if cfg.policy_tokenizer_path() == self.path and not os.path.exists(os.path.join(self.path, "tokenizer_config.json")):
            raise ValueError(f"model {self.path} has no tokenizer; set actor_rollout_ref.model.tokenizer_path in the flow's config")
        cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node = 1, num_workers
        cfg.resource_pool.pools, cfg.resource_pool.mapping = {}, {}
        cfg = derive_defaults(cfg)  # unset batch sizes from num_workers
        validate_config(cfg)  # batch sizes against num_workers, the model, ... before any worker starts
        self.cfg, self.run_plan = cfg, resolve(cfg)
        use_ref = needs_ref_log_prob(cfg) and not ref_is_actor(cfg)
        worker = policy_worker(self.run_plan.actor, {ModelPart.ACTOR, ModelPart.ROLLOUT} | ({ModelPart.REF} if use_ref else set()))
        # Unique per checkpoint path (two models in folders of the same name must not share actor names).
        name = f"model_{os.path.basename(self.path.rstrip('/'))}_{hashlib.sha1(self.path.encode()).hexdigest()[:8]}_{os.getpid()}"
        try:
            # Always Ray workers: each model is a pool of its own, and the flow runs stages of
            # different pools at the same time (torchrun has one process group for all of them).
            self.placed = start_groups(cfg.trainer, cfg.ray_init, {name: PoolSpec(workers_per_node=num_workers)},
                                       lambda pool, procs_per_node: {"actor": worker}, launcher="ray")
            self.pool, self.group = self.placed.pools[name], self.placed.groups[name]
            self.actor = self.group.role("actor")
            self.actor.init_model()
        except BaseException:
            self.close()
            raise
        self.stale = False  # trained since the last sync into the generation layout
        self.calls = 0

    def stage_fn(self, method: str):
        """The stage function calling `method` on this group (with the pool name the scheduler reads)."""

        if method == "generate_sequences":

            def fn(batch: Batch) -> Batch:
                if self.stale:
                    self.actor.reshard()
                    self.stale = False
                self.calls += 1
                params = self.run_plan.rollout.sampling_params(seed=self.cfg.trainer.seed * 100_003 + self.calls)
                return self.actor.generate_sequences(batch, params)
        elif method == "update_actor":

            def fn(batch: Batch, **kwargs):
                self.stale = True
                return self.actor.update_actor(batch, **kwargs)
        else:
            fn = getattr(self.actor, method)
        fn.pool_name = self.pool.name
        return fn

    def close(self) -> None:
        if self.placed is not None:
            self.placed.shutdown()  # the group, then its pool
        if self._tmp is not None:
            self._tmp.cleanup()
