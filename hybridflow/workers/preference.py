"""DPO on the actor worker: sequence log-probs of chosen/rejected pairs and the preference update.

A pair batch interleaves the sides ([c0, r0, c1, r1, ...], `data/preference.py`), so one forward
scores both and every even split (ranks, micro-batches) keeps pairs whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.algorithms import logprobs_from_logits
from hybridflow.algorithms.preference import dpo_loss, pair_metrics, seq_log_probs
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.engine.model import response_logits
from hybridflow.protocol import Batch


class PreferenceMixin:
    """Needs `self.actor` (the policy's `TrainEngine`), `self.ref` when `has_ref`, cfg."""

    def _seq_log_probs(self, model, mb: Batch) -> torch.Tensor:
        """[b] sequence log-probs of the responses (mean over tokens for IPO, as TRL)."""
        logp = logprobs_from_logits(response_logits(model, mb), mb["responses"])
        return seq_log_probs(logp, mb["response_mask"], average=self.cfg.dpo.loss_type == "ipo")

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_seq_log_prob(self, data: Batch) -> Batch:
        """ref_seq_log_prob [b] under the frozen reference; without one (dpo.precompute_ref_log_probs)
        under the actor, which is the reference as long as it has not been updated."""
        engine = self.ref if self.has_ref else self.actor
        out = engine.forward(data, self._seq_log_probs, self.cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu)
        return Batch.from_dict(tensors={"ref_seq_log_prob": out.cpu()})

    @register(Dispatch.DP_COMPUTE)
    def update_dpo(self, data: Batch) -> dict[str, float]:
        """DPO update on this rank's pairs: input_ids/attention_mask/position_ids [2p, Lp+R],
        responses/response_mask [2p, R], ref_seq_log_prob and pair_weight [2p]. One optimizer step
        per mini-batch of actor.ppo_mini_batch_size pairs (global). The loss is the mean over the
        mini-batch's counted pairs (pair_weight 1) of all ranks."""
        acfg, dpo = self.cfg.actor_rollout_ref.actor, self.cfg.dpo
        mini_rows = 2 * acfg.ppo_mini_batch_size // self.world_size
        sums: dict[str, float] = {}
        weight_total = [0.0]
        norms = []

        def loss(module, mb: Batch, w_global: torch.Tensor) -> torch.Tensor:
            logps = self._seq_log_probs(module, mb)
            ref = mb["ref_seq_log_prob"]
            weight = mb["pair_weight"][0::2]
            losses, chosen_r, rejected_r = dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], dpo.beta, dpo.loss_type, dpo.label_smoothing)
            if weight.sum() > 0:
                keep = weight > 0
                m = pair_metrics(losses[keep], chosen_r[keep], rejected_r[keep], logps[0::2][keep], logps[1::2][keep])
                n = float(keep.sum())
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v * n
                weight_total[0] += n
            # FSDP2 averages gradients over ranks: x world makes the sum over ranks / global pairs.
            return (losses * weight).sum() / w_global * self.world_size

        for mini in data.split(mini_rows):
            w_global = mini["pair_weight"][0::2].sum().to(self.device)
            dist.all_reduce(w_global)  # every rank skips an all-tie mini-batch together
            if float(w_global) == 0:
                continue
            self.actor.backward(mini, lambda module, mb: loss(module, mb, w_global), acfg.ppo_micro_batch_size_per_gpu)
            norms.append(self.actor.step())
        metrics = {k: v / weight_total[0] for k, v in sums.items()}
        metrics["actor/lr"] = self.actor.lr
        if norms:
            metrics["actor/grad_norm"] = sum(norms) / len(norms)
        self.actor.scheduler_step()
        return metrics
