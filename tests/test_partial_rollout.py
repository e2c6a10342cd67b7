"""Partial rollout: a request interrupted by a weight update keeps its tokens, and each token's
behaviour log-prob is that of the weights that sampled it. The oracle is independent of the
rollout: a plain forward pass of each version's checkpoint, loaded from disk, over the whole
prompt + response (no KV cache, no segments)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.protocol import Completion, Request, SamplingParams
from hybridflow.rollout.hf_rollout import HFRollout
from hybridflow.rollout.partial import generate_in_segments


def _checkpoint_logprobs(path: str, prompt: tuple[int, ...], tokens: tuple[int, ...], temperature: float) -> torch.Tensor:
    """log p(token t | prefix) under the checkpoint at `path`, at `temperature`: [len(tokens)]."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    full = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=full).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_an_interrupted_request_keeps_its_tokens_and_each_has_its_versions_log_prob(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # version 1: the same model after an "update" (every weight moved), saved as its own checkpoint
    updated = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    updated.save_pretrained(tmp_path / "v1")
    checkpoints = {0: tiny_model_dir, 1: str(tmp_path / "v1")}
    new_weights = {n: p.detach().clone() for n, p in updated.named_parameters()}

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().requires_grad_(False)
    backend = HFRollout(model, tok, "cpu")
    held = {"version": 0, "calls": 0}
    seen: list[list[Completion]] = []

    def call(requests: list[Request]) -> tuple[list[Completion], int]:
        """The pool: one call at a time; the update lands between the 2nd and 3rd segments."""
        if held["calls"] == 2:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(new_weights[n])
            held["version"] = 1
        held["calls"] += 1
        out = backend.generate_requests(requests)
        seen.append(out)
        return out, held["version"]

    T = 0.9
    params = SamplingParams(max_new_tokens=20, temperature=T, seed=3, stop_token_ids=())
    prompts = [tok.encode(t) for t in ("max 3 8 1", "max 9 2 7 7", "max 5")]
    got = generate_in_segments([Request(p, params) for p in prompts], call, chunk=4)

    # The first two segments' tokens are kept as they were sampled: each response starts with them.
    for i, c in enumerate(got):
        kept = sum((s[i].token_ids for s in seen[:2] if i < len(s)), ())
        assert c.token_ids[: len(kept)] == kept
    interrupted = [c for c in got if 0 in c.versions and 1 in c.versions]
    assert interrupted, [c.versions for c in got]  # at least one response spans the update
    for prompt, c in zip(prompts, got):
        assert list(c.versions) == sorted(c.versions) and len(c.versions) == len(c.token_ids) == len(c.log_probs)
        assert c.finish_reason == "stop" or len(c.token_ids) == params.max_new_tokens
        for version in set(c.versions):
            idx = torch.tensor([t for t, v in enumerate(c.versions) if v == version])
            want = _checkpoint_logprobs(checkpoints[version], tuple(prompt), c.token_ids, T)[idx]
            have = torch.tensor(c.log_probs)[idx]
            # fp32, KV-cached decode vs one forward over the sequence: sums reordered, ~1e-6 apart
            torch.testing.assert_close(have, want, atol=1e-4, rtol=0)
        # and the other version's weights give these tokens different log-probs (the oracle can tell them apart)
        if c in interrupted:
            late = torch.tensor([t for t, v in enumerate(c.versions) if v == 1])
            assert (_checkpoint_logprobs(checkpoints[0], tuple(prompt), c.token_ids, T)[late] - torch.tensor(c.log_probs)[late]).abs().max() > 1e-2


def test_a_request_that_never_pauses_is_the_one_call(tiny_model_dir):
    """Segments longer than the response: the same tokens and log-probs as one backend call (the
    first segment samples with the request's own seed)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = HFRollout(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval(), tok, "cpu")
    reqs = [Request(tok.encode(t), SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)) for t in ("max 3 8 1", "max 2")]
    whole = backend.generate_requests(reqs)
    segmented = generate_in_segments(reqs, lambda rs: (backend.generate_requests(rs), 4), chunk=10)
    assert [c.token_ids for c in segmented] == [c.token_ids for c in whole]
    assert [c.log_probs for c in segmented] == [c.log_probs for c in whole]
    assert [c.finish_reason for c in segmented] == [c.finish_reason for c in whole]
    assert all(c.versions == (4,) * len(c.token_ids) for c in segmented)


@pytest.mark.parametrize("chunk", [1, 3])
def test_segments_end_where_the_request_ends(chunk):
    """A fake backend with a scripted reply per prompt: segments concatenate to the reply, a stop
    ends the request at once, the length limit holds, and no request is asked for more than it needs."""
    script = {(1,): (5, 6, 7, 8, 9, 10, 11), (2,): (5, 99), (3,): (5, 6)}  # 99: the stop token

    def call(requests):
        out = []
        for r in requests:
            reply = script[r.prompt_ids[:1]]
            done = len(r.prompt_ids) - 1
            assert r.params.max_new_tokens == min(chunk, 6 - done) > 0
            toks = reply[done : done + r.params.max_new_tokens]
            stop = 99 in toks or done + len(toks) == len(reply)
            out.append(Completion(toks, tuple(0.1 * t for t in toks), "stop" if stop else "length"))
        return out, len(calls)

    calls = []
    got = generate_in_segments([Request(p, SamplingParams(max_new_tokens=6)) for p in script], lambda rs: (calls.append(rs), call(rs))[1], chunk)
    assert [c.token_ids for c in got] == [(5, 6, 7, 8, 9, 10), (5, 99), (5, 6)]
    assert [c.finish_reason for c in got] == ["length", "stop", "stop"]
    assert len(calls) == -(-6 // chunk)  # the longest request's segments
    # the call of segment s reports version s + 1: the longest request's tokens carry their segment's
    assert got[0].versions == tuple(s + 1 for s in range(len(calls)) for _ in range(min(chunk, 6 - s * chunk)))
