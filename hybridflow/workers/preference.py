"""DPO on the actor worker: sequence log-probs of chosen/rejected pairs and the preference update.

A pair batch interleaves the sides ([c0, r0, c1, r1, ...], `data/preference.py`), so one forward
scores both and every even split (ranks, micro-batches) keeps pairs whole.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.preference import seq_log_probs
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.engine.model import response_logprobs
from hybridflow.protocol import Batch


class PreferenceMixin:
    """Needs `self.actor` (the policy's `TrainEngine`), `self.ref` when `has_ref`, `self.spec` (`ActorSpec`),
    `self.dpo_loss` (the `DPOLoss` the worker built once)."""

    def _seq_log_probs(self, model, mb: Batch) -> torch.Tensor:
        """[b] sequence log-probs of the responses (mean over tokens for IPO, as TRL)."""
        logp, _ = response_logprobs(model, mb, chunk=self.spec.model.logprob_chunk(), with_entropy=False)  # [b, R]
        return seq_log_probs(logp, mb["response_mask"], average=self.spec.dpo.loss_type == "ipo")

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_seq_log_prob(self, data: Batch) -> Batch:
        """ref_seq_log_prob [b] under the frozen reference; without one (dpo.precompute_ref_log_probs)
        under the actor, which is the reference as long as it has not been updated."""
        engine = self.ref if self.has_ref else self.actor
        out = engine.forward(data, self._seq_log_probs, self.spec.ref.log_prob_micro_batch_size_per_gpu)
        return Batch.from_dict(tensors={"ref_seq_log_prob": out.cpu()})

    @register(Dispatch.DP_COMPUTE)
    def update_dpo(self, data: Batch) -> dict[str, float]:
        """DPO update on this rank's pairs: input_ids/attention_mask/position_ids [2p, Lp+R],
        responses/response_mask [2p, R], ref_seq_log_prob and pair_weight [2p]. One optimizer step
        per mini-batch of actor.ppo_mini_batch_size pairs (global). The loss is the mean over the
        mini-batch's counted pairs (pair_weight 1) of all ranks (`DPOLoss`)."""
        return self.actor.train(data, self.dpo_loss, self.spec.dpo_plan(self.world_size), head=self._seq_log_probs)
