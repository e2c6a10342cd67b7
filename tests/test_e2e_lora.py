"""LoRA GRPO end to end on 2 Ray workers (FSDP2): the reference is the actor with its adapters off
(no reference role), after the first switch only the adapters move, checkpoints hold the adapters and
their optimizer state alone, and a resumed run ends where the uninterrupted one does."""

from __future__ import annotations

import json

from conftest import rl_overrides
from hybridflow.config import HybridFlowConfig, load_config
from hybridflow.trainer.rl import RLTrainer
from test_e2e_reliability import _assert_same, _checkpoint

RANK, ALPHA = 4, 8
PROJ_IO = {"q_proj": ("h", "q"), "k_proj": ("h", "kv"), "v_proj": ("h", "kv"), "o_proj": ("q", "h"),
           "gate_proj": ("h", "i"), "up_proj": ("h", "i"), "down_proj": ("i", "h")}


def _adapter_bytes(model_dir) -> int:
    """fp32 bytes of every rank-RANK adapter (A [r, in] + B [out, r]) on the 7 projections of each layer,
    from the model's config.json (independent of peft and of the resharding planner)."""
    c = json.loads((model_dir / "config.json").read_text())
    head = c["hidden_size"] // c["num_attention_heads"]
    dims = {"h": c["hidden_size"], "q": c["num_attention_heads"] * head, "kv": c["num_key_value_heads"] * head, "i": c["intermediate_size"]}
    per_layer = sum(RANK * (dims[i] + dims[o]) for i, o in PROJ_IO.values())
    return 4 * per_layer * c["num_hidden_layers"]


def _planner_bytes(model_dir) -> int:
    """`hybridflow plan --lora-rank`'s steady switch bytes per rank for this run's layout (fp32, dp 2, gen TP 1)."""
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import Cluster, MemoryInputs, rows

    row = rows(load_arch(str(model_dir)), ParallelDims(dp=2), 1, Cluster(1, 2, 1e9, 1e9, 1e-5, 1e10, 2**34), MemoryInputs(lora_rank=RANK), "fp32")[0]
    assert row["mode"] == "optimized"
    return row["bytes_per_rank"]


