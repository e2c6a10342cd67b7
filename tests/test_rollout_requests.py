"""Request-level generation (`Request` -> `Completion`) on the HF backend, checked against
independent oracles: HF `generate` on each prompt alone (no padding, no grouping) for the tokens,
a plain forward pass over prompt + completion for the log-probs, and the request's own limits for
the finish reason; the batch API is the same requests."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.protocol import Batch, Completion, Request, SamplingParams
from hybridflow.rollout.hf_rollout import HFRollout


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return HFRollout(model, tok, "cpu"), model, tok


def _alone(model, tok, ids, max_new) -> list[int]:
    """Greedy tokens of one unpadded prompt through HF generate (stops at EOS)."""
    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                         max_new_tokens=max_new, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def _forward_logprobs(model, ids, completion) -> list[float]:
    full = torch.tensor([list(ids) + list(completion)])
    logits = model(input_ids=full).logits[0, len(ids) - 1 : -1].float()  # position t predicts token t+1
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_requests_with_their_own_lengths_and_limits(backend):
    rollout, model, tok = backend
    greedy = SamplingParams(max_new_tokens=6, do_sample=False)
    prompts = [tok.encode(t) for t in ("max 3 8 1", "max 9 2", "max 1 1 1 1 4", "max 5")]
    # different prompt lengths in one group; one request with its own (shorter) max_new_tokens
    reqs = [Request(p, greedy) for p in prompts] + [Request(prompts[0], greedy.with_(max_new_tokens=2))]
    got = rollout.generate_requests(reqs)
    assert len(got) == len(reqs) and all(isinstance(c, Completion) for c in got)
    with torch.no_grad():
        for r, c in zip(reqs, got):
            assert list(c.token_ids) == _alone(model, tok, list(r.prompt_ids), r.params.max_new_tokens), r
            assert len(c.log_probs) == len(c.token_ids) > 0
            want = _forward_logprobs(model, r.prompt_ids, c.token_ids)
            assert max(abs(a - b) for a, b in zip(c.log_probs, want)) < 1e-4
            ended = c.token_ids[-1] == tok.eos_token_id
            assert c.finish_reason == ("stop" if ended else "length"), c
            assert len(c.token_ids) == r.params.max_new_tokens or ended
    assert len(got[-1].token_ids) <= 2


def test_stop_strings_and_sampling_temperature(backend):
    rollout, model, tok = backend
    ids = tok.encode("max 3 8 1")
    free = rollout.generate_requests([Request(ids, SamplingParams(max_new_tokens=8, do_sample=False))])[0]
    # a stop string: the first later token that decodes to a printable character not written before
    j, stop = next((j, tok.decode([t])) for j, t in enumerate(free.token_ids) if j > 0 and tok.decode([t]).isascii()
                   and tok.decode([t]).isprintable() and tok.decode([t]).strip() and tok.decode([t]) not in tok.decode(free.token_ids[:j]))
    cut = rollout.generate_requests([Request(ids, SamplingParams(max_new_tokens=8, do_sample=False, stop=(stop,)))])[0]
    assert cut.token_ids == free.token_ids[: j + 1] and cut.finish_reason == "stop", (stop, cut, free)
    # sampling at T = 0.5: the log-probs are of the tempered distribution (logits / T)
    hot = rollout.generate_requests([Request(ids, SamplingParams(max_new_tokens=4, temperature=0.5, seed=3))])[0]
    with torch.no_grad():
        full = torch.tensor([ids + list(hot.token_ids)])
        logits = model(input_ids=full).logits[0, len(ids) - 1 : -1].float() / 0.5
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(hot.token_ids)[:, None])[:, 0]
    assert (torch.tensor(hot.log_probs) - want).abs().max() < 1e-4


def test_the_batch_api_is_the_same_requests(backend):
    rollout, _, tok = backend
    params = SamplingParams(max_new_tokens=5, do_sample=False)
    texts = ["max 3 8 1", "max 9 2", "max 4 4 7"]
    P = 12
    rows = [tok.encode(t) for t in texts]
    ids = torch.tensor([[tok.pad_token_id] * (P - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows])
    out = rollout.generate(Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask}), params)
    want = rollout.generate_requests([Request(r, params) for r in rows])
    for i, c in enumerate(want):
        n = len(c.token_ids)
        assert int(out["response_mask"][i].sum()) == n
        assert out["responses"][i, :n].tolist() == list(c.token_ids)
        assert torch.allclose(out["rollout_log_probs"][i, :n], torch.tensor(c.log_probs))
    assert torch.equal(out["prompts"], ids) and out["input_ids"].shape == (3, P + 5)


def _truncated_logprob(logits: torch.Tensor, token: int, top_p: float, top_k: int) -> float:
    """log-prob of `token` under softmax(logits) cut to its top_k tokens, then to the smallest set
    whose probability reaches top_p (largest first), renormalised: written out by hand."""
    probs = torch.softmax(logits.double(), -1)
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(float(probs[i]) for i in kept)
    nucleus, acc = [], 0.0
    for i in kept:
        nucleus.append(i)
        acc += float(probs[i]) / mass
        if acc >= top_p:
            break
    assert token in nucleus, "a sampled token lies in the nucleus"
    return float(torch.log(probs[token] / sum(probs[i] for i in nucleus)))


@pytest.mark.parametrize("top_p, top_k", [(0.9, -1), (1.0, 5), (0.8, 8)])
def test_behaviour_and_untruncated_log_probs_under_top_p_and_top_k(backend, top_p, top_k):
    """Each sampled token carries two log-probs: the behaviour one (the truncated, renormalised
    distribution it was drawn from) and the untruncated one (temperature alone, what the trainer
    computes); both equal a plain forward pass's numbers put through the truncation by hand."""
    rollout, model, tok = backend
    T = 1.3
    params = SamplingParams(max_new_tokens=6, temperature=T, top_p=top_p, top_k=top_k, seed=7)
    reqs = [Request(tok.encode(t), params) for t in ("max 3 8 1", "max 9 2", "max 1 1 1 1 4")]
    gaps = []
    with torch.no_grad():
        for r, c in zip(reqs, rollout.generate_requests(reqs)):
            full = torch.tensor([list(r.prompt_ids) + list(c.token_ids)])
            logits = model(input_ids=full).logits[0, len(r.prompt_ids) - 1 : -1].float() / T  # [n, V]
            for t, tokid in enumerate(c.token_ids):
                untrunc = float(torch.log_softmax(logits[t], -1)[tokid])
                assert c.untruncated[t] == pytest.approx(untrunc, abs=1e-4)
                assert c.log_probs[t] == pytest.approx(_truncated_logprob(logits[t], tokid, top_p, top_k), abs=1e-4)
                gaps.append(c.log_probs[t] - c.untruncated[t])  # -log(kept mass) >= 0
    assert min(gaps) >= -1e-6 and max(gaps) > 1e-3  # the truncation shows


