"""Pipeline-parallel training of an HF decoder-only LM with `torch.distributed.pipelining`.

`StageLM` keeps one stage's part of the model under the HF parameter names (so checkpoints, the
resharding planner and the generation model agree on every FQN): the decoder layers
[stage * L/pp, (stage + 1) * L/pp) in a ModuleDict keyed by their global index, the embeddings on
the first stage, the final norm and lm_head on the last. Its forward mirrors the HF model's
(causal mask from `create_causal_mask`, rotary embeddings on every stage) and the last stage
returns `head(logits, targets)`, per-token values of `targets` [b, T, k] (the engine's head gives
(log-prob, entropy), k = 2) instead of logits [b, T, V], so only [b, L, H] activations travel
between stages. The head is passed in: this layer knows no loss or log-prob.

`Pipeline` runs a stage under a GPipe or 1F1B schedule. The schedules infer the activation shapes
once per stage object, so one (stage, schedule) pair is kept per (micro-batch shape, count).
Gradients are summed over micro-batches (`scale_grads=False`): the loss function returns each
micro-batch's share of the mini-batch loss, exactly as the unpipelined loop.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

Schedule = Literal["gpipe", "1f1b"]
# head(logits [b, T, V] fp32, targets [b, T]) -> per-token outputs [b, T, k]
Head = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# fused head(hidden [b, T, H] after the final norm, lm_head, targets [b, T], temperature, chunk) -> [b, T, k]:
# the same outputs without the [b, T, V] logits (`engine/fused_logprobs.token_head`)
FusedHead = Callable[[torch.Tensor, nn.Module, torch.Tensor, float, int], torch.Tensor]
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class StageLM(nn.Module):
    """Stage `stage` of `num_stages` of an HF causal LM (`lm.model` = embed_tokens, layers, norm,
    rotary_emb; `lm.lm_head`), parameter names unchanged."""

    def __init__(self, lm: nn.Module, stage: int, num_stages: int, head: Head, fused_head: tuple[FusedHead, int] | None = None):
        super().__init__()
        self.head = head
        self.fused_head = fused_head  # (fn, chunk): the last stage never builds [b, T, V] logits
        self.config = lm.config
        self._no_split_modules = lm._no_split_modules
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        inner = lm.model
        per = self.config.num_hidden_layers // num_stages
        inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(stage * per, (stage + 1) * per)})
        if not self.is_first:
            inner.embed_tokens = None
        if not self.is_last:
            inner.norm = None
        self.model = inner
        self.lm_head = lm.lm_head if self.is_last else None
        self.temperature = 1.0  # set by the caller before a run (logits / temperature)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """x: input_ids [b, L] (first stage) or hidden states [b, L, H]; targets [b, T]: the tokens
        whose log-probs the last stage returns, predicted by positions L-T-1 .. L-2."""
        from transformers.masking_utils import create_causal_mask

        h = self.model.embed_tokens(x) if self.is_first else x
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=attention_mask, cache=None, position_ids=position_ids)
        rope = self.model.rotary_emb(h, position_ids)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=position_ids)
        if not self.is_last:
            return h
        t = targets.shape[1]
        if self.fused_head is not None:
            fn, chunk = self.fused_head
            return fn(self.model.norm(h[:, -t - 1 : -1]), self.lm_head, targets, self.temperature, chunk)  # [b, T, k]
        logits = self.lm_head(self.model.norm(h[:, -t - 1 : -1])).float()  # [b, T, V]
        if self.temperature != 1.0:
            logits = logits / self.temperature
        return self.head(logits, targets)


class Pipeline:
    """One rank's stage of a pipeline over `group`; `run` feeds a whole batch as micro-batches."""

    def __init__(self, stage: StageLM, stage_index: int, num_stages: int, group, device: str, schedule: Schedule = "1f1b"):
        self.stage, self.index, self.num_stages, self.group = stage, stage_index, num_stages, group
        self.device = torch.device(device)
        self.schedule = schedule
        self._cache: dict[tuple, object] = {}
        self._loss: Callable | None = None
        # A new training schedule calls the loss once on micro-batch 0 to infer gradient shapes,
        # before the real micro-batches: `inferring` is True during that call, so callers keep
        # metrics out of it (its gradient is discarded).
        self.inferring = False
        self._pending_inference = False

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor, **kwargs) -> torch.Tensor:
        self.inferring, self._pending_inference = self._pending_inference, False
        try:
            return self._loss(output, target, **kwargs)
        finally:
            self.inferring = False

    def _schedule(self, shape: tuple, n_micro: int, train: bool):
        key = (shape, n_micro, train)
        if key not in self._cache:
            stage = PipelineStage(self.stage, self.index, self.num_stages, self.device, group=self.group)
            # 1F1B needs a micro-batch per stage in flight; a shorter batch runs GPipe (same math).
            cls = SCHEDULES[self.schedule] if train and n_micro >= self.num_stages else ScheduleGPipe
            self._cache[key] = cls(stage, n_micro, loss_fn=self._loss_fn if train else None, scale_grads=False)
            self._pending_inference = train and self.stage.is_last
        return self._cache[key]

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor,
            micro_batch_size: int, temperature: float = 1.0, loss: Callable | None = None, target: torch.Tensor | None = None,
            loss_kwargs: dict | None = None) -> torch.Tensor | None:
        """Forward (loss None) or forward + backward of a batch of B rows in equal micro-batches of
        the largest size <= micro_batch_size that divides B (a schedule's micro-batches share one
        shape). Returns [B, T, k] (the stage's head) on the last stage, None elsewhere.
        `loss(output_mb, target_mb, **loss_kwargs)` -> scalar, on the last stage."""
        rows = input_ids.shape[0]
        micro = max(d for d in range(1, min(micro_batch_size, rows) + 1) if rows % d == 0)
        self.stage.temperature = temperature
        sched = self._schedule((micro, *input_ids.shape[1:], targets.shape[1]), rows // micro, loss is not None)
        args = (input_ids,) if self.index == 0 else ()
        kwargs = {"attention_mask": attention_mask, "position_ids": position_ids, "targets": targets}
        if loss is None:
            return sched.eval(*args, **kwargs)
        self._loss = loss
        try:
            return sched.step(*args, target=target if self.stage.is_last else None, loss_kwargs=loss_kwargs, **kwargs)
        finally:
            self._loss = None
