"""The chunked log-prob pass (`engine/fused_logprobs.py`) against the plain logits pass and against
an independent float64 computation: log-probs, entropies and their gradients w.r.t. the hidden
states and the LM head (tied embeddings included), padded and packed, at a temperature.

Tolerances follow the fp32 arithmetic (unit roundoff u = 2^-24 ~ 6e-8). A logit is a length-H dot
product: |error| <= H u sum_i |h_i w_i| (the standard bound, Higham 3.1); log-softmax and entropy add
O(log V + |z|) u per token. The test computes that bound from the data (`_fp32_bound`) instead of
picking a number, and the plain pass (a different summation order over the same products) must be
within it too. Gradients are sums of N (or V) such terms: the same bound times the sum of the
absolute values of the terms.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybridflow.algorithms import entropy_from_logits, logprobs_from_logits
from hybridflow.engine.fused_logprobs import chunked_logprobs
from hybridflow.engine.model import response_logits, response_logprobs
from hybridflow.protocol import Batch

U32 = 2.0**-24


def _data(n=37, h=24, v=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


def _reference64(hidden, weight, targets, temperature):
    """log p, entropy and their gradients in float64, straight from the definitions."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    z = (h @ w.t()) / temperature  # [N, V]
    p = torch.exp(z - torch.logsumexp(z, -1, keepdim=True))
    lp = torch.log(p.gather(-1, targets[:, None])).squeeze(-1)
    ent = -(p * torch.log(p)).sum(-1)
    return h, w, lp, ent


def _fp32_bound(hidden, weight, temperature):
    """Per-token bound on the fp32 error of log p / entropy (module doc): H u (|h| @ |W|^T) / T on
    each logit, plus (log V + max|z|) u for the log-sum-exp and the entropy's sum; x 2 for the
    two passes compared."""
    h, w = hidden.detach().double().abs(), weight.detach().double().abs()
    logit = hidden.shape[-1] * U32 * (h @ w.t()).max(-1).values / temperature  # [N]
    z = (hidden.detach().double() @ weight.detach().double().t()).abs().max(-1).values / temperature
    return 2 * (logit + (math.log(weight.shape[0]) + z) * U32 * 8)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 8), (0.7, 8), (0.7, 64)])
def test_chunked_equals_plain_and_float64_with_gradients(temperature, chunk):
    hidden, weight, targets = _data()
    g_lp, g_ent = torch.randn(37), torch.randn(37)
    # 37 tokens: chunk 8 = 4 full chunks and 1 of 5 (the head's gradient summed in fp32); 64 = one chunk (its product directly)
    lp, ent = chunked_logprobs(hidden, weight, targets, temperature, chunk=chunk)
    (lp * g_lp + ent * g_ent).sum().backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    z = F.linear(hidden, weight).float() / temperature  # the plain pass
    plp, pent = logprobs_from_logits(z, targets), entropy_from_logits(z)
    (plp * g_lp + pent * g_ent).sum().backward()
    h64, w64, lp64, ent64 = _reference64(hidden, weight, targets, temperature)
    (lp64 * g_lp.double() + ent64 * g_ent.double()).sum().backward()
    bound = _fp32_bound(hidden, weight, temperature)
    for got, ref in ((lp, lp64), (ent, ent64), (plp, lp64)):
        assert ((got.double() - ref).abs() <= bound).all()
    assert ((lp - plp).abs().double() <= bound).all() and ((ent - pent).abs().double() <= bound).all()
    # dL/dz per element is O(|g|) (p and onehot <= 1): the gradient of h sums V products with |W|,
    # of W sums N products with |h|; each term carries the logits' relative error (bound / T).
    scale = float(bound.max()) + 4 * U32 * 64
    tol_h = scale * (g_lp.abs() + g_ent.abs() * 8)[:, None].double() * (weight.detach().double().abs().sum(0)[None] / temperature)
    tol_w = scale * ((g_lp.abs() + g_ent.abs() * 8)[:, None].double() * hidden.detach().double().abs()).sum(0)[None] / temperature
    for got, ref, tol in ((gh, h64.grad, tol_h), (hidden.grad, h64.grad, tol_h), (gw, w64.grad, tol_w), (weight.grad, w64.grad, tol_w)):
        assert ((got.double() - ref).abs() <= tol).all(), float((got.double() - ref).abs().max())
    assert ((gh - hidden.grad).abs().double() <= 2 * tol_h).all() and ((gw - weight.grad).abs().double() <= 2 * tol_w).all()
    print("max |chunked - plain|: grad h", float((gh - hidden.grad).abs().max()), "grad W", float((gw - weight.grad).abs().max()),
          "log p", float((lp - plp).detach().abs().max()))


