"""Roles on their own resource pools: split pools that overlap, placement by a Ray resource label,
a clear error for a label the cluster lacks, and async (one-step off-policy) rollout."""

from __future__ import annotations


import pytest
import ray

from hybridflow.config import ConfigError
from hybridflow.demo import VAL_KEY, demo_rl_config
from hybridflow.trainer.rl import RLTrainer


SPLIT = [
    "resource_pool.pools.actor_pool.workers_per_node=2",
    "resource_pool.pools.critic_pool.workers_per_node=1",
    "resource_pool.pools.critic_pool.resources.fake_h100=1",  # placed by a custom label
    "resource_pool.mapping.actor_rollout=actor_pool",
    "resource_pool.mapping.critic=critic_pool",
]


def overlap(a, b) -> float:
    return max(0.0, min(a.end, b.end) - max(a.start, b.start))


def test_ppo_actor_and_critic_on_separate_pools_learns_and_overlaps(demo_sft_model, tmp_path):
    files, sft_model = demo_sft_model
    cfg = demo_rl_config(files, sft_model, str(tmp_path), 40, *SPLIT, "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3",
                         "critic.ppo_micro_batch_size_per_gpu=32", "trainer.progress_bar=false", "trainer.logger=[jsonl]")
    trainer = RLTrainer(cfg)
    try:
        trainer.init_workers()
        # 3 processes: 2 actor ranks and 1 critic rank, in two process groups
        assert trainer.actor.world_size == 2 and trainer.critic.world_size == 1
        assert not set(trainer.groups["actor_pool"].pids()) & set(trainer.groups["critic_pool"].pids())
        assert ray.available_resources().get("fake_h100", 0) == 3  # the critic pool holds one label
        result = trainer.fit()
        timeline = trainer.flow.timeline
    finally:
        trainer.shutdown()
    val = [h[VAL_KEY] for h in result["history"] if VAL_KEY in h]
    assert val[0] < 0.3 and val[-1] >= 0.9, val
    t = {r.name: r for r in timeline}
    assert t["values"].pool == "critic_pool" and t["old_log_prob"].pool == "actor_pool"
    # critic stages ran alongside actor stages (the last step's recorded start/end times)
    assert overlap(t["values"], t["old_log_prob"]) > 0
    assert overlap(t["update_critic"], t["update_actor"]) > 0
    # busy fractions are measured and in range (which pool is busier depends on the machine's load:
    # a ratio of two wall-clock durations is not a correctness claim)
    last = result["history"][-1]
    assert 0 < last["perf/pool_busy/critic_pool"] <= 1 and 0 < last["perf/pool_busy/actor_pool"] <= 1


def test_unsatisfiable_label_is_a_clear_error_before_any_worker(demo_sft_model, tmp_path):
    files, sft_model = demo_sft_model
    cfg = demo_rl_config(files, sft_model, str(tmp_path), 1, "resource_pool.pools.gpu_pool.workers_per_node=2",
                         "resource_pool.pools.gpu_pool.resources.H100=1", "resource_pool.mapping.actor_rollout=gpu_pool")
    trainer = RLTrainer(cfg)
    with pytest.raises(ConfigError) as e:
        trainer.init_workers()
    msg = str(e.value)
    assert "resource_pool.pools.gpu_pool" in msg and "H100" in msg
    assert trainer.groups == {}
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())  # none left waiting


