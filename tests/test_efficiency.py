"""Less work per step, same math: padding removal, token-budget micro-batches and prompts padded to
the batch's longest give the log-probs and gradients of the plain path (no processes; the
workers' wiring is checked end to end in tests/test_e2e_rl.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.algorithms import agg_loss, logprobs_from_logits, micro_weight
from hybridflow.data.dataset import collate_rl
from hybridflow.protocol import Batch
from hybridflow.engine.model import micro_batches, response_logits


def rl_batch(tok, prompts: list[str], responses: list[str], prompt_width: int | None = 32, response_width: int = 6) -> Batch:
    """The RL layout: prompts left-padded, responses right-padded, position ids from the mask."""
    items = [{"input_ids": tok(p)["input_ids"], "data_source": "x", "reward_model": {}, "raw_prompt": p, "index": i} for i, p in enumerate(prompts)]
    batch = collate_rl(items, tok.pad_token_id, prompt_width or 64, "max_length" if prompt_width else "longest")
    resp = torch.full((len(responses), response_width), tok.pad_token_id)
    rmask = torch.zeros_like(resp)
    for i, r in enumerate(responses):
        ids = tok(r)["input_ids"][:response_width]
        resp[i, : len(ids)], rmask[i, : len(ids)] = torch.tensor(ids), 1
    mask = torch.cat([batch["attention_mask"], rmask], 1)
    return Batch.from_dict(tensors={"input_ids": torch.cat([batch["input_ids"], resp], 1), "attention_mask": mask,
                                    "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": resp, "response_mask": rmask})


PROMPTS = ["max 3 9 1", "what is the largest of 4 2", "8", "max 1 2 3 4 5 6 7"]
RESPONSES = ["9", "4 is", "8!", "7<|im_end|>"]


@pytest.fixture(params=["qwen2", "llama"])
def model_and_tok(request, tiny_model_dir, tiny_llama_dir):
    path = tiny_model_dir if request.param == "qwen2" else tiny_llama_dir
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def test_remove_padding_same_log_probs_and_gradients(model_and_tok):
    model, tok = model_and_tok
    batch = rl_batch(tok, PROMPTS, RESPONSES)
    mask = batch["response_mask"]
    grads, logps = [], []
    for remove in (False, True):
        model.zero_grad()
        logp = logprobs_from_logits(response_logits(model, batch, 0.7, remove_padding=remove), batch["responses"])
        agg_loss(-logp, mask, "token-mean").backward()
        logps.append(logp * mask)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert (logps[0] - logps[1]).abs().max() < 1e-5
    assert max((a - b).abs().max() for a, b in zip(*grads)) < 1e-5


def test_token_budget_micro_batches():
    lengths = [5, 3, 9, 2, 2, 7]
    mask = torch.zeros(6, 10, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, -n:] = 1
    b = Batch.from_dict(tensors={"attention_mask": mask, "i": torch.arange(6)})
    parts = micro_batches(b, 4, max_tokens=10)
    assert [p["i"].tolist() for p in parts] == [[0, 1], [2], [3, 4], [5]]  # consecutive, each within 10 tokens
    assert [p["i"].tolist() for p in micro_batches(b, 4, max_tokens=1)] == [[i] for i in range(6)]  # one sequence always fits
    assert [len(p) for p in micro_batches(b, 4)] == [4, 2]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_dynamic_and_fixed_micro_batches_give_the_same_gradient(tiny_model_dir, mode):
    """The update's accumulation (each micro-batch's loss x micro_weight) is the mini-batch loss
    whatever the cut: fixed 2-sequence micro-batches, token budgets, and the whole mini-batch."""
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(tiny_model_dir)
    mini = rl_batch(tok, PROMPTS, RESPONSES)
    grads = []
    for size, budget in ((2, None), (4, None), (4, 14), (4, 30)):
        model.zero_grad()
        for mb in micro_batches(mini, size, budget):
            logp = logprobs_from_logits(response_logits(model, mb), mb["responses"])
            (agg_loss(-logp, mb["response_mask"], mode) * micro_weight(mb["response_mask"], mini["response_mask"], mode)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert len(micro_batches(mini, 4, 14)) > 2  # the budget really cuts differently
    for other in grads[1:]:
        assert max((a - b).abs().max() for a, b in zip(grads[0], other)) < 1e-5


def test_prompts_padded_to_the_longest_give_the_same_log_probs_and_greedy_tokens(model_and_tok):
    model, tok = model_and_tok
    full, longest = rl_batch(tok, PROMPTS, RESPONSES, 32), rl_batch(tok, PROMPTS, RESPONSES, None)
    assert longest["input_ids"].shape[1] - 6 == max(len(tok(p)["input_ids"]) for p in PROMPTS) < 32
    mask = full["response_mask"]
    with torch.no_grad():
        a = logprobs_from_logits(response_logits(model, full), full["responses"]) * mask
        b = logprobs_from_logits(response_logits(model, longest), longest["responses"]) * mask
        assert (a - b).abs().max() < 1e-5
        outs = []
        for batch in (full, longest):
            width = batch["input_ids"].shape[1] - 6
            out = model.generate(input_ids=batch["input_ids"][:, :width], attention_mask=batch["attention_mask"][:, :width],
                                 max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
            outs.append(out[:, width:])
    assert torch.equal(outs[0], outs[1])


def test_trainer_collates_to_the_longest_prompt(tiny_model_dir, task_dir, tmp_path):
    from conftest import rl_overrides

    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.trainer.rl import RLTrainer

    widths = {}
    for padding in ("max_length", "longest"):
        cfg = load_config(None, rl_overrides(tiny_model_dir, task_dir, tmp_path, f"data.prompt_padding={padding}"), schema=HybridFlowConfig)
        trainer = RLTrainer(cfg)  # data and config only: no Ray, no workers
        items = [trainer.train_ds[i] for i in range(4)]
        widths[padding] = trainer.collate(items)["input_ids"].shape[1]
        assert widths[padding] == (32 if padding == "max_length" else max(len(it["input_ids"]) for it in items))
    assert widths["longest"] < widths["max_length"]
