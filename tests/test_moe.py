"""Mixture-of-experts models (models/moe.py): tiny Qwen3-MoE / Mixtral / Qwen2-MoE checkpoints, FSDP2,
the expert-load metrics and the load-balancing loss, one GRPO step, and the refusals.

Tolerance of the dp2 test: 1e-5 on fp32 log-probs, as in test_parallel_training.py: FSDP2 gathers
the very same weights, only the rows a rank sees together change, so only the order of fp32 sums
in the matmuls (and the grouped expert matmul) differs; routing is a top-k of router scores far
apart at this scale, so no token changes experts.
"""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch
from conftest import free_port, join_gloo, random_rl_batch, rl_overrides, train_and_read_metrics

from hybridflow.models.tiny import make_tiny_model

ROWS, PROMPT, RESPONSE = 8, 6, 5


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", arch="qwen3_moe", hidden_size=32, intermediate_size=64, num_experts=4)


@pytest.mark.parametrize("arch,cls_name", [("qwen3_moe", "Qwen3MoeForCausalLM"), ("mixtral", "MixtralForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM")])
def test_make_moe_model_and_load_back(tmp_path, arch, cls_name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridflow.models.moe import is_moe_checkpoint, moe_shape, routers
    from hybridflow.models.tiny import build_char_tokenizer, main_make_model

    assert main_make_model([str(tmp_path / arch), "--arch", arch, "--hidden-size", "32", "--experts", "6", "--experts-per-tok", "2"]) == 0
    cfg = json.loads((tmp_path / arch / "config.json").read_text())
    assert moe_shape(cfg) == (6, 2) and cfg["router_aux_loss_coef"] == 0.0  # HF saves num_experts as num_local_experts
    assert is_moe_checkpoint(str(tmp_path / arch))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / arch, dtype=torch.float32)
    assert type(model).__name__ == cls_name and len(routers(model)) == 2  # every layer sparse
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.gate.weight" in names
    assert ("model.layers.0.mlp.shared_expert.gate_proj.weight" in names) == (arch == "qwen2_moe")  # only Qwen2-MoE has one
    tok, ref = AutoTokenizer.from_pretrained(tmp_path / arch), build_char_tokenizer()
    assert tok.encode("max 3 8 1\n", add_special_tokens=False) == ref.encode("max 3 8 1\n", add_special_tokens=False)
    ids = torch.tensor([tok.encode("max 3 8 1", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
        assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)
    assert not is_moe_checkpoint(str(make_tiny_model(tmp_path / "dense", hidden_size=32, intermediate_size=64)))


def test_router_monitor_load_and_aux_loss_gradient(moe_dir):
    """Shares per layer sum to 1 over valid tokens only; the aux loss's gradient reaches the routers
    exactly as coef * d(mean over layers of HF's per-layer loss)/dW when the forward is the whole step."""
    from transformers import AutoModelForCausalLM

    from hybridflow.models.moe import RouterMonitor, load_balancing_loss, recording, routers
    from hybridflow.run_plan import UpdatePlan

    def run(coef: float):
        model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).train()
        mon = RouterMonitor.attach(model, coef)
        ids = torch.randint(3, 200, (3, 7), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(3, 7, dtype=torch.long)
        mask[0, :3] = 0  # left padding: 3 tokens the load must not count
        with recording(mon, {"attention_mask": mask}, UpdatePlan(micro_rows=3), "actor/moe") as moe:
            model(input_ids=ids, attention_mask=mask).logits.sum().backward()
        return model, mon, moe, mask

    model, mon, moe, mask = run(0.0)
    assert set(moe) == {"actor/moe/expert_load_min", "actor/moe/expert_load_max", "actor/moe/expert_load_entropy"}
    # Independent oracle: HF's own router logits (output_router_logits), top-2 over the valid tokens only.
    ids = torch.randint(3, 200, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits  # per layer [b*T, E]
    valid = mask.reshape(-1).bool()
    shares = torch.stack([torch.bincount(lg[valid].topk(2, dim=-1).indices.reshape(-1), minlength=4).double() / (2 * int(valid.sum()))
                          for lg in logits])  # [layers, E]
    want_ent = float(-(shares * shares.clamp(min=1e-30).log()).sum(-1).mean())
    assert moe["actor/moe/expert_load_min"] == pytest.approx(float(shares.min(-1).values.mean()), abs=1e-9)
    assert moe["actor/moe/expert_load_max"] == pytest.approx(float(shares.max(-1).values.mean()), abs=1e-9)
    assert moe["actor/moe/expert_load_entropy"] == pytest.approx(want_ent, abs=1e-9)
    assert moe["actor/moe/expert_load_min"] <= 1 / 4 <= moe["actor/moe/expert_load_max"]
    assert 0 < moe["actor/moe/expert_load_entropy"] <= math.log(4) + 1e-9
    assert torch.stack(mon.counts).sum() == 0  # cleared by metrics()
    plain = [r.weight.grad.clone() for r in routers(model)]
    model_aux, mon, moe, mask = run(0.1)
    assert moe["actor/moe/aux_loss"] > 0
    valid = mask.reshape(-1).bool()
    # the expected extra gradient: 0.1 * mean over layers of each layer's loss (the step is this one forward)
    model_ref = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).train()
    outs = []
    for r in routers(model_ref):
        r.register_forward_hook(lambda m, i, o: outs.append(o))
    model_ref(input_ids=torch.randint(3, 200, (3, 7), generator=torch.Generator().manual_seed(0)), attention_mask=mask)
    aux = sum(load_balancing_loss(lg, ids, 4, valid) for lg, _, ids in outs) / len(outs)
    grads = torch.autograd.grad(0.1 * aux, [r.weight for r in routers(model_ref)])
    for r, p, g in zip(routers(model_aux), plain, grads):
        torch.testing.assert_close(r.weight.grad - p, g, rtol=1e-4, atol=1e-7)
    assert abs(moe["actor/moe/aux_loss"] - float(aux.detach())) < 1e-5


def _data(vocab: int):
    return random_rl_batch(vocab, ROWS, PROMPT, RESPONSE)


def _dp2_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    join_gloo(rank, world, port)
    from hybridflow.config.schema import HybridFlowConfig
    from torch.distributed.fsdp import FSDPModule
    from hybridflow.run_plan import resolve
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker

    cfg = HybridFlowConfig()
    arr = cfg.actor_rollout_ref
    arr.model.path, arr.model.router_aux_loss_coef = path, 0.01
    arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size_per_gpu = ROWS, 2
    arr.rollout.n, arr.rollout.log_prob_micro_batch_size_per_gpu = 1, 2
    cfg.trainer.device, cfg.trainer.n_gpus_per_node = "cpu", world
    w = ActorRolloutRefWorker(resolve(cfg).actor, role="actor", total_training_steps=1)  # the switch: the GRPO test below
    w.init_model()
    fsdp_layers = sum(isinstance(m, FSDPModule) and type(m).__name__.endswith("Qwen3MoeDecoderLayer") for m in w.actor.module.modules())
    part = _data(len(w.tokenizer)).chunk(world)[rank]
    old = w.compute_log_prob(part)
    part.tensors["old_log_probs"] = old["old_log_probs"]
    metrics = w.update_actor(part)
    with open(f"{out}/{rank}", "wb") as f:
        pickle.dump({"logp": old["old_log_probs"], "metrics": metrics, "fsdp_layers": fsdp_layers}, f)
    torch.distributed.destroy_process_group()


def test_fsdp2_dp2_moe_matches_one_process(moe_dir, tmp_path):
    """2 FSDP2 ranks (each MoE decoder layer its own unit) give the single process's log-probs; one
    PPO update reports the expert load and the aux loss (router_aux_loss_coef 0.01)."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    mp.spawn(_dp2_worker, args=(2, free_port(), str(moe_dir), str(tmp_path)), nprocs=2)
    ranks = [pickle.load(open(tmp_path / str(r), "rb")) for r in range(2)]
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    data = _data(model.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"], position_ids=data["position_ids"]).logits
    ref = torch.log_softmax(logits[:, PROMPT - 1 : -1].float(), -1).gather(-1, data["responses"][..., None])[..., 0]  # [b, R]
    torch.testing.assert_close(torch.cat([r["logp"] for r in ranks]), ref, rtol=0, atol=1e-5)
    for r in ranks:
        assert r["fsdp_layers"] == 2  # both MoE decoder layers are FSDP2 units
        m = r["metrics"]
        assert m["actor/moe/expert_load_min"] <= 1 / 4 <= m["actor/moe/expert_load_max"], m
        assert 0 < m["actor/moe/expert_load_entropy"] <= math.log(4) + 1e-9 and m["actor/moe/aux_loss"] > 0, m


def test_grpo_step_on_moe_model_logs_expert_load(ray_cluster, task_dir, tmp_path):
    """One GRPO step of the trainer on a tiny Qwen3-MoE (2 workers with expert parallelism: 2 experts each,
    the rest FSDP2-sharded; HF rollout with whole experts, weight check on)."""
    model = make_tiny_model(tmp_path / "m", arch="qwen3_moe", hidden_size=32, intermediate_size=64, num_experts=4)
    rows = train_and_read_metrics(rl_overrides(model, task_dir, tmp_path / "run", "trainer.total_training_steps=1", "trainer.check_weight_sync=true",
                                               "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.expert_parallel_size=2"), tmp_path / "run")
    m = rows[-1]
    assert m["actor/moe/expert_load_min"] <= 1 / 4 <= m["actor/moe/expert_load_max"], m
    assert 0 < m["actor/moe/expert_load_entropy"] <= math.log(4) + 1e-9, m
    assert "actor/moe/aux_loss" not in m  # router_aux_loss_coef defaults to 0
    assert m["reshard/weight_max_diff"] == 0.0 and m["reshard/bytes_per_rank"] == m["reshard/min_bytes_per_rank"]


def test_moe_refusals_name_the_key(moe_dir, tmp_path):
    """Before any worker starts: vLLM with an MoE model, and a negative aux-loss coefficient."""
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.config.loader import ConfigError
    from hybridflow.config.validate import validate_config

    for name in ("train.parquet", "val.parquet"):
        (tmp_path / name).write_text("")
    base = [f"actor_rollout_ref.model.path={moe_dir}", f"data.train_files=[{tmp_path / 'train.parquet'}]",
            f"data.val_files=[{tmp_path / 'val.parquet'}]", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4"]
    validate_config(load_config(None, base, schema=HybridFlowConfig))  # the MoE model itself is fine (hf rollout)
    with pytest.raises(ConfigError) as e:
        validate_config(load_config(None, [*base, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.router_aux_loss_coef=-1"],
                                    schema=HybridFlowConfig))
    lines = str(e.value).splitlines()
    assert any(line.strip(" -").startswith("actor_rollout_ref.rollout.name=vllm:") and "mixture-of-experts" in line and "name=hf" in line
               for line in lines), lines
    assert any("actor_rollout_ref.model.router_aux_loss_coef must be a number >= 0" in line for line in lines), lines