def _run(model_dir, task_dir, out, reward, *extra):
    cfg = load_config(None, rl_overrides(model_dir, task_dir, out, f"custom_reward_function.path={reward}", f"actor_rollout_ref.model.lora_rank={RANK}",
                                         f"actor_rollout_ref.model.lora_alpha={ALPHA}", "actor_rollout_ref.actor.use_kl_loss=true",
                                         "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.check_weight_sync=true", "trainer.total_training_steps=2",
                                         "trainer.save_freq=1",
                                         # the backend frees its buffers between steps, keeping the frozen base (static pieces sent once)
                                         "actor_rollout_ref.hybrid_engine.keep_generation_buffers=false", *extra), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        result = trainer.fit()
        return set(trainer.placed.views()), [h for h in result["history"] if h["step"] > 0], trainer.plan_summary
    finally:
        trainer.shutdown()


def test_lora_grpo_reference_for_free_adapter_only_sync_and_resume(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path):
    views, hist, plan = _run(tiny_model_dir, task_dir, tmp_path / "straight", varied_reward, "trainer.save_hf_model=true")
    assert "ref" not in views  # no reference role, no reference weights
    first, second = hist
    # step 1 updates from B = 0, where the policy is the base: the adapter-free reference equals it exactly
    assert first["actor/kl_loss"] == 0.0 and first["actor/ppo_kl"] == 0.0
    assert second["actor/kl_loss"] > 0.0  # the adapters moved the policy away from the reference
    # every base weight is frozen and moved once; later switches move the adapters: each rank holds half
    # of every adapter (FSDP over 2 ranks) and receives the other half
    assert all(".lora_" not in n for n in plan["frozen_params"]) and len(plan["frozen_params"]) > 0
    adapter_half = _adapter_bytes(tiny_model_dir) // 2
    assert max(plan["min_bytes_per_rank"]) == adapter_half < max(plan["first_switch_bytes_per_rank"])
    for h in hist:
        assert h["reshard/weight_max_diff"] == 0.0  # the generation weights equal the trained ones
    assert second["reshard/bytes_per_rank"] == adapter_half == _planner_bytes(tiny_model_dir)

    # the checkpoint holds the adapters and their optimizer state, not the base
    straight = _checkpoint(tmp_path / "straight" / "global_step_2")
    model_keys = [k for k in straight["actor"]["model"]]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    # resumed from step 1, step 2 ends with the same adapters and optimizer state, bit for bit
    _run(tiny_model_dir, task_dir, tmp_path / "resumed", varied_reward, "trainer.resume_mode=resume_path",
         f"trainer.resume_from_path={tmp_path / 'straight' / 'global_step_1'}")
    _assert_same(straight["actor"], _checkpoint(tmp_path / "resumed" / "global_step_2")["actor"], "lora resume")
    _check_exports(tiny_model_dir, tmp_path / "straight" / "global_step_2", straight["actor"]["model"], tmp_path)


def _check_exports(model_dir, step_dir, adapters: dict, tmp_path) -> None:
    """`hybridflow export`: the PEFT adapter holds the checkpoint's adapters exactly; `--merge` is a plain
    HF model that greedy-generates what the base with the adapter (unmerged, as the rollout runs it) does."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hybridflow.cli import main as cli_main

    assert cli_main(["export", str(step_dir), str(tmp_path / "adapter")]) == 0
    assert cli_main(["export", str(step_dir), str(tmp_path / "merged"), "--merge"]) == 0
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert {k: v for k, v in saved.items()}.keys() == {f"base_model.model.{k.replace('.default.', '.')}" for k in adapters}
    for k, v in adapters.items():
        assert torch.equal(saved[f"base_model.model.{k.replace('.default.', '.')}"], v)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any(".lora_" in k or "base_layer" in k for k in merged.state_dict())
    # trainer.save_hf_model wrote the same merged model at the end of the run
    saved_hf = AutoModelForCausalLM.from_pretrained(step_dir.parent / "hf_model").state_dict()
    assert saved_hf.keys() == merged.state_dict().keys()
    for k, v in merged.state_dict().items():
        torch.testing.assert_close(saved_hf[k], v, rtol=1e-6, atol=1e-6)  # both W + s B A in fp32; the sum order may differ
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "adapter").eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = torch.randint(3, 200, (4, 10), generator=torch.Generator().manual_seed(0))
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    tokens = merged.generate(prompts, **greedy)
    assert torch.equal(tokens, with_adapter.generate(input_ids=prompts, **greedy))
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight)


def test_lora_under_tensor_parallelism_on_4_workers(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path):
    """LoRA where the layers allow TP: the actor TP 2 x FSDP 2 (base sharded as the plain layer, B with a
    colwise layer, A with a rowwise one), generation TP 2, and a PPO critic with adapters on TP 2 x FSDP 2.
    The switch is bit-exact, later switches move the adapters alone, and the TP rollout's log-probs
    equal the 3D trainer's."""
    cfg = load_config(None, rl_overrides(tiny_model_dir, task_dir, tmp_path, f"custom_reward_function.path={varied_reward}", "trainer.n_gpus_per_node=4",
                                         f"actor_rollout_ref.model.lora_rank={RANK}", f"actor_rollout_ref.model.lora_alpha={ALPHA}",
                                         "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.optim.lr=1e-2",
                                         "actor_rollout_ref.actor.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                                         "algorithm.adv_estimator=gae", "critic.tensor_model_parallel_size=2", f"critic.model.lora_rank={RANK}",
                                         "trainer.check_weight_sync=true", "trainer.total_training_steps=2"), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        hist = [h for h in trainer.fit()["history"] if h["step"] > 0]
        assert trainer.actor.rollout_weight_max_diff() == [0.0] * 4
        plan = trainer.plan_summary
    finally:
        trainer.shutdown()
    first, second = hist
    for h in hist:
        assert h["reshard/weight_max_diff"] == 0.0
        assert h["rollout/logprob_diff_max"] < 1e-4  # TP rollout with adapters vs the 3D-parallel trainer, fp32
        assert h["critic/grad_norm"] > 0
    assert first["actor/kl_loss"] == 0.0 and second["actor/kl_loss"] > 0.0
    assert second["reshard/bytes_per_rank"] == max(plan["min_bytes_per_rank"]) < max(plan["first_switch_bytes_per_rank"])
