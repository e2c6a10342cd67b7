"""On-policy distillation's teacher: a frozen causal LM on FSDP2 that scores the student's tokens.

`compute_teacher_log_prob` takes the student's sampled sequences (input_ids / attention_mask /
position_ids [b, P+R], responses / response_mask [b, R]) and returns teacher_log_prob [b, R]: the
teacher's log-probability of each sampled token under the sampling temperature, the same quantity
the student's old_log_probs are, so `teacher_log_prob - old_log_probs` is minus the per-token
reverse-KL estimate (`algorithms/advantages.py`, on_policy_distill). The teacher shares the
student's tokenizer (checked before any worker starts), so the ids need no re-tokenizing.
"""

from __future__ import annotations

import torch

from hybridflow.config.schema import FSDPConfig, ModelConfig
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker
from hybridflow.parallel.process_group import pick_device
from hybridflow.engine import TrainEngine
from hybridflow.models.hf import load_hf_model
from hybridflow.parallel.dims import ParallelDims
from hybridflow.parallel.layout import train_mesh
from hybridflow.protocol import Batch


class TeacherWorker(Worker):
    def __init__(self, model: ModelConfig, fsdp: FSDPConfig, micro_batch_size: int, device: str = "auto", seed: int = 1,
                 remove_padding: bool = False, collective_timeout_s: float = 600.0):
        super().__init__()
        self.model_cfg, self.fsdp_cfg, self.micro = model, fsdp, micro_batch_size
        self.device = pick_device(device)
        self.seed, self.remove_padding, self.collective_timeout_s = seed, remove_padding, collective_timeout_s

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.init_process_group(self.device, self.collective_timeout_s)
        torch.manual_seed(self.seed)
        mesh = train_mesh(ParallelDims(dp=self.world_size), self.device)  # FSDP over the pool
        self.model = TrainEngine(load_hf_model(self.model_cfg, self.device).requires_grad_(False), mesh, self.device, self.fsdp_cfg,
                                 remove_padding=self.remove_padding)

    @register(Dispatch.DP_COMPUTE)
    def compute_teacher_log_prob(self, data: Batch) -> Batch:
        """teacher_log_prob [b, R] of the sampled responses."""
        logp, _ = self.model.log_probs(data, self.micro, None, float(data.meta.get("temperature", 1.0)))
        return Batch.from_dict(tensors={"teacher_log_prob": logp.cpu()})
