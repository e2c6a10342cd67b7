"""The exact mode's speculative sampler (`rollout/exact_sampler.py`): whatever the draft proposes,
the tokens are distributed as the target's (trainer's) distribution and its log-probs are the
trainer's bit for bit.

The oracles do not use the sampler: the target distribution written out (float64 softmax of
`exact_row_logits`), the one-token-at-a-time greedy loop the mode ran before, and the trainer's pass
over the finished response. The draft is made deliberately wrong (its LM head perturbed) so that
rejections and redraws happen: with the model's own KV-cached `generate` as the draft they are rare.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.algorithms import logprobs_from_logits
from hybridflow.models.exact import exact_row_logits
from hybridflow.protocol import Request, SamplingParams
from hybridflow.rollout.exact_sampler import accept, truncate
from hybridflow.rollout.hf_rollout import HFRollout


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def test_accept_draws_from_the_target_whatever_the_draft():
    """40,000 draws x ~ q through `accept` against p: the kept tokens' frequencies are p's. q puts
    mass where p has none and none where p has some (token 4), so every branch runs. Tolerance: each
    frequency's standard deviation is sqrt(p (1 - p) / N) <= 0.0025; the total variation's expectation
    is ~0.004 here, and 0.015 is > 6 standard deviations of any single cell."""
    p = torch.tensor([0.40, 0.25, 0.20, 0.10, 0.05, 0.00])
    q = torch.tensor([0.10, 0.10, 0.30, 0.30, 0.00, 0.20])
    assert _tv(p, q) > 0.4  # an uncorrected draft would be far off
    gen, draws = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    N = 40_000
    tokens = torch.multinomial(q, N, replacement=True, generator=draws).tolist()
    kept = [accept(p, q, x, gen)[0] for x in tokens]
    freq = torch.bincount(torch.tensor(kept), minlength=6).double() / N
    assert _tv(freq, p) < 0.015, (freq, p)
    assert freq[5] == 0.0  # never a token the target gives probability 0


@pytest.fixture(scope="module")
def target_and_draft(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    draft = copy.deepcopy(target)
    with torch.no_grad():  # a wrong draft: its next-token distributions far from the target's
        g = torch.Generator().manual_seed(0)
        head = draft.get_output_embeddings().weight
        head.add_(torch.randn(head.shape, generator=g) * 3 * head.std())
    rollout = HFRollout(draft, tok, "cpu", exact=True)
    rollout.exact_model = target  # the target: as at gen_tp = N, where the training engine's module decides
    return tok, target, rollout


def test_greedy_equals_the_token_at_a_time_loop_with_a_wrong_draft(target_and_draft):
    """Greedy: the target's own argmax path (the loop the mode ran before: one exact pass per token,
    pads after), however many draft tokens it rejects."""
    tok, target, rollout = target_and_draft
    R = 8
    params = SamplingParams(max_new_tokens=R, do_sample=False)
    reqs = [Request(tok.encode(t), params) for t in ("What is 2*3?", "Hi", "a longer prompt than the others")]
    out = rollout.generate_requests(reqs)
    assert rollout.exact_stats["kept_tokens"] < rollout.exact_stats["draft_tokens"]  # the draft was wrong somewhere
    for r, c in zip(reqs, out):
        prompt, response = torch.tensor(r.prompt_ids), torch.full((R,), tok.pad_token_id)
        with torch.no_grad():
            for t in range(R):
                response[t] = int(exact_row_logits(target, prompt, response)[0, t].argmax())
                if int(response[t]) == tok.eos_token_id:
                    response = response[: t + 1]
                    break
        assert list(c.token_ids) == response.tolist()


def test_samples_follow_the_target_and_log_probs_are_the_trainers(target_and_draft):
    """400 one-token samples from one prompt, top_k 4: the token's frequencies are the target's
    (float64 softmax of its truncated row 0), not the draft's (whose top 4 here are other tokens);
    every response's log-probs equal the trainer's pass over it bit for bit. Tolerance: over 4
    cells of ~0.25, each frequency's standard deviation is ~0.022 and the expected total variation
    ~0.035; 0.1 is about 3 times that, and the draft's own distribution is > 0.15 away."""
    tok, target, rollout = target_and_draft
    R, N = 1, 400
    params = SamplingParams(max_new_tokens=R, temperature=1.0, top_k=4, seed=5)
    prompt = tok.encode("What is 2*3?")
    out = rollout.generate_requests([Request(prompt, params)] * N)
    assert rollout.exact_stats["kept_tokens"] < rollout.exact_stats["draft_tokens"]
    with torch.no_grad():
        p = torch.softmax(truncate(exact_row_logits(target, torch.tensor(prompt), torch.full((R,), tok.pad_token_id))[0, 0], params).double(), -1)
        q = torch.softmax(truncate(exact_row_logits(rollout.model, torch.tensor(prompt), torch.full((R,), tok.pad_token_id))[0, 0], params).double(), -1)
    assert _tv(p, q) > 0.15
    freq = torch.bincount(torch.tensor([c.token_ids[0] for c in out]), minlength=p.shape[0]).double() / N
    assert _tv(freq, p) < 0.1, (freq[p > 0], p[p > 0])
    for c in out[:50]:  # the trainer's pass over the finished response, written out
        response = torch.full((R,), tok.pad_token_id)
        response[: len(c.token_ids)] = torch.tensor(c.token_ids)
        with torch.no_grad():
            trainer = logprobs_from_logits(exact_row_logits(target, torch.tensor(prompt), response), response[None])[0, : len(c.token_ids)]
        assert torch.equal(torch.tensor(c.untruncated_log_probs), trainer)
