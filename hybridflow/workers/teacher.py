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

from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker
from hybridflow.parallel.process_group import pick_device
from hybridflow.engine import TrainEngine
from hybridflow.models.hf import load_hf_model
from hybridflow.parallel.layout import train_mesh
from hybridflow.protocol import Batch
from hybridflow.run_plan import TeacherSpec


class TeacherWorker(Worker):
    def __init__(self, spec: TeacherSpec):
        """spec: the teacher's (`run_plan.resolve(cfg).teacher`)."""
        super().__init__()
        self.spec = spec
        self.device = pick_device(spec.process.device)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        spec = self.spec
        self.init_process_group(self.device, spec.process.collective_timeout_s)
        torch.manual_seed(spec.process.seed)
        mesh = train_mesh(spec.layout, self.device)  # FSDP over the pool
        self.model = TrainEngine(load_hf_model(spec.model, self.device).requires_grad_(False), mesh, self.device, spec.fsdp,
                                 remove_padding=spec.remove_padding, logits_chunk=spec.model.logprob_chunk())
        self.micro = spec.micro_batch_size

    @register(Dispatch.DP_COMPUTE)
    def compute_teacher_log_prob(self, data: Batch) -> Batch:
        """teacher_log_prob [b, R] of the sampled responses."""
        logp, _ = self.model.log_probs(data, self.micro, None, float(data.meta.get("temperature", 1.0)))
        return Batch.from_dict(tensors={"teacher_log_prob": logp.cpu()})
