"""End-to-end RL on 2 Ray workers with FSDP2: GRPO, PPO (GAE + critic), resume, bad rewards."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import psutil
import torch
import pytest

from conftest import rl_overrides
from hybridflow.config import HybridFlowConfig, load_config
from hybridflow.trainer.rl import RLTrainer



def make_trainer(tiny_model_dir, task_dir, out_dir, *extra) -> RLTrainer:
    return RLTrainer(load_config(None, rl_overrides(tiny_model_dir, task_dir, out_dir, *extra), schema=HybridFlowConfig))


def listening_beyond_loopback() -> list[str]:
    """Listening sockets of this process tree (driver, Ray daemons, workers) not on loopback."""
    ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    bad = []
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr):  # TCP listen / bound UDP
            ip = c.laddr.ip.removeprefix("::ffff:")
            if c.pid in ours and not (ip.startswith("127.") or ip == "::1"):
                bad.append(f"pid {c.pid} {c.laddr.ip}:{c.laddr.port}")
    return bad


def steps(result: dict) -> list[dict]:
    return [h for h in result["history"] if h["step"] > 0]


def test_grpo_fsdp2_sharding_weight_sync_and_invariants(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path):
    trainer = make_trainer(
        tiny_model_dir, task_dir, tmp_path, "algorithm.adv_estimator=grpo", "trainer.check_weight_sync=true",
        f"custom_reward_function.path={varied_reward}", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_type=k3",
    )
    try:
        trainer.init_workers()
        # FSDP2 is real: each of the 2 ranks stores about half of the parameters.
        stats = trainer.actor.shard_stats()
        total = stats[0]["total_numel"]
        assert sum(s["local_numel"] for s in stats) == total
        for s in stats:
            assert abs(s["local_numel"] - total / 2) / total < 0.02
        assert listening_beyond_loopback() == []

        result = trainer.fit()
        assert result["steps"] == 3
        for h in steps(result):
            # First (and only) update of each step: recomputed log-prob == old log-prob.
            assert abs(h["actor/ppo_kl"]) < 1e-6
            assert h["reshard/weight_max_diff"] == 0.0
            # The rollout engine's log-probs of its samples match the trainer's (same weights).
            assert h["rollout/logprob_diff_max"] < 1e-4
            assert math.isfinite(h["actor/pg_loss"]) and h["actor/grad_norm"] > 0
            for key in ("timing_s/gen", "timing_s/update_actor", "timing_s/reshard", "perf/throughput", "actor/entropy", "critic/score/mean",
                        "response_length/mean"):
                assert key in h, key
        # After the last sync the rollout weights equal the trained weights exactly, on every rank.
        assert trainer.actor.rollout_weight_max_diff() == [0.0, 0.0]
        # The frozen reference is the initial policy: KL is exactly 0 before the first update, then not.
        hist = steps(result)
        assert abs(hist[0]["actor/kl_loss"]) < 1e-7 and hist[-1]["actor/kl_loss"] > 0
        val = trainer.validate()
        assert set(val) == {"val-core/digit_max/acc/mean@1"}

        # Stop token ids end a response right after the stop token (every printable char here).
        from hybridflow.trainer.rl import PROMPT_KEYS

        prompts = trainer.collate([trainer.val_ds[i] for i in range(8)])
        params = dataclasses.replace(trainer._sampling(), stop_token_ids=tuple(range(3, 259)))
        trainer.actor.reshard()
        out = trainer.actor.generate_sequences(prompts.select(PROMPT_KEYS), params)
        assert out["response_mask"].sum(-1).tolist() == [1] * 8

        # Request-level generation through the worker group (split over the 2 replicas): each
        # request its own max_new_tokens; greedy completions = the batch API's rows.
        from hybridflow.protocol import Batch, Request
        from hybridflow.rollout.base import batch_requests

        greedy = trainer._sampling(greedy=True)
        rows = trainer.actor.generate_sequences(prompts.select(PROMPT_KEYS), greedy)
        reqs = [Request(r.prompt_ids, r.params.with_(max_new_tokens=1 + i % 4)) for i, r in enumerate(batch_requests(prompts, greedy))]
        got = trainer.actor.generate_requests(Batch.from_dict(non_tensors={"request": reqs}))["completion"]
        assert len(got) == 8
        for i, c in enumerate(got):
            n = int(rows["response_mask"][i].sum())
            assert list(c.token_ids) == rows["responses"][i, : min(n, 1 + i % 4)].tolist(), i
            assert c.finish_reason == ("length" if len(c.token_ids) == 1 + i % 4 and c.token_ids[-1] != trainer.tokenizer.eos_token_id else "stop")
    finally:
        trainer.shutdown()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]


def test_ppo_gae_with_critic_on_llama(ray_cluster, tiny_llama_dir, task_dir, varied_reward, tmp_path):
    trainer = make_trainer(
        tiny_llama_dir, task_dir, tmp_path, f"custom_reward_function.path={varied_reward}",
        "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.05",
        "algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.optim.lr=1e-3",
        "critic.ppo_micro_batch_size_per_gpu=4", "trainer.total_training_steps=4",
    )
    try:
        result = trainer.fit()
    finally:
        trainer.shutdown()
    hist = steps(result)
    assert len(hist) == 4
    for h in hist:
        assert abs(h["actor/ppo_kl"]) < 1e-6
        assert math.isfinite(h["critic/vf_loss"]) and h["critic/grad_norm"] > 0
        assert "critic/values/mean" in h and "timing_s/update_critic" in h
    assert hist[0]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-7)  # ref == policy at step 1
    assert hist[-1]["actor/reward_kl_penalty"] > 0
    # The critic learns: value loss on the step's data falls as it fits the returns.
    assert hist[-1]["critic/vf_loss"] < hist[0]["critic/vf_loss"]


def test_raising_reward_fn_scores_zero_and_run_goes_on(ray_cluster, tiny_model_dir, task_dir, tmp_path):
    reward_file = tmp_path / "flaky_reward.py"
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if int(ground_truth) >= 8:\n"
        "        raise ValueError('flaky scorer')\n"
        "    return float(solution_str.strip() == ground_truth)\n"
    )
    trainer = make_trainer(tiny_model_dir, task_dir, tmp_path, f"custom_reward_function.path={reward_file}", "trainer.total_training_steps=2")
    try:
        hist = steps(trainer.fit())
    finally:
        trainer.shutdown()
    assert len(hist) == 2
    assert sum(h["reward/errors"] for h in hist) > 0  # most digit_max answers are 8 or 9


def test_grpo_tp2_generation_hybrid_engine_overlap_and_trace(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path, caplog, monkeypatch):
    from overlap_record import assert_overlapped, record_overlap

    from hybridflow.profiler import trace_resharding

    trainer = make_trainer(
        tiny_model_dir, task_dir, tmp_path, f"custom_reward_function.path={varied_reward}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.check_weight_sync=true",
        "actor_rollout_ref.hybrid_engine.resharding_overlap_with_compute=true",
        "actor_rollout_ref.hybrid_engine.measure_baseline=true",  # the "vs ... baseline" log line below
    )
    trace_path = tmp_path / "trace.json"
    order = record_overlap(monkeypatch, loader_seconds=0.3)  # a loader slower than Ray's dispatch
    try:
        with caplog.at_level("DEBUG", logger="hybridflow"), trace_resharding(str(trace_path)):
            result = trainer.fit()
        plan = trainer.actor.reshard_plan()
        assert trainer.actor.rollout_weight_max_diff() == [0.0, 0.0]
    finally:
        trainer.shutdown()
    # N=2, gen_tp=2: every sharded weight is already in place; only replicated norms move.
    assert plan["gen_tp"] == 2 and plan["gen_dp"] == 1
    assert max(plan["min_bytes_per_rank"]) < 0.05 * max(plan["naive_bytes_per_rank"])
    for h in steps(result):
        assert h["reshard/weight_max_diff"] == 0.0
        assert h["reshard/bytes_per_rank"] == h["reshard/min_bytes_per_rank"]
        assert h["rollout/logprob_diff_max"] < 1e-4  # TP rollout vs FSDP2 trainer, fp32
        assert abs(h["actor/ppo_kl"]) < 1e-6
    # the overlap by recorded order: the next batch was prepared while the workers resharded
    assert_overlapped(order, len(steps(result)))
    text = caplog.text
    assert "Starting resharding from FSDP(dp=2) to TP=2 x DP=1..." in text
    assert "Layer-wise migration: embed_tokens -> layers.0 -> layers.1" in text
    assert "baseline" in text and "Overlapped" in text
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {"gather layers.0", "copy layers.0"} <= {e["name"] for e in spans}


def test_bf16_mixed_precision_generates_from_bf16_weights_half_the_bytes(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path):
    """fsdp_config.mixed_precision=bf16 (fp32 shards and optimizer, bf16 compute): the rollout holds
    bf16 weights equal to the trained ones rounded to bf16, the switch moves exactly half the fp32
    plan's bytes, and the rollout's log-probs stay close to the bf16 trainer's."""
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import plan_for

    trainer = make_trainer(tiny_model_dir, task_dir, tmp_path, f"custom_reward_function.path={varied_reward}", "trainer.total_training_steps=2",
                           "actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16", "trainer.check_weight_sync=true")
    try:
        result = trainer.fit()
    finally:
        trainer.shutdown()
    fp32_min = max(plan_for(load_arch(str(tiny_model_dir)), ParallelDims(dp=2), 1, 4).min_bytes(r) for r in range(2))
    for h in steps(result):
        assert h["reshard/weight_max_diff"] == 0.0  # against the gathered fp32 weights cast to bf16
        assert 2 * h["reshard/bytes_per_rank"] == 2 * h["reshard/min_bytes_per_rank"] == fp32_min
        # bf16 rollout (KV cache) vs bf16 trainer (one forward): the same weights, other kernels; in
        # fp32 the same comparison is < 1e-4, bf16's 8-bit mantissa puts it near 1e-2 (measured 0.016 max)
        assert 0 < h["rollout/logprob_diff_max"] < 0.1
        assert abs(h["actor/ppo_kl"]) < 1e-6  # the first update's ratio is 1: old log-probs come from the same bf16 pass
        assert math.isfinite(h["actor/pg_loss"])


