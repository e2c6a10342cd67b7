"""The VLM's behaviour log-probs and the trainer's policy agree: the HF rollout never samples the vision tokens
(`models/vlm_inputs.py::suppressed_token_ids`, HF's suppress_tokens: their logits -inf before sampling), so the trainer's
log-prob pass leaves the same ids out of its softmax (`engine/model.py::suppress_logits`, the chunked head too). Without
that, the rollout's log-probs sat ~0.02 above the trainer's on the tiny VLM (renormalised without 4 of 263 tokens),
skewing rollout correction and the rollout/logprob_diff_* mismatch metrics."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.fused_logprobs import chunked_logprobs
from hybridflow.engine.model import masked_entropy, response_logprobs
from hybridflow.models.tiny import main_make_model
from hybridflow.models.vlm import load_processor
from hybridflow.models.vlm_inputs import suppress_logits, suppressed_token_ids
from test_vision import PROMPT_IMAGES, _img, _load_model


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm_lp") / "qwen2_vl"
    assert main_make_model([str(out), "--arch", "qwen2_vl"]) == 0
    return load_processor(out), _load_model(out)


def _sampled(processor, model):
    """The HF rollout's batch API on 4 image prompts (two image sizes, left-padded), sampled at temperature 1."""
    from hybridflow.data.vision import encode_vision_prompt
    from hybridflow.protocol import Batch, SamplingParams
    from hybridflow.rollout.base import left_padded
    from hybridflow.rollout.hf_rollout import HFRollout

    items = [encode_vision_prompt(processor, [{"role": "user", "content": "<image>Which colour?" + " x" * i}], [_img(c, s)])
             for i, (c, s) in enumerate(PROMPT_IMAGES)]
    ids, mask = left_padded([it["input_ids"] for it in items], processor.tokenizer.pad_token_id)
    prompts = Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": mask},
                              non_tensors={"multi_modal_inputs": [it["multi_modal_inputs"] for it in items]})
    out = HFRollout(model, processor.tokenizer, "cpu", continuous=False).generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=3))
    return out, items


