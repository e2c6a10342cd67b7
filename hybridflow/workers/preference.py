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
from hybridflow.protocol import Batch
from hybridflow.workers.fsdp_model import micro_batches, response_logits
from hybridflow.workers.optim import clip_and_step


class PreferenceMixin:
    """Needs `self.actor` (FSDP2 policy), `self.ref` when `has_ref`, optimizer, scheduler, cfg."""

    def _seq_log_probs(self, model, mb: Batch) -> torch.Tensor:
        """[b] sequence log-probs of the responses (mean over tokens for IPO, as TRL)."""
        logp = logprobs_from_logits(response_logits(model, mb), mb["responses"])
        return seq_log_probs(logp, mb["response_mask"], average=self.cfg.dpo.loss_type == "ipo")

    @register(Dispatch.DP_COMPUTE)
    @torch.no_grad()
    def compute_ref_seq_log_prob(self, data: Batch) -> Batch:
        """ref_seq_log_prob [b] under the frozen reference; without one (dpo.precompute_ref_log_probs)
        under the actor, which is the reference as long as it has not been updated."""
        model = self.ref if self.has_ref else self.actor
        model.eval()
        data = data.to(self.device)
        out = [self._seq_log_probs(model, mb) for mb in micro_batches(data, self.cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu)]
        return Batch.from_dict(tensors={"ref_seq_log_prob": torch.cat(out).cpu()})

    @register(Dispatch.DP_COMPUTE)
    def update_dpo(self, data: Batch) -> dict[str, float]:
        """DPO update on this rank's pairs: input_ids/attention_mask/position_ids [2p, Lp+R],
        responses/response_mask [2p, R], ref_seq_log_prob and pair_weight [2p]. One optimizer step
        per mini-batch of actor.ppo_mini_batch_size pairs (global). The loss is the mean over the
        mini-batch's counted pairs (pair_weight 1) of all ranks."""
        acfg, dpo = self.cfg.actor_rollout_ref.actor, self.cfg.dpo
        mini_rows = 2 * acfg.ppo_mini_batch_size // self.world_size
        self.actor.train()
        data = data.to(self.device)
        sums: dict[str, float] = {}
        weight_total = 0.0
        norms = []
        for mini in data.split(mini_rows):
            w_local = mini["pair_weight"][0::2].sum()
            w_global = w_local.clone()
            dist.all_reduce(w_global)  # every rank skips an all-tie mini-batch together
            if float(w_global) == 0:
                continue
            for mb in micro_batches(mini, acfg.ppo_micro_batch_size_per_gpu):
                logps = self._seq_log_probs(self.actor, mb)
                ref = mb["ref_seq_log_prob"]
                weight = mb["pair_weight"][0::2]
                losses, chosen_r, rejected_r = dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], dpo.beta, dpo.loss_type, dpo.label_smoothing)
                # FSDP2 averages gradients over ranks: x world makes the sum over ranks / global pairs.
                ((losses * weight).sum() / w_global * self.world_size).backward()
                if weight.sum() > 0:
                    keep = weight > 0
                    m = pair_metrics(losses[keep], chosen_r[keep], rejected_r[keep], logps[0::2][keep], logps[1::2][keep])
                    n = float(keep.sum())
                    for k, v in m.items():
                        sums[k] = sums.get(k, 0.0) + v * n
                    weight_total += n
            norms.append(clip_and_step(self.actor, self.optimizer, acfg.grad_clip))
        metrics = {k: v / weight_total for k, v in sums.items()}
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        if norms:
            metrics["actor/grad_norm"] = sum(norms) / len(norms)
        self.scheduler.step()
        return metrics