def test_greedy_and_untruncated_sampling_report_one_log_prob(backend):
    rollout, _, tok = backend
    for params in (SamplingParams(max_new_tokens=4, do_sample=False), SamplingParams(max_new_tokens=4, temperature=0.7, seed=3)):
        c = rollout.generate_requests([Request(tok.encode("max 3 8 1"), params)])[0]
        assert c.log_probs == pytest.approx(c.untruncated, abs=1e-6)


def test_the_backend_owns_its_memory_and_keeps_static_pieces_asleep(tiny_model_dir):
    """HF's sleep / wake: without keep_buffers every parameter's storage is freed after generation
    except the static pieces' (frozen parameters a source sends once), wake re-allocates them, and a
    sync then restores exactly the weights sent (the oracle: the tensors the test pushed)."""
    from hybridflow.protocol import WeightPiece

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout = HFRollout(model, tok, "cpu", keep_buffers=False)
    names = list(rollout.params)
    frozen = names[0]
    sent = {n: torch.randn(p.shape) for n, p in rollout.params.items()}
    pieces = [WeightPiece(n, tuple(t.shape), tuple((0, s) for s in t.shape), t, static=(n == frozen)) for n, t in sent.items()]
    assert rollout.update_weights(pieces)["copied_bytes"] == sum(t.numel() * 4 for t in sent.values())
    rollout.sleep()
    nbytes = {n: p.data.untyped_storage().nbytes() for n, p in rollout.params.items()}
    assert nbytes[frozen] > 0 and all(nbytes[n] == 0 for n in names if n != frozen)
    with pytest.raises(RuntimeError, match="asleep"):
        rollout.generate_requests([Request((5, 6), SamplingParams(max_new_tokens=2))])
    rollout.wake()
    assert torch.equal(rollout.params[frozen].data, sent[frozen])  # the static piece survived the sleep
    rollout.update_weights([p for p in pieces if p.name != frozen])  # a source skips the frozen one from now on
    assert all(torch.equal(rollout.params[n].data, sent[n]) for n in names)
    assert len(rollout.generate_requests([Request((5, 6), SamplingParams(max_new_tokens=2))])[0].token_ids) <= 2
    kept = HFRollout(model, tok, "cpu")  # keep_buffers (default): sleep frees nothing
    kept.sleep()
    assert all(p.data.untyped_storage().nbytes() > 0 for p in kept.params.values())


@pytest.mark.parametrize("continuous", [False, True])
def test_the_lm_head_gets_a_contiguous_input(tiny_model_dir, continuous):
    """HF's prefill cuts the last position out of the hidden states ([b, 1, H] with the strides of
    [b, P, H]) before the LM head, and PyTorch's CPU linear runs a strided input on a slow path (2.6 s
    against 7 ms for SmolLM2's head in bf16: bench/e2e.py's bf16 generation was slower than fp32's). The
    HF rollout hands the head contiguous inputs on both of its generation paths, same tokens."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [tok.encode("12 34 56"), tok.encode("7 8"), tok.encode("1 2 3 4 5 6 7")]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, seed=0)
    plain = [c.token_ids for c in HFRollout(model, tok, "cpu", continuous=False).generate_requests([Request(p, params) for p in prompts])]
    seen: list[bool] = []
    model.get_output_embeddings().register_forward_hook(lambda _m, args, _out: seen.append(args[0].is_contiguous()))
    backend = HFRollout(model, tok, "cpu", continuous=continuous)
    out = backend.generate_requests([Request(p, params) for p in prompts])
    assert seen and all(seen), seen
    assert [c.token_ids for c in out] == plain
