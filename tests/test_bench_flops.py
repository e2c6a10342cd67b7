"""The benches' FLOP accounting (bench/flops.py) against torch's own FLOP counter on a real forward."""

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from bench.flops import forward_flops, generation_flops, matmul_params
from hybridflow.planning.arch import load_arch


def test_forward_flops_match_torch_flop_counter(tiny_model_dir):
    """torch counts every matmul of an eager forward: the linear layers and LM head (2 M L) plus
    QK^T and AV in full (4 n a L^2); the causal accounting counts half of the attention."""
    arch = load_arch(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert matmul_params(arch) == sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    L = 24
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, arch.vocab, (1, L)))
    a = arch.heads * arch.head_dim
    want = forward_flops(arch, [L]) + 2 * arch.layers * a * L * L
    # transformers up to 5.17 computes the rotary angles as a matmul (inv_freq [head_dim/2, 1] @ positions [1, L],
    # once per forward: counted), later releases as a broadcast product (not counted); neither is a model FLOP
    rotary = 2 * (arch.head_dim // 2) * L
    assert counter.get_total_flops() in (want, want + rotary)


def test_generation_flops_are_prefill_plus_decode_by_hand(tiny_model_dir):
    arch = load_arch(str(tiny_model_dir))
    m, a, n, head = matmul_params(arch), arch.heads * arch.head_dim, arch.layers, arch.vocab * arch.hidden
    # prompt 5, 3 new tokens: prefill 2*m*5 + 2*n*a*25 less the head at the 4 positions whose logits generate
    # drops, decodes at contexts 5, 6, 7
    want = 2 * m * 5 - 2 * head * 4 + 2 * n * a * 25 + 3 * 2 * m + 4 * n * a * (5 + 6 + 7)
    assert generation_flops(arch, [5], [3]) == want


def test_forward_flops_count_the_head_where_logits_are_kept(tiny_model_dir):
    """torch's counter on a forward that keeps the last 3 positions' logits (HF's logits_to_keep, as
    the log-prob pass projects only the response): the head counted at 3 positions, not 24."""
    arch = load_arch(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    L, R = 24, 3
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, arch.vocab, (1, L)), logits_to_keep=R)
    want = forward_flops(arch, [L], logits=[R]) + 2 * arch.layers * arch.heads * arch.head_dim * L * L
    rotary = 2 * (arch.head_dim // 2) * L
    assert counter.get_total_flops() in (want, want + rotary)