def test_chunked_bf16_weights_match_the_plain_pass_within_bf16_rounding():
    """bf16 hidden states and head (mixed precision): logits rounded to bf16 (u = 2^-8) before fp32,
    as the plain pass does; the two differ by the matmul's blocking only."""
    hidden, weight, targets = _data(dtype=torch.bfloat16)
    grads = []
    for chunk in (16, 64):  # several chunks (fp32 accumulator for the head's gradient), one chunk (a bf16 product rounded once)
        lp, ent = chunked_logprobs(hidden, weight, targets, 1.0, chunk=chunk)
        lp.sum().backward()
        z = F.linear(hidden, weight).float()
        plp = logprobs_from_logits(z, targets)
        bound = 2 * 2.0**-8 * (z.abs().max(-1).values + math.log(weight.shape[0]))  # one bf16 rounding of each logit
        assert ((lp - plp).abs() <= bound).all() and ((ent - entropy_from_logits(z)).abs() <= bound).all()
        assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
        grads.append(weight.grad.float())
        hidden.grad = weight.grad = None
    # both round the same fp32-accumulated sum of the 37 tokens' terms once to bf16: they differ by at most one bf16 ulp (<= 2^-7 relative)
    assert ((grads[0] - grads[1]).abs() <= 2.0**-7 * grads[0].abs() + 1e-6).all()


def test_no_entropy_asked_leaves_zeros_and_no_entropy_gradient():
    hidden, weight, targets = _data()
    lp, ent = chunked_logprobs(hidden, weight, targets, 1.0, chunk=5, with_entropy=False)
    assert (ent == 0).all()
    lp.sum().backward()
    h64, w64, lp64, _ = _reference64(hidden, weight, targets, 1.0)
    lp64.sum().backward()
    assert torch.allclose(hidden.grad.double(), h64.grad, atol=1e-5) and torch.allclose(weight.grad.double(), w64.grad, atol=1e-5)


def _tiny_lm(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).float()


def _batch(b=3, prompt=5, resp=6, vocab=97):
    g = torch.Generator().manual_seed(1)
    plen = torch.tensor([5, 3, 1])[:b]
    mask = torch.cat([(torch.arange(prompt)[None] >= prompt - plen[:, None]).long(), torch.ones(b, resp, dtype=torch.long)], 1)
    mask[1, -2:] = 0  # a response that ended early
    ids = torch.randint(1, vocab, (b, prompt + resp), generator=g) * mask
    return Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
                                    "responses": ids[:, prompt:]})


@pytest.mark.parametrize("tied,packed", [(True, False), (False, True)])
def test_model_pass_equals_the_plain_pass_with_gradients(tied, packed):
    """The model's own forward with the head swapped (padded and remove_padding): log-probs,
    entropies and every parameter's gradient (the tied embedding gets both of its uses) as the
    plain logits pass's; the head is restored afterwards."""
    model, mb = _tiny_lm(tied), _batch()
    grads, outs = [], []
    for chunk in (4, None):
        model.zero_grad()
        lp, ent = response_logprobs(model, mb, 0.8, packed, chunk=chunk)
        (lp.sum() + 0.3 * ent.sum()).backward()
        outs.append((lp.detach(), ent.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    logits = response_logits(model, mb, 0.8, packed)
    assert logits.shape[-1] == 97  # the head computes logits again outside the block
    mask = mb["attention_mask"][:, -6:].bool()
    for a, b in zip(outs[0], outs[1]):
        assert torch.allclose(a[mask], b[mask], atol=2e-6, rtol=0), float((a - b)[mask].abs().max())
    for n in grads[1]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=2e-6, rtol=1e-5), n
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_engine_switch_and_the_exact_mode_keeps_the_plain_pass(caplog):
    """TrainEngine with logits_chunk on one process: the same log-probs as without; exact mode
    keeps its per-row pass (bitwise the sampler's) and says so once."""
    from hybridflow.engine.fused_logprobs import fused_head_problem

    model, mb = _tiny_lm(False), _batch()
    assert fused_head_problem(model) is None
    with caplog.at_level("WARNING"):
        exact = response_logprobs(model, mb, 1.0, exact=True, chunk=4)[0]
    assert "exact rollout mode" in caplog.text
    assert torch.equal(exact, response_logprobs(model, mb, 1.0, exact=True, chunk=None)[0])
