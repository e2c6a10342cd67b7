"""LoRA on a vision-language model (actor_rollout_ref.model.lora_rank > 0 on the tiny Qwen2-VL / Qwen2.5-VL): adapters on the
language model's projections only, never on the vision tower's linear layers (whose Qwen2.5-VL names gate_proj / up_proj /
down_proj the targets would match too), the tower and the rest of the base frozen; the trainer's log-probs with images equal
a plain HF forward of the model with the adapters merged; in a GRPO run the switch moves the adapters alone after the first
step and the generation weights equal the trained ones; trainer.save_hf_model writes the adapters merged."""

from __future__ import annotations

import json
import pathlib
import pickle

import pytest
import torch

from conftest import free_port, join_gloo, rl_overrides
from hybridflow.config.schema import ModelConfig
from hybridflow.models.lora import apply_lora, is_adapter_param
from hybridflow.models.tiny import main_make_model
from hybridflow.models.vlm import load_processor
from test_vision import _load_model, _vlm_train_batch

RANK, ALPHA = 4, 8
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "recipes" / "vision"  # the vision recipe's SFT warm start (a tiny Qwen2-VL)


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    out = {}
    for arch in ("qwen2_vl", "qwen2_5_vl"):
        out[arch] = tmp_path_factory.mktemp("vlm_lora") / arch
        assert main_make_model([str(out[arch]), "--arch", arch]) == 0
    return out


def _expected_adapters(config: dict) -> set[str]:
    """The adapter FQNs LoRA must create: A and B on the 7 projections of every language-model layer, from config.json alone."""
    layers = config["text_config"]["num_hidden_layers"]
    return {f"model.language_model.layers.{i}.{p}.lora_{ab}.default.weight" for i in range(layers) for p in PROJ for ab in "AB"}


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]])
def test_adapters_on_the_language_model_only(vlm_dirs, arch, targets):
    """Both target spellings give the 14 language-model adapters per layer and nothing in model.visual (the tower's qkv / proj /
    fc1 / fc2, Qwen2.5-VL's tower gate_proj / up_proj / down_proj, the merger's mlp.0 / mlp.2 keep no adapter); only the
    adapters require grad; the export's PEFT model (`lora_config` of the same model config) targets the same modules."""
    from peft import get_peft_model

    from hybridflow.models.lora import lora_config

    path = vlm_dirs[arch]
    mcfg = ModelConfig(path=str(path), lora_rank=RANK, lora_alpha=ALPHA, target_modules=targets)
    model = apply_lora(_load_model(path), mcfg)
    want = _expected_adapters(json.loads((path / "config.json").read_text()))
    names = {n for n, _ in model.named_parameters()}
    assert {n for n in names if is_adapter_param(n)} == want
    assert {n for n, p in model.named_parameters() if p.requires_grad} == want
    tower = [n for n in names if n.startswith("model.visual.")]
    assert tower and not any(".base_layer." in n for n in tower)  # the tower's layers are not LoRA layers at all
    peft_names = {n.removeprefix("base_model.model.") for n, _ in get_peft_model(_load_model(path), lora_config(mcfg)).named_parameters()}
    assert {n for n in peft_names if is_adapter_param(n)} == want


