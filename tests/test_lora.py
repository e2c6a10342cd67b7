"""LoRA adapters (hybridflow/models/lora.py) on the tiny HF model, in one process: what trains, the
reference as the adapter-free model (bit for bit), the merged export, and the roles a LoRA run starts."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config import HybridFlowConfig, load_config
from hybridflow.config.schema import ModelConfig
from hybridflow.config.pools import Role, active_roles
from hybridflow.models.lora import adapters_disabled, apply_lora, is_adapter_param, merged_state_dict

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ids(n=3, length=12, seed=0):
    return torch.randint(0, 200, (n, length), generator=torch.Generator().manual_seed(seed))


def _randomize_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_param(name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_only_the_adapters_train_and_start_as_the_base(tiny_model_dir):
    base, model = _model(tiny_model_dir), _model(tiny_model_dir)
    ids = _ids()
    apply_lora(model, ModelConfig(path=str(tiny_model_dir), lora_rank=4, lora_alpha=8))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    layers = base.config.num_hidden_layers
    expected = {f"model.layers.{i}.{'self_attn' if m in PROJECTIONS[:4] else 'mlp'}.{m}.lora_{ab}.default.weight"
                for i in range(layers) for m in PROJECTIONS for ab in "AB"}
    assert trainable == expected  # all-linear: every projection, not the output head or the embeddings
    shapes = dict(model.named_parameters())
    assert shapes["model.layers.0.self_attn.q_proj.lora_A.default.weight"].shape == (4, base.config.hidden_size)
    with torch.no_grad():  # B starts at zero: the adapted model is the base, exactly
        assert torch.equal(model(ids).logits, base(ids).logits)
    only_q = _model(tiny_model_dir)
    apply_lora(only_q, ModelConfig(path=str(tiny_model_dir), lora_rank=2, target_modules=["q_proj", "v_proj"]))
    assert {n.split(".")[-4] for n, p in only_q.named_parameters() if p.requires_grad} == {"q_proj", "v_proj"}


def test_reference_is_the_base_bit_for_bit_with_adapters_off(tiny_model_dir):
    base, model = _model(tiny_model_dir), _model(tiny_model_dir)
    apply_lora(model, ModelConfig(path=str(tiny_model_dir), lora_rank=4, lora_alpha=8))
    _randomize_adapters(model)
    ids = _ids()
    with torch.no_grad():
        adapted = model(ids).logits
        with adapters_disabled(model):
            off = model(ids).logits
        again = model(ids).logits
        plain = base(ids).logits
    assert torch.equal(off, plain)  # the reference policy costs no weights and is exact
    assert not torch.allclose(adapted, plain, atol=1e-3)  # the adapters do change the policy
    assert torch.equal(again, adapted)  # and are back on after the block
    assert all(p.requires_grad == is_adapter_param(n) for n, p in model.named_parameters())


def test_merged_state_dict_is_a_plain_hf_model_with_the_same_outputs(tiny_model_dir):
    model = _model(tiny_model_dir)
    apply_lora(model, ModelConfig(path=str(tiny_model_dir), lora_rank=4, lora_alpha=8))
    _randomize_adapters(model)
    merged = merged_state_dict(model.state_dict(), model)
    plain = _model(tiny_model_dir)
    assert set(merged) == set(plain.state_dict())  # HF names: no base_layer, no lora_
    plain.load_state_dict(merged)
    ids = _ids()
    with torch.no_grad():
        # W x + s B A x (unmerged, fp32) vs (W + s B A) x: equal up to fp32 rounding of the reordered sum
        torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_lora_with_a_kl_term_starts_no_reference_role(tmp_path):
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "grpo_tiny.yaml"), ["actor_rollout_ref.actor.use_kl_loss=true"], schema=HybridFlowConfig)
    assert Role.REF in active_roles(cfg)
    cfg.actor_rollout_ref.model.lora_rank = 8
    assert Role.REF not in active_roles(cfg)
    from hybridflow.trainer.roles import RunRoles

    roles = RunRoles.of(cfg)
    assert not roles.use_ref and roles.ref_in_actor and roles.ref_log_prob


@pytest.mark.parametrize("verl_keys", [["actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.model.lora_alpha=32",
                                        "actor_rollout_ref.model.target_modules=all-linear"]])
def test_verl_lora_keys_load(verl_keys):
    cfg = load_config(None, verl_keys, schema=HybridFlowConfig)
    m = cfg.actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, list(m.target_modules)) == (32, 32.0, ["all-linear"])


def _adapter_numel(config: dict, rank: int) -> int:
    """Adapter parameters on the 7 projections of every layer, by hand from config.json: r * (in + out) each."""
    h, i = config["hidden_size"], config["intermediate_size"]
    head = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    per_layer = rank * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    return per_layer * config["num_hidden_layers"]


def test_planner_counts_lora_as_peft_builds_it(tiny_model_dir):
    """`hybridflow plan --lora-rank`: the parameter table is peft's, the steady switch moves the
    adapters alone (the first one the whole model), and only adapters have grads and optimizer state."""
    import json

    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import Cluster, MemoryInputs, rows

    model = _model(tiny_model_dir)
    apply_lora(model, ModelConfig(path=str(tiny_model_dir), lora_rank=4))
    arch = load_arch(str(tiny_model_dir))
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == arch.param_shapes(lora_rank=4)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    adapters = _adapter_numel(config, 4)
    cluster = Cluster(1, 2, 1e9, 1e9, 1e-5, 1e10, 2**34)
    full = {r["mode"]: r for r in rows(arch, ParallelDims(dp=2), 1, cluster, MemoryInputs(param_bytes=4), "fp32")}
    lora = {r["mode"]: r for r in rows(arch, ParallelDims(dp=2), 1, cluster, MemoryInputs(param_bytes=4, lora_rank=4), "fp32")}
    # fp32, FSDP over 2 ranks, one generation replica per rank: each rank receives the half it does not hold
    assert lora["optimized"]["bytes_per_rank"] == 4 * adapters // 2
    assert lora["optimized"]["first_switch_bytes_per_rank"] == full["optimized"]["bytes_per_rank"] + 4 * adapters // 2
    # generation TP 1: every rank needs every weight, so the naive all-gather moves the whole model each switch
    assert lora["naive"]["bytes_per_rank"] == lora["optimized"]["first_switch_bytes_per_rank"]
    assert lora["optimized"]["memory"]["grads"] == 4 * adapters // 2  # fp32 grads of this rank's adapter shard
    assert lora["optimized"]["memory"]["optimizer"] == 8 * adapters // 2  # AdamW's two moments
    assert full["optimized"]["memory"]["optimizer"] > 10 * lora["optimized"]["memory"]["optimizer"]
    # the 2 ranks on 2 nodes: every steady byte crosses, and only the adapters' (each rank gets the other's half)
    two_nodes = rows(arch, ParallelDims(dp=2), 1, Cluster(2, 1, 1e9, 1e9, 1e-5, 1e10, 2**34), MemoryInputs(param_bytes=4, lora_rank=4), "fp32")[0]
    assert two_nodes["cross_node_bytes"] == 4 * adapters


def test_a_critic_trains_adapters_and_its_new_value_head(tiny_model_dir):
    from hybridflow.models.hf import load_hf_model

    critic = apply_lora(load_hf_model(ModelConfig(path=str(tiny_model_dir)), "cpu", kind="value"),
                        ModelConfig(path=str(tiny_model_dir), lora_rank=4), full=("score",))
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert "score.weight" in trainable and not any("score.lora" in n or "score.base_layer" in n for n, _ in critic.named_parameters())
    assert trainable - {"score.weight", "score.bias"} == {n for n, _ in critic.named_parameters() if is_adapter_param(n)}
