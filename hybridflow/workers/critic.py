"""The critic: the policy's backbone class with a 1-output token head (V(s) per position), FSDP2.

Values follow verl's convention: the value of response token j is read at the position that
predicts it (P-1+j), i.e. the state before token j is generated.
"""

from __future__ import annotations

import os

import torch

from hybridflow.algorithms.objectives import ValueLoss
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker
from hybridflow.parallel.process_group import pick_device
from hybridflow.engine import TrainEngine
from hybridflow.engine.model import response_logits
from hybridflow.models.hf import load_hf_model
from hybridflow.models.lora import apply_lora
from hybridflow.parallel.layout import train_mesh
from hybridflow.protocol import Batch
from hybridflow.run_plan import CriticSpec


class CriticWorker(Worker):
    def __init__(self, spec: CriticSpec, total_training_steps: int = 1):
        """spec: the critic's (`run_plan.resolve(cfg).critic`)."""
        super().__init__()
        self.spec = spec
        self.total_training_steps = total_training_steps
        self.device = pick_device(spec.process.device)
        self.layout = spec.layout  # critic.tensor_model_parallel_size x FSDP over the critic's pool

    def dispatch_layout(self, layout: str | None) -> tuple[int, int, bool]:
        """"train": split over dp, the TP ranks of a dp group share a chunk (`ParallelDims.dispatch`)."""
        if layout == "train":
            return self.layout.dispatch(self.rank)
        return super().dispatch_layout(layout)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.init_process_group(self.device, self.spec.process.collective_timeout_s)
        ccfg, mcfg = self.spec.critic, self.spec.model  # mcfg: the critic's model, or the actor's when unset
        torch.manual_seed(self.spec.process.seed)
        # LoRA (critic.model.lora_rank): adapters on the backbone, the new value head `score` trained in full.
        # TP on the backbone (the value head is not in the TP table: replicated), then FSDP over dp
        model = apply_lora(load_hf_model(mcfg, self.device, kind="value"), ccfg.model, full=("score",))
        self.critic = TrainEngine(model, train_mesh(self.layout, self.device), self.device,
                                  ccfg.fsdp_config, optim=ccfg.optim, total_steps=self.total_training_steps, grad_clip=ccfg.grad_clip)
        self.update_plan = self.spec.update_plan(self.layout.dp)
        self.value_loss = ValueLoss(ccfg.cliprange_value, ccfg.loss_agg_mode)

    def _values(self, module, mb: Batch) -> torch.Tensor:
        return response_logits(module, mb, remove_padding=self.spec.critic.model.use_remove_padding).squeeze(-1) * mb["response_mask"]  # [b, R]

    @register(Dispatch.DP_COMPUTE, layout="train")
    def compute_values(self, data: Batch) -> Batch:
        values = self.critic.forward(data, self._values, self.spec.critic.ppo_micro_batch_size_per_gpu)
        return Batch.from_dict(tensors={"values": values.cpu()})

    @register(Dispatch.DP_COMPUTE, layout="train")
    def update_critic(self, data: Batch, optimizer_step: bool = True, loss_scale: float = 1.0) -> dict[str, float]:
        """Clipped value regression towards `returns` [b, R] (`ValueLoss`); mini/micro batching and
        gradient accumulation across calls (optimizer_step / loss_scale) as the actor."""
        return self.critic.train(data, self.value_loss, self.update_plan, head=self._values, optimizer_step=optimizer_step, loss_scale=loss_scale)

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.critic.save(os.path.join(path, "critic"))

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.critic.load(os.path.join(path, "critic"))
