"""Generation on a worker: the part every rollout-holding worker shares, and the generation-only
rollout worker of async rollout (its own pool, weights received from the actor's pool).

`RolloutMixin` gives a worker the generation layout (gen_tp x gen_dp over its group) and the
`generate_sequences` entry point over a `RolloutBackend`; the actor worker (colocated rollout,
fed by the hybrid engine) and `RolloutWorker` (a pool of its own) both use it.
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from hybridflow.config.schema import HybridFlowConfig
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker, pick_device
from hybridflow.hybrid_engine.cross_pool import PoolReceiver
from hybridflow.parallel.tensor_parallel import apply_tensor_parallel, gen_mesh, gen_ranks, gen_shard_dims
from hybridflow.protocol import Batch
from hybridflow.rollout.base import RolloutBackend, SamplingParams
from hybridflow.workers.fsdp_model import load_hf_model


class RolloutMixin:
    rollout: RolloutBackend
    rank: int
    world_size: int

    def _set_gen_layout(self, gen_tp: int, train_layout=None, consecutive: bool = False) -> None:
        """train_layout: the colocated actor's `TrainLayout` (None: FSDP over the group), which
        decides the generation groups (HybridFlow's grouping, `plan.gen_coords`); consecutive: TP
        groups of consecutive ranks instead (vLLM's external launcher)."""
        self.gen_tp = gen_tp
        self.gen_dp_size = self.world_size // gen_tp
        self.gen_train_layout = train_layout
        if consecutive:
            self.tp_index, self.dp_index = self.rank % gen_tp, self.rank // gen_tp
        else:
            self.tp_index, self.dp_index = gen_ranks(self.rank, self.world_size, gen_tp, train_layout)

    def _tp_model(self, mcfg, device: str) -> torch.nn.Module:
        """The policy's HF model in the generation layout (tensor-parallel over gen_tp ranks)."""
        model = load_hf_model(mcfg, device).eval().requires_grad_(False)
        if self.gen_tp > 1:
            apply_tensor_parallel(model, gen_mesh(device, self.world_size, self.gen_tp, self.gen_train_layout)["tp"])
        return model

    def dispatch_layout(self, layout: str | None) -> tuple[int, int, bool]:
        """Generation splits prompts over gen_dp replicas; the gen_tp ranks of one replica share them."""
        if layout == "rollout":
            return self.dp_index, self.gen_dp_size, self.tp_index == 0
        return super().dispatch_layout(layout)

    @register(Dispatch.DP_COMPUTE, layout="rollout")
    def generate_sequences(self, prompts: Batch, params: SamplingParams, release_after: bool = False) -> Batch:
        """prompts: input_ids/attention_mask [b, P] left-padded. Returns responses, masks and
        rollout log-probs (`rollout.base.rollout_batch`). release_after frees the generation
        memory once done (the next weight sync re-acquires it)."""
        out = self.rollout.generate(prompts, params)
        if release_after:  # generation -> training: frees buffers, moves nothing
            self.rollout.release()
        return out


    @register(Dispatch.DP_COMPUTE, layout="rollout")
    def generate_requests(self, data: Batch) -> Batch:
        """Request-level generation (the agent loop's entry point): data holds one `Request` per
        row in its "request" column; returns the `Completion`s in a "completion" column."""
        return Batch.from_dict(non_tensors={"completion": self.rollout.generate_requests(list(data["request"]))})


class RolloutWorker(RolloutMixin, Worker):
    """A generation-only pool (trainer.async_rollout): the HF backend whose weight source is a
    `PoolReceiver`; the actor's pool publishes its shards after every update."""

    def __init__(self, config: HybridFlowConfig):
        super().__init__()
        self.cfg = config
        self.device = pick_device(config.trainer.device)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hybridflow.rollout.hf_rollout import HFRollout

        self.init_process_group(self.device, self.cfg.trainer.collective_timeout_s)
        mcfg = self.cfg.actor_rollout_ref.model
        self.tokenizer = AutoTokenizer.from_pretrained(mcfg.tokenizer_path or mcfg.path)
        self._set_gen_layout(self.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
        model = self._tp_model(mcfg, self.device)
        self.receiver = PoolReceiver(model, gen_shard_dims(model), self.gen_tp, self.rank, self.world_size)
        self.rollout = HFRollout(model, self.tokenizer, self.device, self.dp_index, self.receiver)

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, refs_by_src: list[list], check: bool = False) -> dict:
        """Copy this rank's pieces of the trained weights (object refs from `publish_weights`)."""
        self.receiver.stage(refs_by_src)
        return self.rollout.sync_weights(check=check)

    @register(Dispatch.ONE_TO_ALL)
    def weight_fingerprints(self) -> dict[str, str]:
        return self.receiver.fingerprints()

    @register(Dispatch.RANK_ZERO)
    def weight_version(self) -> int:
        return self.receiver.version
