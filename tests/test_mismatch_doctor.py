"""`hybridflow mismatch`: the doctor names the layer where the rollout side starts to differ."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.protocol import SamplingParams
from hybridflow.utils.mismatch import diagnose

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    from hybridflow.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "four", hidden_size=64, intermediate_size=128, num_hidden_layers=4)


@pytest.mark.parametrize("exact", [False, True], ids=["generate", "exact"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_doctor_names_the_layer_perturbed_on_the_rollout_side_only(four_layers, dtype, exact):
    """Layer 2's MLP output weights nudged on the rollout side only (by 2% of their largest entry in
    fp32, 20% in bf16, whose rounding alone moves this model's activations by ~1e-3):
    the doctor names model.layers.2, for the KV-cached generate sampler (whose kernels differ from
    the trainer's at rounding level before it) and for the exact one (0 before it); unperturbed, it
    names no layer (and the exact replay agrees bit for bit)."""
    tok = AutoTokenizer.from_pretrained(four_layers)
    train = AutoModelForCausalLM.from_pretrained(four_layers, dtype=DTYPES[dtype]).eval()
    prompts = [tok.encode(t) for t in ("What is 2*3?", "Hi there", "x")]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1)
    same = diagnose(train, copy.deepcopy(train), tok, prompts, params, exact=exact)
    assert same.named is None
    if exact:
        assert all(p.max == 0.0 for p in same.probes) and same.logprob_max == 0.0
    gen = copy.deepcopy(train)
    with torch.no_grad():
        w = gen.model.layers[2].mlp.down_proj.weight
        w.add_((0.02 if dtype == "fp32" else 0.2) * w.abs().max())
    report = diagnose(train, gen, tok, prompts, params, exact=exact)
    assert report.named == "model.layers.2", report.table()
    assert [p.name for p in report.probes][:2] == ["model.embed_tokens", "model.layers.0"]
    assert report.logprob_max > 0 and "<- the difference starts here" in report.table()


@pytest.fixture(scope="module")
def moe_three_layers(tmp_path_factory):
    from hybridflow.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("model") / "moe", arch="qwen3_moe", hidden_size=32, intermediate_size=64,
                           num_experts=8, num_hidden_layers=3)


@pytest.mark.parametrize("exact", [False, True], ids=["generate", "exact"])
def test_the_doctor_reports_where_the_experts_differ_on_an_moe_model(moe_three_layers, exact):
    """A tiny Qwen3-MoE (3 layers, 8 experts, top-2), fp32 on both sides. Unperturbed, the expert sets
    agree (exact: every token, the same computation; generate: other kernels, so only a near tie
    could flip, and this model has none in these prompts). Layer 1's router rows rolled by one on
    the rollout side only (expert j scores what expert j - 1 did, so every token's top-2 set moves):
    layer 1's share is 1.0, layer 0's (before the change) stays 0, and the doctor names
    model.layers.1. (Layer 2 reads layer 1's changed output, so some of its tokens move too.)"""
    tok = AutoTokenizer.from_pretrained(moe_three_layers)
    train = AutoModelForCausalLM.from_pretrained(moe_three_layers, dtype=torch.float32).eval()
    prompts = [tok.encode(t) for t in ("What is 2*3?", "Hi there", "x")]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=1)
    same = diagnose(train, copy.deepcopy(train), tok, prompts, params, exact=exact)
    assert same.routing_differs == {"model.layers.0": 0.0, "model.layers.1": 0.0, "model.layers.2": 0.0}, same.table()
    if exact:  # the exact mode holds for MoE as for dense: the sampler's numbers are the trainer's, routing included
        assert all(p.max == 0.0 for p in same.probes) and same.logprob_max == 0.0
    gen = copy.deepcopy(train)
    with torch.no_grad():
        gate = gen.model.layers[1].mlp.gate.weight  # [E, H]
        gate.copy_(gate.roll(1, dims=0))
    report = diagnose(train, gen, tok, prompts, params, exact=exact)
    assert report.routing_differs["model.layers.0"] == 0.0 and report.routing_differs["model.layers.1"] == 1.0, report.table()
    assert report.named == "model.layers.1" and "experts differ" in report.table()