def _lora_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    """One FSDP2 rank: the actor with LoRA on image batches: log-probs at B = 0, one update, the gradients of one more
    backward, log-probs with the updated adapters, the full weights before and after."""
    join_gloo(rank, world, port)
    from transformers import AutoConfig

    from hybridflow.config.schema import HybridFlowConfig
    from hybridflow.run_plan import resolve
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker

    batch, _, _ = _vlm_train_batch(load_processor(path), AutoConfig.from_pretrained(path))
    cfg = HybridFlowConfig()
    arr = cfg.actor_rollout_ref
    arr.model.path, arr.model.lora_rank, arr.model.lora_alpha = path, RANK, ALPHA
    arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size_per_gpu, arr.actor.optim.lr = 4, 2, 2e-2
    arr.rollout.n, arr.rollout.log_prob_micro_batch_size_per_gpu = 1, 2
    cfg.trainer.device, cfg.trainer.n_gpus_per_node = "cpu", world
    w = ActorRolloutRefWorker(resolve(cfg).actor, role="actor", total_training_steps=2)
    w.init_model()
    base_lp = w.compute_log_prob(batch)["old_log_probs"]
    before = {k: v.clone() for k, v in w.actor.state_dict().items()}  # at world 1 the full state dict holds the parameters themselves
    batch.tensors["old_log_probs"] = base_lp
    w.update_actor(batch)  # B moves off zero

    def loss(lp, ent, mb):  # log-prob and entropy terms: both reach the adapters through the masked vision logits
        return -(lp * mb["response_mask"]).sum() - 0.5 * (ent * mb["response_mask"]).sum()

    w.actor.forward_backward(batch, loss, 2)
    local = [(n, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for n, p in w.actor.module.named_parameters() if p.grad is not None]
    grads = {n: float(g.norm()) for n, g in local}
    trainable = sorted(n for n, p in w.actor.module.named_parameters() if p.requires_grad)
    w.actor.optimizer.zero_grad(set_to_none=True)
    lp = w.compute_log_prob(batch)["old_log_probs"]
    with open(f"{out}/rank{rank}", "wb") as f:
        pickle.dump({"base_lp": base_lp, "lp": lp, "before": before, "after": w.actor.state_dict(), "grads": grads, "trainable": trainable}, f)
    torch.distributed.destroy_process_group()


def _masked_oracle(model, batch, items, config) -> torch.Tensor:
    """Per row, a plain HF forward of the unpadded prompt + response with the row's pixel values (the model's own rope index),
    float64 log-softmax with the vision tokens' logits -inf (the rollout never samples them): [b, R]."""
    vision = [config.vision_start_token_id, config.vision_end_token_id, config.image_token_id, config.video_token_id]
    out = torch.zeros(batch["responses"].shape, dtype=torch.float64)
    with torch.no_grad():
        for r, it in enumerate(items):
            n, P = int(batch["response_mask"][r].sum()), len(it["input_ids"])
            ids = torch.tensor([it["input_ids"] + batch["responses"][r, :n].tolist()])
            z = model(input_ids=ids, mm_token_type_ids=(ids == config.image_token_id).long(), **it["multi_modal_inputs"]).logits[0, P - 1 : -1].double()
            z[:, vision] = float("-inf")
            out[r, :n] = torch.log_softmax(z, -1).gather(-1, ids[0, P:, None])[:, 0]
    return out


def _merge(state: dict) -> dict:
    """The adapters merged into the base by hand (float64): X.weight = X.base_layer.weight + B @ A * alpha / r; no peft."""
    merged = {k.replace(".base_layer.", "."): v for k, v in state.items() if not is_adapter_param(k)}
    for k in [k for k in state if k.endswith(".lora_A.default.weight")]:
        layer = k.removesuffix(".lora_A.default.weight")
        a, b = state[k].double(), state[f"{layer}.lora_B.default.weight"].double()
        merged[f"{layer}.weight"] = (state[f"{layer}.base_layer.weight"].double() + b @ a * (ALPHA / RANK)).float()
    return merged


def test_lora_vlm_trainer_logprobs_equal_merged_hf_and_only_adapters_train(vlm_dirs, tmp_path):
    """The actor worker (FSDP2) with LoRA on the tiny Qwen2-VL and image batches: at B = 0 its log-probs equal the base model's
    (plain HF forward, vision logits masked as the rollout samples); after one update they equal a plain HF forward of the
    model with the adapters merged by hand; the update changed the adapters and left every other weight (the whole vision
    tower included) bit for bit; only the adapters require grad and every adapter got a gradient."""
    import torch.multiprocessing as mp
    from transformers import AutoConfig

    path = vlm_dirs["qwen2_vl"]
    mp.spawn(_lora_worker, args=(1, free_port(), str(path), str(tmp_path)), nprocs=1)
    r = pickle.load(open(tmp_path / "rank0", "rb"))
    config = AutoConfig.from_pretrained(str(path))
    batch, items, _ = _vlm_train_batch(load_processor(path), config)
    mask = batch["response_mask"].bool()
    base = _masked_oracle(_load_model(path), batch, items, config)
    # fp32 padded forwards against a float64 softmax of unpadded ones: ~1e-6 apart (test_vision.py's bound)
    torch.testing.assert_close(r["base_lp"][mask].double(), base[mask], rtol=0, atol=2e-5)

    adapters = _expected_adapters(json.loads((path / "config.json").read_text()))
    before, after = r["before"], r["after"]
    assert {k for k in after if is_adapter_param(k)} == adapters
    assert all(torch.equal(before[k], after[k]) for k in before if not is_adapter_param(k))  # the frozen base, tower included
    assert any(k.startswith("model.visual.blocks.") for k in before)
    assert all(not torch.equal(before[k], after[k]) for k in adapters if ".lora_B." in k)  # every B moved off zero
    assert set(r["trainable"]) == adapters and set(r["grads"]) == adapters and all(v > 0 for v in r["grads"].values()), r["grads"]

    merged = _load_model(path)
    merged.load_state_dict(_merge(after), strict=True)
    want = _masked_oracle(merged, batch, items, config)
    torch.testing.assert_close(r["lp"][mask].double(), want[mask], rtol=0, atol=2e-5)
    assert (want - base)[mask].abs().max() > 1e-3  # the adapters moved the policy: the check above is not the base's


def _adapter_bytes_per_rank(model_dir: pathlib.Path, dp: int) -> int:
    """fp32 bytes of the rank-RANK adapters (A [r, in] + B [out, r]) on the 7 projections of every language-model layer, from
    config.json's text_config (independent of peft and of the planner), over dp FSDP ranks."""
    c = json.loads((model_dir / "config.json").read_text())["text_config"]
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    h, q, kv, i = c["hidden_size"], c["num_attention_heads"] * head, c["num_key_value_heads"] * head, c["intermediate_size"]
    per_layer = RANK * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    return 4 * per_layer * c["num_hidden_layers"] // dp


@pytest.mark.timeout(600)
def test_lora_vlm_grpo_moves_the_adapters_and_generation_equals_training(ray_cluster, tmp_path):
    """2 GRPO steps with LoRA on the vision recipe's warm start (2 FSDP2 workers, the colocated HF rollout, images): the
    generation weights equal the trained ones after every switch (reshard/weight_max_diff 0), the second switch moves the
    adapters' bytes alone (computed from config.json; the planner's minimum), the vision tower is frozen and moved once; the
    rollout's log-probs equal the trainer's old ones (rollout/logprob_diff_max: the vision tokens masked on both sides);
    trainer.save_hf_model writes base + B A * alpha / r with the checkpoint's adapters and the tower unchanged."""
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.data.vision_task import make_vision_task
    from hybridflow.trainer.rl import RLTrainer
    from test_e2e_reliability import _checkpoint

    data = tmp_path / "data"
    make_vision_task(data, n_train=8, n_val=4, sft_copies=1)
    out = tmp_path / "run"
    cfg = load_config(None, rl_overrides(FIXTURE, data, out, "data.max_prompt_length=64", "data.max_response_length=8", "data.train_batch_size=2",
                                         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                         f"actor_rollout_ref.model.lora_rank={RANK}", f"actor_rollout_ref.model.lora_alpha={ALPHA}",
                                         "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.optim.lr=2e-2",
                                         "trainer.check_weight_sync=true", "trainer.total_training_steps=2", "trainer.save_freq=2",
                                         "trainer.save_hf_model=true", "actor_rollout_ref.hybrid_engine.keep_generation_buffers=false"),
                      schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        hist = [h for h in trainer.fit()["history"] if h["step"] > 0]
        plan = trainer.plan_summary
    finally:
        trainer.shutdown()
    first, second = hist
    assert "ref" not in set(trainer.placed.views())  # the reference is the actor with its adapters off
    assert first["actor/kl_loss"] == 0.0
    base = _load_model(FIXTURE).state_dict()
    tower = [k for k in base if k.startswith("model.visual.")]
    assert set(tower) <= set(plan["frozen_params"]) and not any(is_adapter_param(n) for n in plan["frozen_params"])
    adapter_half = _adapter_bytes_per_rank(FIXTURE, 2)
    assert max(plan["min_bytes_per_rank"]) == adapter_half < max(plan["first_switch_bytes_per_rank"])
    for h in hist:
        assert h["reshard/weight_max_diff"] == 0.0, h  # the generation model (adapters unmerged) holds the trained weights
        # the rollout's log-probs (vision tokens suppressed) against the trainer's old ones (masked): fp32 kernel rounding only
        assert h["rollout/logprob_diff_max"] < 1e-5, h["rollout/logprob_diff_max"]
    assert second["reshard/bytes_per_rank"] == adapter_half == second["reshard/min_bytes_per_rank"]

    adapters = _checkpoint(out / "global_step_2")["actor"]["model"]
    assert adapters and all(is_adapter_param(k) and ".visual." not in k for k in adapters)
    saved = _load_model(out / "hf_model").state_dict()
    assert saved.keys() == base.keys()  # plain HF names: no base_layer / lora_ keys
    assert all(torch.equal(saved[k], base[k]) for k in tower)
    merged = _merge({**{k: v for k, v in base.items()}, **adapters, **{k.replace(".lora_A.default.", ".base_layer."): base[k.replace(".lora_A.default.", ".")]
                                                                       for k in adapters if ".lora_A." in k}})
    for k, v in merged.items():
        torch.testing.assert_close(saved[k], v, rtol=1e-6, atol=1e-6, msg=k)  # both W + s B A in fp32 / float64; the order differs
    assert not torch.equal(saved["model.language_model.layers.0.self_attn.q_proj.weight"], base["model.language_model.layers.0.self_attn.q_proj.weight"])
    # the processor beside the weights, and `hybridflow export --merge` of the checkpoint: the image-text-to-text class,
    # the same merged weights as save_hf_model's, the processor saved as one (what AutoProcessor reads back)
    from hybridflow.utils.export import export_checkpoint

    fixture_processor = load_processor(FIXTURE)
    exported = export_checkpoint(str(out / "global_step_2"), str(tmp_path / "export"), merge=True)
    for d in (out / "hf_model", exported):
        processor = load_processor(d)
        assert processor.tokenizer.get_vocab() == fixture_processor.tokenizer.get_vocab() and processor.chat_template == fixture_processor.chat_template
    exported_state = _load_model(exported).state_dict()
    assert exported_state.keys() == saved.keys()
    for k, v in saved.items():
        torch.testing.assert_close(exported_state[k], v, rtol=1e-6, atol=1e-6, msg=k)  # W + s B A merged by peft vs by the engine