def test_bf16_async_rollout_pool_receives_bf16_pieces_bit_exact(ray_cluster, tiny_model_dir, task_dir, tmp_path):
    """Async rollout on its own pool under bf16 mixed precision: the actor publishes its pieces cast
    to bf16 (half the fp32 bytes: the rollout rank's whole model at 2 bytes per element), and the
    sync check (every piece in place, fingerprints of the trained weights cast to bf16) passes."""
    from hybridflow.models.hf import load_hf_model

    trainer = make_trainer(tiny_model_dir, task_dir, tmp_path, "trainer.async_rollout=true", "trainer.check_weight_sync=true",
                           "trainer.total_training_steps=2", "actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16",
                           "resource_pool.pools.actor_pool.workers_per_node=2", "resource_pool.pools.rollout_pool.workers_per_node=1",
                           "resource_pool.mapping.actor_rollout=actor_pool", "resource_pool.mapping.rollout=rollout_pool")
    try:
        result = trainer.fit()
        assert trainer.rollout.weight_fingerprints() == [trainer.actor.weight_fingerprints(1, 1)]
    finally:
        trainer.shutdown()
    numel = sum(p.numel() for p in load_hf_model(trainer.cfg.actor_rollout_ref.model, "cpu").parameters())
    for h in steps(result):
        assert h["reshard/weight_max_diff"] == 0.0 and h["reshard/bytes_per_rank"] == 2 * numel