def _oracle(model, out, items, suppress) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob, entropy) [b, R] in float64 of each row alone (unpadded, its own pixel values, the model's own rope index),
    the `suppress` logits -inf before the log-softmax: no hybridflow code but the token ids."""
    config = model.config
    lp, ent = torch.zeros(out["responses"].shape, dtype=torch.float64), torch.zeros(out["responses"].shape, dtype=torch.float64)
    with torch.no_grad():
        for r, it in enumerate(items):
            n, P = int(out["response_mask"][r].sum()), len(it["input_ids"])
            ids = torch.tensor([it["input_ids"] + out["responses"][r, :n].tolist()])
            logits = model(input_ids=ids, mm_token_type_ids=(ids == config.image_token_id).long(), **it["multi_modal_inputs"]).logits
            z = logits[0, P - 1 : -1].double()  # [n, V]
            z[:, list(suppress)] = float("-inf")
            logp = torch.log_softmax(z, -1)
            lp[r, :n] = logp.gather(-1, ids[0, P:, None])[:, 0]
            p = logp.exp()
            ent[r, :n] = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    return lp, ent


def test_rollout_logprobs_equal_the_trainers_masked_pass(vlm):
    """Sampled at temperature 1 with images: the rollout's behaviour (and untruncated) log-probs equal the trainer's log-prob
    pass (plain and chunked head) within fp32 rounding, where the pass without the mask is ~0.02 off; the trainer's
    log-probs and entropies equal a float64 log-softmax of an unpadded HF forward with the vision logits masked."""
    processor, model = vlm
    suppress = suppressed_token_ids(model.config)
    assert suppress == (259, 260, 261, 262)  # the four vision tokens of the tiny VLM (models/vlm.py)
    out, items = _sampled(processor, model)
    mask = out["response_mask"].bool()
    assert int(mask.sum()) >= 20 and not any(t in suppress for t in out["responses"][mask].tolist())
    rollout = out["rollout_log_probs"]
    assert torch.equal(rollout, out["rollout_untruncated_log_probs"])  # temperature alone, nothing truncated
    with torch.no_grad():
        ours, ent = response_logprobs(model, out, suppress=suppress)  # what TrainEngine runs for this model
        chunked, chunked_ent = response_logprobs(model, out, chunk=5, suppress=suppress)
        unmasked, _ = response_logprobs(model, out)
    # The same fp32 weights and logits; only the kernels differ (one padded forward over the whole sequence here, the KV-cached
    # prefill + one-token decode steps there), i.e. fp32 summation order in a 64-wide model: a few ulps of log-probs of
    # magnitude ~5 (ulp 4.8e-7; measured max 4.8e-7 over 48 tokens). 1e-5 leaves room for other BLAS builds and is three
    # orders of magnitude under the 0.013-0.017 the mask removes here.
    gap = (rollout - unmasked)[mask]
    assert gap.min() > 5e-3, gap  # before: the rollout renormalised without 4 tokens the trainer kept, 0.013-0.017 higher on every token
    torch.testing.assert_close(ours[mask], rollout[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked[mask], ours[mask], rtol=0, atol=1e-6)
    want, want_ent = _oracle(model, out, items, suppress)
    # fp32 padded forward against a float64 softmax of the unpadded one: ~1e-6 apart (test_vision.py's bound)
    torch.testing.assert_close(ours[mask].double(), want[mask], rtol=0, atol=2e-5)
    torch.testing.assert_close(ent[mask].double(), want_ent[mask], rtol=0, atol=2e-5)
    torch.testing.assert_close(chunked_ent[mask], ent[mask], rtol=1e-6, atol=0)  # entropies ~5.5: a few fp32 ulps apart


def test_masked_logprob_gradients_are_finite_and_the_chunked_head_matches():
    """Backward through the -inf columns: log-prob and entropy gradients (entropy coefficient 0, 3 and -0.5: the -inf * g_H
    terms that would be nan) are finite, 0 for the suppressed logits, and the chunked head's equal autograd's of the plain
    pass. A position whose target is itself suppressed (a tool's image token in a multi-turn response, mask 0) keeps its
    plain logits: a finite log-prob, so no masked product turns nan."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(7, 16, generator=g, dtype=torch.float64), torch.randn(40, 16, generator=g, dtype=torch.float64)
    targets, suppress = torch.randint(0, 36, (7,), generator=g), (36, 37, 38, 39)
    targets[4] = 38  # an image token as the target
    for coef in (0.0, 3.0, -0.5):
        grads = []
        for chunked in (False, True):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            if chunked:
                lp, ent = chunked_logprobs(h, w, targets, temperature=0.7, chunk=3, suppress=suppress)
            else:
                z = suppress_logits(h @ w.T / 0.7, suppress, targets)  # [7, 40]
                lp, ent = torch.log_softmax(z, -1).gather(-1, targets[:, None])[:, 0], masked_entropy(z, suppress)
            (lp.sum() + coef * ent.sum()).backward()
            assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all(), (coef, chunked)
            assert torch.isfinite(lp).all() and torch.isfinite(ent).all(), (coef, chunked)
            plain = torch.log_softmax(hidden[4] @ weight.T / 0.7, -1)[38]  # row 4 unmasked
            torch.testing.assert_close(lp[4].double().detach(), plain, rtol=1e-5, atol=1e-5)
            grads.append((lp.detach(), ent.detach(), h.grad, w.grad))
        for a, b in zip(*grads):  # the chunked head's logits are fp32 (the plain pass's .float()): fp32 rounding apart
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5)


def test_text_models_suppress_nothing(tiny_model_dir):
    """A text model's config has no vision tokens: nothing is masked, its log-prob pass (exact mode, mismatch doctor) is as before."""
    from transformers import AutoConfig

    assert suppressed_token_ids(AutoConfig.from_pretrained(str(tiny_model_dir))) == ()
    z = torch.randn(2, 3, 5)
    assert suppress_logits(z, ()) is z
