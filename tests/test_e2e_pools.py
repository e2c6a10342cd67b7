"""Roles on their own resource pools: split pools that overlap, placement by a Ray resource label,
a clear error for a label the cluster lacks, and async (one-step off-policy) rollout."""

from __future__ import annotations

import time

import pytest
import ray

from hybridflow.config import ConfigError
from hybridflow.demo import VAL_KEY, demo_rl_config
from hybridflow.trainer.rl import RLTrainer

pytestmark = pytest.mark.slow

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
    last = result["history"][-1]
    assert 0 < last["perf/pool_busy/critic_pool"] < last["perf/pool_busy/actor_pool"] <= 1


def test_unsatisfiable_label_is_a_clear_error_before_any_worker(demo_sft_model, tmp_path):
    files, sft_model = demo_sft_model
    cfg = demo_rl_config(files, sft_model, str(tmp_path), 1, "resource_pool.pools.gpu_pool.workers_per_node=2",
                         "resource_pool.pools.gpu_pool.resources.H100=1", "resource_pool.mapping.actor_rollout=gpu_pool")
    trainer = RLTrainer(cfg)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        trainer.init_workers()
    assert time.perf_counter() - start < 10
    msg = str(e.value)
    assert "resource_pool.pools.gpu_pool" in msg and "H100" in msg
    assert trainer.groups == {} and not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


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
