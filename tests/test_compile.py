"""Compiled decoder layers (`engine/compile.py`, actor/ref `use_torch_compile`) against the eager model.

Oracle: the same weights in an eager float64 copy. Compiling changes only the order and fusion of
fp32 operations (inductor fuses the RMSNorm's reduction, the SiLU x up product, the residual adds;
the matmuls are the same library calls), so the compiled fp32 pass must be about as far from the
float64 values as the eager fp32 pass is: its error is bounded by a small multiple (4x) of eager's
own measured fp32 error, plus one fp32 unit of the value's size (to allow for an eager error of 0 at
a position). Checked: response log-probs, entropies, the loss and every parameter's gradient, on
left-padded rows through the engine's own pass (`response_logprobs`, chunked head). Also: no graph
break, and one compiled graph serves every layer (dynamo's counters).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybridflow.config import ConfigError, load_config
from hybridflow.config.validate import validate_config
from hybridflow.engine.compile import compile_decoder_layers, compile_stats, is_compiled
from hybridflow.engine.model import response_logprobs
from hybridflow.models.tiny import make_tiny_model
from hybridflow.protocol import Batch

U32 = 2.0**-24


def _batch(vocab: int, b: int = 4, prompt: int = 7, resp: int = 5) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (b, prompt + resp), generator=g)
    mask = torch.ones_like(ids)
    for i in range(b):  # left padding of i tokens, and a response that ends early on the last row
        mask[i, :i] = 0
    mask[-1, -2:] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, prompt:]})


def _pass(model, mb):
    """(log-probs [b, R], entropies [b, R], loss, {name: grad}) through the engine's pass."""
    model.zero_grad(set_to_none=True)
    lp, ent = response_logprobs(model, mb, chunk=16)
    w = mb["attention_mask"][:, -lp.shape[1]:].to(lp.dtype)
    loss = -(lp * w).sum() / w.sum() - 0.01 * (ent * w).sum() / w.sum()
    loss.backward()
    return lp.detach(), ent.detach(), loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _check(name, got, eager, ref):
    ref = ref.to(got.dtype)
    err_c, err_e = (got - ref).abs().max().item(), (eager - ref).abs().max().item()
    bound = 4 * err_e + U32 * ref.abs().max().item()
    assert err_c <= bound, f"{name}: compiled off by {err_c:.3g} from float64, eager by {err_e:.3g} (bound {bound:.3g})"


def test_compiled_layers_equal_eager_within_fp32_rounding(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(str(tmp_path / "tiny"), hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    eager = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    compiled = copy.deepcopy(eager)
    exact64 = copy.deepcopy(eager).double()
    before = compile_stats()
    assert compile_decoder_layers(compiled) == 2 and compile_decoder_layers(compiled) == 0  # idempotent
    assert is_compiled(compiled) and not is_compiled(eager)
    mb = _batch(eager.config.vocab_size)
    out_c, out_e, out_64 = _pass(compiled, mb), _pass(eager, mb), _pass(exact64, mb)
    after = compile_stats()
    assert after["compile/graph_breaks"] == before["compile/graph_breaks"]
    assert after["compile/graphs"] - before["compile/graphs"] == 1  # both layers run one compiled graph
    for i, what in enumerate(("log-probs", "entropies", "loss")):
        _check(what, out_c[i], out_e[i], out_64[i])
    for n in out_64[3]:
        _check(f"grad {n}", out_c[3][n], out_e[3][n], out_64[3][n])


@pytest.mark.parametrize("extra, pattern", [
    (["actor_rollout_ref.actor.tensor_model_parallel_size=2"], r"actor_rollout_ref\.actor\.use_torch_compile=true compiles decoder layers under plain FSDP"),
    (["actor_rollout_ref.rollout.exact=true"], r"use_torch_compile=true with actor_rollout_ref\.rollout\.exact=true"),
])
def test_compile_refused_where_untested(extra, pattern):
    cfg = load_config(None, ["actor_rollout_ref.model.path=x", "actor_rollout_ref.actor.use_torch_compile=true", *extra])
    with pytest.raises(ConfigError, match=pattern):
        validate_config(cfg)


def test_bf16_on_cpu_runs_eager_attention_with_the_same_log_probs(tmp_path):
    """bf16 compute on CPU switches SDPA to eager attention (engine/cpu_kernels.py); fp32 keeps SDPA.
    Both implement the same masked attention: on left-padded rows and packed ones (remove_padding)
    their fp32 log-probs agree to rounding (a few fp32 units of |log p| <= log V ~ 5)."""
    from transformers import AutoModelForCausalLM

    from hybridflow.engine.cpu_kernels import prefer_cpu_bf16_attention

    path = make_tiny_model(str(tmp_path / "tiny"), hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    sdpa = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    eager = copy.deepcopy(sdpa)
    assert not prefer_cpu_bf16_attention(eager, torch.float32, "cpu") and not prefer_cpu_bf16_attention(eager, torch.bfloat16, "cuda")
    assert prefer_cpu_bf16_attention(eager, torch.bfloat16, "cpu") and eager.config._attn_implementation == "eager"
    mb = _batch(sdpa.config.vocab_size)
    valid = mb["attention_mask"][:, -mb["responses"].shape[1]:].bool()
    for packed in (False, True):
        a, b = (response_logprobs(m, mb, remove_padding=packed, chunk=16)[0] for m in (sdpa, eager))
        assert (a - b)[valid].abs().max() <= 64 * U32 * 8