def test_response_lengths():
    from hybridflow.rollout.base import response_lengths

    pad, eos = 0, 2
    responses = torch.tensor([
        [5, 6, eos, pad],  # stops at EOS: 3 tokens
        [5, 7, 7, 8],      # hit the length limit: 4
        [5, 6, pad, pad],  # stopped by a stop string: up to the padding
        [9, 5, 5, 5],      # stop id 9 first: 1
    ])
    assert response_lengths(responses, [eos, 9], pad).tolist() == [3, 4, 2, 1]


@pytest.mark.parametrize("estimator", ["remax", "rloo", "reinforce_plus_plus"])
def test_other_estimators_run_end_to_end(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path, estimator):
    trainer = make_trainer(tiny_model_dir, task_dir, tmp_path, f"algorithm.adv_estimator={estimator}", f"custom_reward_function.path={varied_reward}",
                           "trainer.total_training_steps=2")
    try:
        hist = steps(trainer.fit())
    finally:
        trainer.shutdown()
    assert len(hist) == 2
    for h in hist:
        assert abs(h["actor/ppo_kl"]) < 1e-6 and math.isfinite(h["actor/pg_loss"])
        if estimator == "remax":
            assert "timing_s/reward_baseline" in h


def test_skipping_the_old_log_prob_pass_gives_the_same_update(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path):
    """recompute_old_log_prob=false (one on-policy pass): the update's own detached log-prob is the
    old one -- the same updates as a separate old-log-prob forward, ppo_kl and clip fraction 0."""
    reward = f"custom_reward_function.path={varied_reward}"
    runs = {}
    for recompute in (True, False):
        trainer = make_trainer(tiny_model_dir, task_dir, tmp_path / str(recompute), reward, "trainer.total_training_steps=2",
                               f"actor_rollout_ref.actor.recompute_old_log_prob={str(recompute).lower()}")
        try:
            runs[recompute] = steps(trainer.fit())
        finally:
            trainer.shutdown()
    assert all("timing_s/old_log_prob" in h for h in runs[True]) and not any("timing_s/old_log_prob" in h for h in runs[False])
    assert len(runs[True]) == len(runs[False]) == 2
    assert all(b["actor/ppo_kl"] == 0.0 and b["actor/pg_clipfrac"] == 0.0 for b in runs[False])
    # Across the two runs, compare the first step only: its metrics come before any optimizer step
    # (one mini-batch per step). The separate old-log-prob forward may sum in another order than
    # the update's own forward (a few fp32 ulps in the ratio); after an AdamW step that noise is
    # amplified to ~lr in near-zero-gradient coordinates (CPU-kernel dependent), so later steps
    # would compare kernels, not the contract.
    a, b = runs[True][0], runs[False][0]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


