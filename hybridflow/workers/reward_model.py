"""The reward model: a one-label sequence classifier (`AutoModelForSequenceClassification`) on FSDP2.

- In RL (`reward_model.enable`): `compute_rm_score` decodes the policy's responses with the
  policy's tokenizer, re-applies the RM's own chat template to the prompt, re-tokenizes with the
  RM's tokenizer (prompt + response + eos, exactly the layout it was trained on) and scores; the
  score sits on the last valid response token of the policy's sequence, like a rule reward.
- Training (`hybridflow rm`): `update_rm` takes pair batches (chosen and rejected interleaved,
  `data/preference.py`) and minimises the Bradley-Terry loss -log sigma(r_c - r_r - margin).

The score is the classifier's output at the last non-pad token of each row (HF's pooling, which
handles left and right padding), so padding never changes a score.
"""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from hybridflow.algorithms.objectives import BradleyTerryLoss
from hybridflow.run_plan import RewardModelSpec, UpdatePlan
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker
from hybridflow.parallel.process_group import pick_device
from hybridflow.data.chat import chat_ids
from hybridflow.data.preference import pack_sequences, response_ids
from hybridflow.engine import TrainEngine
from hybridflow.models.hf import load_hf_model
from hybridflow.parallel.layout import train_mesh
from hybridflow.protocol import Batch


class RewardModelWorker(Worker):
    def __init__(self, spec: RewardModelSpec, total_training_steps: int = 1):
        """spec: the reward model's (`run_plan.resolve(cfg).reward_model`, or `RewardModelSpec.for_training`
        for `hybridflow rm`: its optimizer set)."""
        super().__init__()
        self.spec = spec
        self.total_training_steps = total_training_steps
        self.device = pick_device(spec.process.device)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        spec = self.spec
        self.init_process_group(self.device, spec.process.collective_timeout_s)
        torch.manual_seed(spec.process.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model.tokenizer_source())
        self.policy_tokenizer = AutoTokenizer.from_pretrained(spec.policy_tokenizer) if spec.policy_tokenizer else self.tokenizer
        model = load_hf_model(spec.model, self.device, kind="reward", pad_token_id=self.tokenizer.pad_token_id)
        self.model = TrainEngine(model, train_mesh(spec.layout, self.device), self.device, spec.fsdp, optim=spec.optim,
                                 total_steps=self.total_training_steps, grad_clip=spec.grad_clip)  # FSDP over the group
        self.micro = spec.micro_batch_size
        self.bt_loss, self.update_plan = BradleyTerryLoss(spec.margin), UpdatePlan(micro_rows=self.micro, metric_prefix="train")  # one step per call

    @staticmethod
    def _scores(module, mb: Batch) -> torch.Tensor:
        """[b] scalar rewards of input_ids/attention_mask/position_ids [b, L]."""
        out = module(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"], use_cache=False)
        return out.logits.squeeze(-1).float()

    @register(Dispatch.DP_COMPUTE)
    def score_sequences(self, data: Batch) -> Batch:
        """scores [b] of sequences already tokenized for the RM (e.g. a pair batch)."""
        return Batch.from_dict(tensors={"scores": self.model.forward(data, self._scores, self.micro).cpu()})

    @register(Dispatch.DP_COMPUTE)
    def compute_rm_score(self, data: Batch) -> Batch:
        """rm_scores [b, R] (the RM's score on the last valid response token, 0 elsewhere) for the
        policy's responses / response_mask [b, R] to raw_prompt (chat lists)."""
        mask = data["response_mask"].bool()
        texts = [self.policy_tokenizer.decode(ids[m].tolist(), skip_special_tokens=True) for ids, m in zip(data["responses"], mask)]
        prompts = [chat_ids(self.tokenizer, list(msgs)) for msgs in data["raw_prompt"]]
        responses = [response_ids(self.tokenizer, t) for t in texts]
        packed = Batch.from_dict(tensors=pack_sequences(prompts, responses, int(self.tokenizer.pad_token_id),
                                                        max(map(len, prompts)), max(map(len, responses))))
        scores = self.model.forward(packed, self._scores, self.micro).cpu()
        rm_scores = torch.zeros(mask.shape, dtype=torch.float32)
        last = (mask.sum(-1) - 1).clamp(min=0)
        rm_scores[torch.arange(len(scores)), last] = scores
        return Batch.from_dict(tensors={"rm_scores": rm_scores}, meta={"metrics": {"reward_model/score_mean": float(scores.mean())}})

    @register(Dispatch.DP_COMPUTE)
    def update_rm(self, data: Batch) -> dict[str, float]:
        """One optimizer step of Bradley-Terry on this rank's pairs (2p rows, interleaved)."""
        return self.model.train(data, self.bt_loss, self.update_plan, head=self._scores)

    @register(Dispatch.RANK_ZERO)
    def save_hf_model(self, out_dir: str) -> str:
        """The trained classifier as an HF checkpoint (+ its tokenizer), written by rank 0."""
        return self.model.save_hf(out_dir, self.tokenizer, self.rank)