def test_async_rollout_learns_with_staleness_one_and_bit_exact_sync(demo_sft_model, tmp_path):
    files, sft_model = demo_sft_model
    cfg = demo_rl_config(files, sft_model, str(tmp_path), 40, "trainer.async_rollout=true", "trainer.check_weight_sync=true",
                         "resource_pool.pools.actor_pool.workers_per_node=2", "resource_pool.pools.rollout_pool.workers_per_node=1",
                         "resource_pool.mapping.actor_rollout=actor_pool", "resource_pool.mapping.rollout=rollout_pool",
                         "trainer.progress_bar=false", "trainer.logger=[jsonl]")
    trainer = RLTrainer(cfg)
    try:
        result = trainer.fit()
        # After the last sync the rollout pool holds the trained weights, bit for bit.
        trained = trainer.actor.weight_fingerprints(1, 1)
        assert trainer.rollout.weight_fingerprints() == [trained]
        assert trainer.rollout.weight_version() == 40
    finally:
        trainer.shutdown()
    steps = [h for h in result["history"] if h["step"] > 0]
    assert [h["rollout/staleness"] for h in steps] == [0.0] + [1.0] * 39
    # every sync was checked against the trained weights (the trainer raises on any difference)
    assert all(h["reshard/weight_max_diff"] == 0.0 for h in steps)
    assert all(h["reshard/bytes_per_rank"] > 0 for h in steps)
    # rollout correction is on by default with async rollout (token-level IS, rollout -> the trainer's
    # old policy): no correction at staleness 0, weights away from 1 once the rollout lags a version
    assert steps[0]["rollout_corr/is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert max(h["rollout_corr/is_weight_max"] for h in steps[1:]) > 1.001
    val = [h[VAL_KEY] for h in result["history"] if VAL_KEY in h]
    assert val[0] < 0.3 and val[-1] >= 0.9, val


def test_ppo_dataflow_example_trains(demo_sft_model, tmp_path):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "examples" / "ppo_dataflow.py"
    spec = importlib.util.spec_from_file_location("ppo_dataflow", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    files, sft_model = demo_sft_model
    out = example.train(sft_model, str(pathlib.Path(files["train"]).parent), 20, str(tmp_path))
    before, after = out["before"][VAL_KEY], out["after"][VAL_KEY]
    assert after >= before + 0.3, (before, after)
    t = {r.name: r for r in out["timeline"]}
    assert overlap(t["update_critic"], t["update_actor"]) > 0


def _hf_weights(flow, model_dir, out_dir):
    from safetensors.torch import load_file

    group = flow.models[str(model_dir)]
    group.actor.save_hf_model(str(out_dir))
    return load_file(str(out_dir / "model.safetensors"))


def _adam_state(group, out_dir) -> dict:
    """The actor's AdamW state {fqn: {"step", "exp_avg", "exp_avg_sq"}}, gathered from its DCP
    checkpoint into one process (no process group needed)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    group.actor.save_checkpoint(str(out_dir))
    dcp_to_torch_save(str(out_dir / "actor"), str(out_dir / "full.pt"))
    return torch.load(str(out_dir / "full.pt"), weights_only=False)["optim"]["state"]


def test_model_module_stages_learn_and_grad_accumulation_matches_one_big_step(demo_sft_model, tmp_path):
    """A model path as add_stage module: the flow places it on its own 2 workers; generation after
    an update uses the synced weights; grad_accum_steps=2 over two chunks == one step on both."""
    from transformers import AutoTokenizer

    from hybridflow.algorithms import get_adv_estimator
    from hybridflow.protocol import Batch
    from hybridflow.rewards.manager import RewardManager
    from hybridflow.trainer.dataflow import DataFlow
    from hybridflow.trainer.rl import GEN_OUTPUTS, PROMPT_KEYS, REWARD_KEYS, TRAIN_KEYS

    files, sft_model = demo_sft_model
    cfg = demo_rl_config(files, sft_model, str(tmp_path), 1, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16")
    scorer = RewardManager(AutoTokenizer.from_pretrained(sft_model))

    def grpo(b):
        adv, _ = get_adv_estimator("grpo")(b["token_level_scores"], b["response_mask"], index=b["uid"])
        return Batch.from_dict(tensors={"advantages": adv})

    from hybridflow.trainer.rl import RLTrainer

    loader = RLTrainer(cfg)  # only its data loader and batch preparation (no workers)
    update_keys = TRAIN_KEYS + ["old_log_probs", "advantages"]
    with DataFlow(config=cfg) as flow:
        flow.add_stage("rollout", sft_model, PROMPT_KEYS, GEN_OUTPUTS, num_workers=2)
        flow.add_stage("reward", lambda b: Batch.from_dict(tensors={"token_level_scores": scorer(b)[0]}), REWARD_KEYS, ["token_level_scores"])
        flow.add_stage("old_log_prob", sft_model, TRAIN_KEYS, ["old_log_probs"])
        flow.add_stage("adv", grpo, ["token_level_scores", "response_mask", "uid"], ["advantages"])
        flow.add_stage("update", sft_model, update_keys, [])
        assert len(flow.models) == 1  # every stage naming the model shares one worker group
        scores = []
        for _ in range(15):
            out = flow.run(loader._prepare_batch())
            scores.append(float(out["token_level_scores"].sum(-1).mean()))
            assert abs(out["actor/ppo_kl"]) < 1e-6  # old log-probs from the synced policy, every step
        assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.2, scores

        # Gradient accumulation: the same 64 rows as 2 chunks of 32 with grad_accum_steps=2, vs one
        # call, vs 2 chunks each stepping: accumulation equals the one big step.
        batch = out.select(update_keys)
        group = flow.models[sft_model]
        state = tmp_path / "ckpt"
        start = _adam_state(group, state)
        start_w = _hf_weights(flow, sft_model, tmp_path / "w0")
        adam, weights, norms = {}, {}, {}
        for name, kwargs in [("one", {}), ("accum", {"batch_size": 32, "grad_accum_steps": 2}), ("two_steps", {"batch_size": 32})]:
            group.actor.load_checkpoint(str(state))
            step = DataFlow([])
            step.add_stage("update", group.stage_fn("update_actor"), update_keys, [], **kwargs)
            norms[name] = step.run(batch.select(update_keys)).metrics["actor/grad_norm"]
            adam[name] = _adam_state(group, tmp_path / f"adam_{name}")
            weights[name] = _hf_weights(flow, sft_model, tmp_path / name)
    # The contract is on the GRADIENT the optimizer steps on, so compare it before Adam's
    # normalisation m / (sqrt(v) + eps) turns summation-order noise in near-zero coordinates into
    # differences of the order of the learning rate (CPU-kernel dependent). One AdamW step from the
    # same state: step += 1 and exp_avg = b1 * m0 + (1 - b1) * g, so g = (exp_avg - b1 * m0) / (1 - b1).
    b1 = cfg.actor_rollout_ref.actor.optim.betas[0]
    assert start, "no optimizer state in the checkpoint"
    for fqn, s0 in start.items():
        grads = {}
        for name in ("one", "accum"):
            s = adam[name][fqn]
            assert float(s["step"]) == float(s0["step"]) + 1, (name, fqn)  # one optimizer step, not one per chunk
            grads[name] = (s["exp_avg"] - b1 * s0["exp_avg"]) / (1 - b1)
        # fp32: the two runs sum the same per-token terms in another order (two chunks of 32 sequences
        # vs one of 64; each micro-batch's loss weight computed separately), an error of a few ulps of
        # the largest partial sums (2^-24 ~ 6e-8 relative each) -- plus the ulp of exp_avg (b1 * m0 is
        # up to 10x g, / (1 - b1) = 10x): bound it by 1e-5 of the parameter's largest |m0| or |g|.
        scale = max(float(grads["one"].abs().max()), float(s0["exp_avg"].abs().max()))
        diff = float((grads["accum"] - grads["one"]).abs().max())
        assert diff <= 1e-5 * scale, (fqn, diff, scale)
    name = "model.layers.0.mlp.up_proj.weight"
    moved = (weights["one"][name] - start_w[name]).abs().max()
    assert moved > 1e-5
    assert (weights["two_steps"][name] - weights["one"][name]).abs().max() > 1e-3 * moved  # stepping per chunk differs
    # the accumulated gradient is the mean over both chunks (loss_scale), not their sum
    assert norms["accum"] == pytest.approx(norms["one"], rel=1e-5)


def test_reference_policy_on_its_own_pool(tiny_model_dir, task_dir, varied_reward, tmp_path):
    from conftest import rl_overrides
    from hybridflow.config import HybridFlowConfig, load_config

    cfg = load_config(None, rl_overrides(tiny_model_dir, task_dir, tmp_path, f"custom_reward_function.path={varied_reward}",
                                         "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=k3",
                                         "resource_pool.pools.actor_pool.workers_per_node=2", "resource_pool.pools.ref_pool.workers_per_node=1",
                                         "resource_pool.mapping.actor_rollout=actor_pool", "resource_pool.mapping.ref=ref_pool"), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        result = trainer.fit()
        assert trainer.ref.world_size == 1 and trainer.ref is not trainer.actor
    finally:
        trainer.shutdown()
    steps = [h for h in result["history"] if h["step"] > 0]
    # the 1-worker reference is the initial policy: KL exactly 0 before the first update, then not
    assert abs(steps[0]["actor/kl_loss"]) < 1e-7 and steps[-1]["actor/kl_loss"] > 0
    assert steps[-1]["perf/pool_busy/ref_pool"] > 0



def _sft_config(model_dir, task_dir, out_dir, *extra: str):
    from hybridflow.config import SFTConfig, load_config

    return load_config(None, [f"train_files=[{task_dir}/sft.parquet]", "max_length=32", "train_batch_size=16", "micro_batch_size_per_gpu=8",
                              "total_steps=4", f"model.path={model_dir}", "optim.lr=1e-3", f"save_dir={out_dir}/sft_model",
                              "trainer.logger=[jsonl]", *extra], schema=SFTConfig)


def _rm_config(model_dir, task_dir, out_dir, *extra: str):
    from hybridflow.config import RewardTrainConfig, load_config

    return load_config(None, [f"train_files=[{task_dir}/pref_train.parquet]", f"val_files=[{task_dir}/pref_val.parquet]",
                              "max_prompt_length=32", "max_response_length=4", "train_batch_size=8", "micro_batch_size_per_gpu=8",
                              "total_steps=2", f"model.path={model_dir}", f"save_dir={out_dir}/reward_model", "trainer.logger=[jsonl]",
                              *extra], schema=RewardTrainConfig)


@pytest.mark.usefixtures("ray_cluster")
def test_sft_and_rm_reserve_their_workers_in_a_placement_group(tiny_model_dir, task_dir, tmp_path, monkeypatch):
    """SFT and reward-model training place their workers as the RL trainer does (`trainer/placement.py`):
    one placement group reserving a bundle per worker holds them during every step, and is removed
    when the run ends."""
    import os

    from hybridflow.trainer.loader import PromptLoader
    from hybridflow.trainer.reward_model import run_rm
    from hybridflow.trainer.sft import run_sft

    seen: list[tuple[set, bool]] = []
    take = PromptLoader.next_batch

    def spy(self):  # called by the driver once per step, while the workers are placed
        live = {pg for pg, info in ray.util.placement_group_table().items() if info["state"] == "CREATED"}
        seen.append((live, all(_actor_alive(f"{prefix}_{os.getpid()}_{rank}") for rank in range(2))))
        return take(self)

    monkeypatch.setattr(PromptLoader, "next_batch", spy)
    for prefix, run, cfg in [("sft", run_sft, _sft_config(tiny_model_dir, task_dir, tmp_path)),
                             ("rm", run_rm, _rm_config(tiny_model_dir, task_dir, tmp_path))]:
        before = set(ray.util.placement_group_table())
        seen.clear()
        result = run(cfg)
        assert result["steps"] == cfg.total_steps
        table = ray.util.placement_group_table()
        (pg,) = set(table) - before  # exactly one new placement group
        assert table[pg]["bundles"] == {0: {"CPU": 0.5}, 1: {"CPU": 0.5}} and table[pg]["strategy"] == "STRICT_PACK"
        assert table[pg]["state"] == "REMOVED"  # released at the end
        assert len(seen) == cfg.total_steps and all(pg in live and workers for live, workers in seen), (prefix, seen)


def _actor_alive(name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def test_async_with_staleness_zero_is_the_synchronous_run_bit_for_bit(demo_sft_model, tmp_path):
    """async_training.max_staleness=0 on a rollout pool of its own (each batch generated after the
    previous update's cross-pool sync) trains exactly as the colocated synchronous run: the same
    samples, losses and weights after 3 steps, bit for bit (same seeds, same generation layout)."""
    files, sft_model = demo_sft_model
    quiet = ("trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.test_freq=0", "trainer.val_before_train=false",
             "trainer.save_freq=0")
    pools = ("trainer.async_rollout=true", "async_training.max_staleness=0", "resource_pool.pools.actor_pool.workers_per_node=2",
             "resource_pool.pools.rollout_pool.workers_per_node=2", "resource_pool.mapping.actor_rollout=actor_pool",
             "resource_pool.mapping.rollout=rollout_pool")
    runs = []
    for name, extra in (("sync", ()), ("async", pools)):
        trainer = RLTrainer(demo_rl_config(files, sft_model, str(tmp_path / name), 3, *quiet, *extra))
        try:
            history = [h for h in trainer.fit()["history"] if h["step"] > 0]
            runs.append((history, trainer.actor.weight_fingerprints(1, 1)))
        finally:
            trainer.shutdown()
    (sync, sync_weights), (asyn, async_weights) = runs
    assert [h["rollout/staleness"] for h in asyn] == [0.0, 0.0, 0.0] and "rollout_corr/is_weight_max" not in asyn[0]
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"):
        assert [h[key] for h in asyn] == [h[key] for h in sync], key
    assert async_weights == sync_weights
