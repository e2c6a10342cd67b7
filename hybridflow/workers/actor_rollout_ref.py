"""The actor, its rollout and the frozen reference policy, colocated in one process per rank.

- actor: the HF model sharded with FSDP2 over the group (each rank stores ~1/N of it), AdamW,
  warm-up schedule, gradient clipping, micro-batch gradient accumulation; PPO update and SFT step.
- rollout: the same HF model in the generation layout: tensor-parallel over gen_tp ranks
  (DTensor, `parallel/tensor_parallel.py`), gen_dp = N / gen_tp replicas generating different
  prompts with `generate` (temperature/top-p/top-k/n). After every actor update the
  3D-HybridEngine (`hybrid_engine/`) moves only what each rank lacks of its generation slices
  into the rollout's buffers; FSDP2 shards each parameter along its generation TP dim so that a
  micro-DP all-gather suffices. The buffers are released after rollout.
- ref: a frozen FSDP2 copy of the initial policy, for the KL term (and DPO's reference).
- DPO (`workers/preference.py`): sequence log-probs of chosen/rejected pairs and the DPO update.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import os

import torch
from transformers import AutoTokenizer

from hybridflow.algorithms import masked_mean
from hybridflow.algorithms.objectives import DPOLoss, PPOLoss, SFTLoss
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.config.pools import ModelPart, worker_role
from hybridflow.controller.worker import Worker
from hybridflow.parallel.process_group import pick_device
from hybridflow.engine import TrainEngine
from hybridflow.engine.model import trim_right_padding
from hybridflow.hybrid_engine import cross_pool
from hybridflow.hybrid_engine.delta import DeltaSender
from hybridflow.utils.memory import rss_bytes
from hybridflow.models.hf import DTYPES, load_hf_model
from hybridflow.models.lora import adapters_disabled, apply_lora
from hybridflow.models.moe import RouterMonitor, recording
from hybridflow.models.vlm_inputs import MULTI_MODAL_KEY, VISION_TOWER_PATTERNS
from hybridflow.models.routing import RouteReplayer
from hybridflow.parallel.fsdp import shard_numel
from hybridflow.parallel.layout import train_mesh
from hybridflow.parallel.tensor_parallel import gen_shard_dims
from hybridflow.protocol import Batch
from hybridflow.run_plan import ActorSpec, UpdatePlan
from hybridflow.rollout.base import RolloutContext, make_rollout
from hybridflow.workers.preference import PreferenceMixin
from hybridflow.workers.rollout import RolloutMixin


class ActorRolloutRefWorker(RolloutMixin, PreferenceMixin, Worker):
    """role: "actor_rollout_ref" / "actor_rollout" (RL, with / without the reference), "actor_ref" /
    "actor" (the rollout on another pool; "actor" is also SFT), "ref" (the reference alone)."""

    def __init__(self, spec: ActorSpec, role: "str | frozenset[ModelPart]" = "actor_rollout_ref", total_training_steps: int = 1):
        """spec: the policy's (`run_plan.resolve(cfg).actor`), with its pool's layout."""
        super().__init__()
        self.spec = spec
        self.total_training_steps = total_training_steps
        self.device = pick_device(spec.process.device)
        # What this process holds: a set of ModelPart (the trainer's typed roles), or the role string
        # ("actor_rollout_ref", "actor_rollout", "actor_ref", "actor", "ref") that names the same set.
        parts = frozenset(ModelPart(p) for p in role.split("_")) if isinstance(role, str) else frozenset(role)
        self.role = worker_role(parts)  # validates the combination
        self.has_actor = ModelPart.ACTOR in parts
        self.has_rollout = ModelPart.ROLLOUT in parts
        self.has_ref = ModelPart.REF in parts
        self.remove_padding = spec.model.use_remove_padding
        # The actor's 3D layout (the spec's); the colocated reference shares it (same workers, same
        # data split), a reference on a pool of its own ("ref") scores with FSDP over that pool. The
        # rollout backend adds its generation layout (`_init_rollout`).
        self.train_layout = spec.layout if self.has_actor else spec.ref.layout
        if self.train_layout.world != self.world_size:
            raise ValueError(f"the {self.role} spec is for {self.train_layout.world} ranks ({self.train_layout}), this group has "
                             f"{self.world_size}: build the spec with run_plan.resolve(cfg) for the config the group was placed from")
        self.dims = None  # this rank's TrainMesh (parallel/layout.py), set by init_model
        self.actor: TrainEngine | None = None  # the trained policy (has_actor)
        self.ref: TrainEngine | None = None  # the frozen reference (has_ref)

    def dispatch_layout(self, layout: str | None) -> tuple[int, int, bool]:
        """"train": split over dp (FSDP layout: every rank its own chunk), `ParallelDims.dispatch`."""
        if layout == "train":
            return self.train_layout.dispatch(self.rank)
        return super().dispatch_layout(layout)

    @property
    def dp_size(self) -> int:
        return self.train_layout.dp

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.init_process_group(self.device, self.spec.process.collective_timeout_s)
        torch.manual_seed(self.spec.process.seed)
        mcfg = self.spec.model
        self.tokenizer = AutoTokenizer.from_pretrained(mcfg.tokenizer_source())
        self.dims = train_mesh(self.train_layout, self.device)
        if self.has_actor:
            self._init_actor(mcfg)
        if self.has_rollout:
            self._init_rollout(mcfg)
        if self.has_ref:
            self.ref = TrainEngine(load_hf_model(mcfg, self.device), self.dims, self.device, self.spec.ref.fsdp_config,
                                   pipeline_schedule=self.spec.actor.pipeline_schedule, remove_padding=self.remove_padding,
                                   logits_chunk=mcfg.logprob_chunk(), compile=self.spec.ref.use_torch_compile)

    def _init_actor(self, mcfg) -> None:
        acfg = self.spec.actor
        model = apply_lora(load_hf_model(mcfg, self.device), mcfg)  # LoRA: only the adapters train
        frozen = [*acfg.freeze_modules, *(VISION_TOWER_PATTERNS if mcfg.freeze_vision_tower else ())]
        for name, p in model.named_parameters():  # frozen: no gradient, no optimizer state, synced once
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in frozen):
                p.requires_grad_(False)
        self.gen_dims = gen_shard_dims(model)
        self.router = RouterMonitor.attach(model, mcfg.router_aux_loss_coef)  # MoE: expert load, aux loss (models/moe.py); None if dense
        if acfg.router_replay.mode != "disabled":  # MoE: forwards on a batch with routed_experts use the rollout's experts (models/routing.py)
            RouteReplayer(model)
        he = self.spec.hybrid_engine  # delta sync of the cross-pool sync: what this rank sent last (hybrid_engine/delta.py)
        self.delta_sender = DeltaSender(he.delta_full_every) if he.delta_sync else None
        self.gen_dtype = DTYPES[self.spec.rollout.generation_dtype]  # what a rollout pool holds (async: publish casts to it)
        self.actor = TrainEngine(model, self.dims, self.device, acfg.fsdp_config, optim=acfg.optim, total_steps=self.total_training_steps,
                                 grad_clip=acfg.grad_clip, pipeline_schedule=acfg.pipeline_schedule, remove_padding=self.remove_padding,
                                 exact=self.spec.rollout.rollout.exact, logits_chunk=mcfg.logprob_chunk(), compile=acfg.use_torch_compile)
        # The objectives this worker trains with, built once: PPO (RL), SFT, DPO (`workers/preference.py`).
        self.ppo_loss = PPOLoss.of(acfg)
        self.sft_loss = SFTLoss(self.dp_size, self.dims.dp_group)
        dpo = self.spec.dpo
        self.dpo_loss = DPOLoss(dpo.beta, dpo.loss_type, dpo.label_smoothing, self.world_size)

    def _init_rollout(self, mcfg) -> None:
        """The colocated rollout backend, by name, and the hybrid engine that feeds it: the
        engine writes into the backend's own storages when it offers them (HF), else stages this
        rank's slices for it (vLLM); the worker calls only the backend's interface."""
        ctx = RolloutContext(self.spec.rollout, self.tokenizer, self.device, self.rank, self.world_size, self.train_layout, self.gen_dims)
        self.rollout = make_rollout(self.spec.rollout.name, ctx)
        if self.spec.rollout.rollout.exact and self.spec.rollout.rollout.tensor_model_parallel_size > 1:
            # Exact at gen_tp = N: a TP sampler would sum its row-parallel products in other pieces than
            # the trainer's matmuls, so it samples with the training engine's own module (every rank
            # in step: one replica, the same requests and seeds) - the trainer's kernels by construction.
            self.rollout.exact_model = self.actor.module
        lay = self.rollout.layout()
        self.hybrid = self.actor.attach_generation(lay.buffers, lay.shard_dims, lay.gen_tp, self.spec.hybrid_engine, lay.consecutive,
                                                   lay.dtype)
        self.plan = self.hybrid.plan

    # ------------------------------------------------------------------ weight sync
    @register(Dispatch.ONE_TO_ALL)
    def reshard(self, measure_baseline: bool = False, check: bool = False, trace: bool = False) -> dict:
        """Training -> generation layout: the engine's pieces pushed into the rollout backend.
        measure_baseline also runs (and times) the naive path first; check compares every
        generation parameter with the trained weights (`HybridEngine.max_abs_diff`; not for staged
        pieces: vLLM repacks them, its check is the log-prob agreement); trace returns Chrome-trace
        events. Measured stats of this rank."""
        hybrid = self.hybrid
        hybrid.trace.enabled = trace
        out: dict = {}
        if measure_baseline:
            out["baseline"] = hybrid.reshard(optimized=False)
        self.rollout.wake()
        loaded = self.rollout.update_weights(self.actor.weights(optimized=self.spec.hybrid_engine.enable_resharding_opt))
        out.update(hybrid.last_stats)
        out.update(loaded)  # the backend's own stats (copied / loaded bytes, load time): no key of the engine's
        if check and not hybrid.staged:
            out["max_diff"] = hybrid.max_abs_diff()
        out["rss_bytes"] = rss_bytes()
        if trace:
            out["trace"] = hybrid.trace.drain()
        return out

    @register(Dispatch.ONE_TO_ALL)
    def publish_weights(self, gen_tp: int, dst_world: int) -> list:
        """For a rollout pool of `dst_world` ranks: object refs, one per generation rank, holding
        exactly the pieces of this rank's shards that generation rank needs (`cross_pool`)."""
        return cross_pool.publish(self.actor.module, self.gen_dims, self.rank, self.world_size, gen_tp, dst_world, self.gen_dtype,
                                  self.delta_sender)

    @register(Dispatch.RANK_ZERO)
    def weight_fingerprints(self, gen_tp: int, dst_world: int) -> dict[str, str]:
        """Digests of every generation slice of the trained weights (a collective: all ranks run it)."""
        return cross_pool.trained_fingerprints(self.actor.module, self.gen_dims, gen_tp, dst_world, self.gen_dtype)

    @register(Dispatch.RANK_ZERO)
    def reshard_plan(self) -> dict:
        """The plan's per-rank volumes and the staging the switch uses (`hybrid_engine/staging.py`:
        layers in flight, staging bytes per rank, and the one-line note the driver logs)."""
        s = self.hybrid.staging_plan
        staging = {"slots": s.slots, "bytes_per_rank": [s.staging_bytes(r) for r in range(self.plan.world_size)], "note": s.note,
                   "honoured": s.honoured}
        return dict(self.plan.summary(self.hybrid.frozen), staging=staging)

    @register(Dispatch.ONE_TO_ALL)
    def rollout_weight_max_diff(self) -> float:
        """max |generation buffer - matching slice of the trained weights| (0.0 after a correct reshard)."""
        return self.hybrid.max_abs_diff()

    @register(Dispatch.ONE_TO_ALL)
    def shard_stats(self) -> dict[str, int]:
        """This rank's share of the model, and its trainable state in bytes: parameters, gradients
        (allocated for the trainable parameters during backward) and optimizer state."""
        local, total = shard_numel(self.actor.module)
        return {"local_numel": local, "total_numel": total, **self.actor.trainable_state_bytes()}

    # ------------------------------------------------------------------ log-probs
    @register(Dispatch.DP_COMPUTE, layout="train")
    def compute_log_prob(self, data: Batch) -> Batch:
        """old_log_probs [b, R] under the current policy (before this step's update)."""
        r = self.spec.rollout.rollout
        replayer = getattr(self.actor.module, "_route_replayer", None)  # MoE routing replay (models/routing.py)
        if replayer is not None:
            replayer.take_counts()
        logp, ent = self.actor.log_probs(data, r.log_prob_micro_batch_size_per_gpu, r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None,
                                         float(data.meta.get("temperature", 1.0)), with_entropy=True)
        if logp is None:  # an earlier pipeline stage: nothing to report
            return Batch.from_dict(tensors={"old_log_probs": torch.zeros(data["responses"].shape)})
        mask = data["response_mask"].to(logp.device)
        metrics = {"actor/entropy": float(masked_mean(ent, mask))}
        if replayer is not None:  # this rank's share of replayed (token, layer) pairs whose own experts were others than the rollout's
            replayed, differing = replayer.take_counts()
            metrics["actor/router_replay/differs"] = differing / max(replayed, 1)
        return Batch.from_dict(tensors={"old_log_probs": logp.cpu()}, meta={"metrics": metrics})

    @register(Dispatch.DP_COMPUTE, layout="train")
    def compute_ref_log_prob(self, data: Batch) -> Batch:
        """The reference policy's log-probs: the reference model, or (LoRA) the actor with its adapters off."""
        r = self.spec.ref
        engine = self.ref if self.ref is not None else self.actor
        with contextlib.nullcontext() if self.ref is not None else adapters_disabled(self.actor.module):
            logp, _ = engine.log_probs(data, r.log_prob_micro_batch_size_per_gpu, r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None,
                                       float(data.meta.get("temperature", 1.0)))
        return Batch.from_dict(tensors={"ref_log_prob": (torch.zeros(data["responses"].shape) if logp is None else logp.cpu())})

    # ------------------------------------------------------------------ training
    @functools.cached_property
    def update_plan(self) -> UpdatePlan:
        """The PPO update's rows per rank (first used by update_actor: a DPO or SFT run has no rollout.n)."""
        return self.spec.update_plan(self.train_layout.data_parallel)  # per data rank: the sp ranks of a group share rows

    @register(Dispatch.DP_COMPUTE, layout="train")
    def update_actor(self, data: Batch, optimizer_step: bool = True, loss_scale: float = 1.0) -> dict[str, float]:
        """PPO-style update on this rank's share of the step's sequences (`TrainEngine.train` walks
        the mini-batches of ppo_mini_batch_size * n / dp sequences, each one optimizer step).

        data: input_ids/attention_mask/position_ids [b, P+R], responses/response_mask/
        old_log_probs/advantages [b, R] (+ ref_log_prob when use_kl_loss, rollout_is_weights /
        rollout_rs_mask with rollout correction). optimizer_step=False only accumulates (loss x
        loss_scale) for DataFlow's grad_accum_steps.
        """
        with recording(self.router, data, self.update_plan, "actor/moe") as moe:
            metrics = self.actor.train(data, self.ppo_loss, self.update_plan, temperature=float(data.meta.get("temperature", 1.0)),
                                       optimizer_step=optimizer_step, loss_scale=loss_scale)
        return {**metrics, **moe}

    @register(Dispatch.DP_COMPUTE, layout="train")
    def sft_step(self, data: Batch) -> dict[str, float]:
        """One SFT optimizer step: mean token NLL over the loss tokens (loss_mask [b, L]), normalised
        by the GLOBAL number of loss tokens (`SFTLoss`)."""
        # SFTDataset right-pads rows to max_length: compute only up to the rank's longest row.
        t = trim_right_padding(data, ("input_ids", "attention_mask", "position_ids", "loss_mask"))
        # The next-token view: the logits at t predict token t+1, i.e. "responses" = input_ids[:, 1:].
        view = Batch.from_dict(tensors={"input_ids": t["input_ids"], "attention_mask": t["attention_mask"], "position_ids": t["position_ids"],
                                        "responses": t["input_ids"][:, 1:], "loss_mask": t["loss_mask"][:, 1:].float()},
                               non_tensors={MULTI_MODAL_KEY: data[MULTI_MODAL_KEY]} if MULTI_MODAL_KEY in data else None)  # a VLM's images
        with recording(self.router, view, self.spec.sft_plan(), "train/moe") as moe:
            metrics = self.actor.train(view, self.sft_loss, self.spec.sft_plan())
        metrics.update(moe)
        metrics.setdefault("train/loss", 0.0)  # an earlier pipeline stage never sees the loss
        return metrics

    # ------------------------------------------------------------------ checkpoints
    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.actor.save(os.path.join(path, "actor"))

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.actor.load(os.path.join(path, "actor"))
        if self.has_rollout:
            self.reshard()

    @register(Dispatch.RANK_ZERO)
    def save_hf_model(self, out_dir: str) -> str:
        """Gather the full weights and write an HF checkpoint (+ tokenizer; a VLM's processor) from rank 0."""
        from hybridflow.models.vlm import is_vlm_dir, load_processor

        path = self.spec.model.path
        # a VLM's processor (image processor + tokenizer + chat template) writes the tokenizer too: what AutoProcessor reads back
        return self.actor.save_hf(out_dir, load_processor(path) if is_vlm_dir(path) else self.tokenizer, self.rank)