def test_padding_free_and_token_budget_updates_equal_the_plain_ones(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path):
    """actor/ref padding removal + token-budget micro-batches in the update and log-prob passes
    (budget 64 tokens: 2-3 sequences each, where the plain run takes 4), and Ulysses sequence
    parallelism on top (sp2 over the 2 workers: one data rank, each micro-batch's packed sequence
    split between them, parallel/ulysses.py): the same updates."""
    reward = f"custom_reward_function.path={varied_reward}"
    fast = ["actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=64", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=64", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
    runs = {}
    for name, extra in (("plain", []), ("fast", fast)):
        trainer = make_trainer(tiny_model_dir, task_dir, tmp_path / name, reward, "trainer.total_training_steps=1",
                               "actor_rollout_ref.actor.use_kl_loss=true", *extra)
        try:
            runs[name] = steps(trainer.fit())
        finally:
            trainer.shutdown()
    assert len(runs["plain"]) == len(runs["fast"]) == 1
    # One step: its metrics come before any optimizer step (one mini-batch per step): padding removal
    # and token budgets reorder fp32 sums, which an AdamW step would amplify to ~lr in
    # near-zero-gradient coordinates, so later steps would compare CPU kernels, not the contract.
    a, b = runs["plain"][0], runs["fast"][0]
    assert abs(b["actor/ppo_kl"]) < 1e-6  # the first update is on-policy: the recomputed log-prob is the old one
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "critic/score/mean"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_frozen_embeddings_sync_once(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path):
    """actor.freeze_modules: the vocabulary tables get no update, and after the first switch the
    engine skips them (0 bytes): every later step receives the plan's minimum without them, and the
    rollout weights still equal the trained ones exactly (check_weight_sync)."""
    trainer = make_trainer(tiny_model_dir, task_dir, tmp_path, f"custom_reward_function.path={varied_reward}", "trainer.check_weight_sync=true",
                           "actor_rollout_ref.actor.freeze_modules=['*embed_tokens*','*lm_head*']", "trainer.total_training_steps=3")
    try:
        hist = steps(trainer.fit())
        summary = trainer.plan_summary
    finally:
        trainer.shutdown()
    assert summary["frozen_params"] == ["lm_head.weight", "model.embed_tokens.weight"]
    skipped = max(summary["first_switch_bytes_per_rank"]) - max(summary["min_bytes_per_rank"])
    assert skipped > 0
    for h in hist[1:]:
        assert h["reshard/weight_max_diff"] == 0.0
        assert h["reshard/skipped_bytes_per_rank"] == skipped and h["reshard/bytes_per_rank"] == max(summary["min_bytes_per_rank"])


@pytest.mark.parametrize("layout", [
    # training TP 2 x FSDP 2; generation TP 2 in the same groups (each training shard is half a generation slice)
    ["actor_rollout_ref.actor.tensor_model_parallel_size=2"],
    # 2 pipeline stages (1F1B) x FSDP 2, the reference policy pipelined too (use_kl_loss); generation TP 2
    ["actor_rollout_ref.actor.pipeline_model_parallel_size=2", "actor_rollout_ref.actor.use_kl_loss=true"],
    # PPO: the actor TP 2 x FSDP 2 and the critic (value head on the backbone) with its own TP 2 x FSDP 2
    ["actor_rollout_ref.actor.tensor_model_parallel_size=2", "algorithm.adv_estimator=gae", "critic.tensor_model_parallel_size=2"],
], ids=["tp2xdp2", "pp2xdp2", "ppo_critic_tp2"])
def test_grpo_3d_training_on_4_workers(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path, layout):
    trainer = make_trainer(
        tiny_model_dir, task_dir, tmp_path, f"custom_reward_function.path={varied_reward}", "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.check_weight_sync=true", "trainer.total_training_steps=2", *layout,
    )
    try:
        result = trainer.fit()
        assert trainer.actor.rollout_weight_max_diff() == [0.0] * 4
        plan = trainer.actor.reshard_plan()
    finally:
        trainer.shutdown()
    hist = steps(result)
    assert len(hist) == 2
    for h in hist:
        assert h["reshard/weight_max_diff"] == 0.0  # generation weights == trained weights, bit for bit
        assert h["reshard/bytes_per_rank"] == h["reshard/min_bytes_per_rank"] == max(plan["min_bytes_per_rank"])
        assert abs(h["actor/ppo_kl"]) < 1e-6  # first update of the step: the recomputed log-probs are the old ones
        assert h["rollout/logprob_diff_max"] < 1e-4  # TP rollout vs the 3D-parallel trainer, fp32
    assert hist[1]["actor/grad_norm"] > 0 and hist[0]["actor/pg_clipfrac"] == 0.0
    if "algorithm.adv_estimator=gae" in layout:
        assert all(h["critic/grad_norm"] > 0 and math.isfinite(h["critic/vf_loss"]) for h in hist)


def test_sampling_temperature_and_entropy_bonus_reach_the_trainer(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path):
    """Sampling at T = 0.5: the trainer recomputes the rollout's log-probs under the same T (the
    batch carries it), so they agree to fp32 noise; at T = 1 they would differ by far more. An
    entropy bonus changes the first update's gradient, and only it (same samples, same PG loss)."""
    runs = {}
    for name, extra in (("plain", []), ("bonus", ["actor_rollout_ref.actor.entropy_coeff=1.0"])):
        trainer = make_trainer(tiny_model_dir, task_dir, tmp_path / name, f"custom_reward_function.path={varied_reward}", "trainer.total_training_steps=1",
                               "actor_rollout_ref.rollout.temperature=0.5", *extra)
        try:
            runs[name] = steps(trainer.fit())
        finally:
            trainer.shutdown()
    (plain,), (bonus,) = runs["plain"], runs["bonus"]
    for h in (plain, bonus):
        assert h["rollout/logprob_diff_max"] < 1e-4, h["rollout/logprob_diff_max"]
        assert abs(h["actor/ppo_kl"]) < 1e-6
    # the same samples and PG loss (step 1 comes before any update), a different gradient
    assert bonus["critic/score/mean"] == plain["critic/score/mean"] and bonus["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], rel=1e-6)
    assert abs(bonus["actor/grad_norm"] - plain["actor/grad_norm"]) > 1e-4 * plain["actor/grad_norm"]


def test_dynamic_sampling_and_rollout_correction_end_to_end(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path):
    """DAPO's dynamic sampling (groups of 2 samples, half of them flat under the parity reward) and
    token-level IS + rejection on the real workers: every step trains on a full batch of varied
    groups after extra generation rounds; on-policy, the rollout's and the trainer's log-probs agree,
    so every weight is 1 (to fp32 noise) and no token is rejected."""
    trainer = make_trainer(tiny_model_dir, task_dir, tmp_path, f"custom_reward_function.path={varied_reward}", "trainer.total_training_steps=2",
                           "actor_rollout_ref.rollout.n=2", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
                           "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_rs=token")
    try:
        hist = steps(trainer.fit())
    finally:
        trainer.shutdown()
    assert len(hist) == 2 and max(h["data/num_gen_batches"] for h in hist) > 1
    rows_per_round = 4 * 2  # data.train_batch_size prompts x n samples
    for h in hist:
        kept_rows = h["data/kept_groups_frac"] * h["data/num_gen_batches"] * rows_per_round
        assert kept_rows >= rows_per_round - 1e-6  # the batch was filled
        if h["data/num_gen_batches"] > 1:  # another round only because the earlier ones dropped groups
            assert h["data/kept_groups_frac"] < 1.0
        assert h["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and h["rollout_corr/kept_token_frac"] == 1.0
        assert abs(h["actor/ppo_kl"]) < 1e-6
        # every kept group is varied: with 0/1 scores in pairs the batch's mean score is exactly 1/2
        assert h["critic/score/mean"] == pytest.approx(0.5)


def test_dynamic_sampling_that_cannot_fill_the_batch_trains_on_the_groups_kept(ray_cluster, tiny_model_dir, task_dir, tmp_path):
    """One generation round a step (max_num_gen_batches=1) and a reward that makes exactly half of the
    groups vary: every step trains on those 2 of its 4 groups instead of stopping (strict is off by
    default), counts the underfilled batches, and really updates the policy. The micro-batch is left
    unset: derived from the layout at run time."""
    reward = tmp_path / "every_fourth.py"
    # Called once per row, in row order (the driver's reward stage, reward_model.num_workers=0: a stateful function on
    # reward workers would count per worker): rows come as 4 groups of 2 samples
    # a round, so the 1st and 3rd group score (1, 0) and vary, the 2nd and 4th score (0, 0) and are flat.
    reward.write_text("import itertools\n_calls = itertools.count()\n\n\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(next(_calls) % 4 == 0)\n")
    trainer = make_trainer(tiny_model_dir, task_dir, tmp_path, f"custom_reward_function.path={reward}", "trainer.total_training_steps=2",
                           "actor_rollout_ref.rollout.n=2", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=1",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "reward_model.num_workers=0")
    assert trainer.cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4  # 4 prompts x 2 samples / 2 workers
    try:
        hist = steps(trainer.fit())
    finally:
        trainer.shutdown()
    assert [h["data/underfilled_batches"] for h in hist] == [1.0, 2.0]  # a running count
    for h in hist:
        assert h["data/num_gen_batches"] == 1.0 and h["data/train_groups"] == 2.0 and h["data/kept_groups_frac"] == 0.5
        assert h["critic/score/mean"] == pytest.approx(0.5)  # only the varied groups, (1, 0) each, were trained on
        assert h["actor/grad_norm"] > 0 and "actor/pg_loss" in h and "train/skipped_updates" not in h  # the step trained


def test_on_policy_distillation_from_itself_is_a_no_op_and_from_another_model_moves(ray_cluster, tiny_model_dir, tiny_llama_dir, task_dir, tmp_path):
    """The teacher role scores the student's tokens; the advantage is teacher - student log-prob.
    A student distilled from its own checkpoint (same weights, same FSDP layout) gets advantage 0
    on every token: no policy gradient. From another model of the same vocabulary it moves."""
    hist = {}
    for name, teacher in (("self", tiny_model_dir), ("other", tiny_llama_dir)):
        trainer = make_trainer(tiny_model_dir, task_dir, tmp_path / name, "trainer.total_training_steps=1", "algorithm.adv_estimator=on_policy_distill",
                               "teacher.enable=true", f"teacher.model.path={teacher}")
        try:
            hist[name] = steps(trainer.fit())
        finally:
            trainer.shutdown()
    for h in hist["self"]:
        assert h["critic/advantages/max"] == 0.0 and h["critic/advantages/min"] == 0.0 and h["actor/grad_norm"] == 0.0
        assert "timing_s/teacher" in h
    assert all(h["actor/grad_norm"] > 0 and h["critic/advantages/min"] < 0 for h in hist["other"])
