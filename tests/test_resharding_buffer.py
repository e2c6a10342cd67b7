"""`actor_rollout_ref.hybrid_engine.resharding_buffer_percent`: the layer-wise switch's staging budget.

p x the bytes of a rank's generation weights decides W, the layers in flight at once (each in a
slot of the largest layer's staging need; `hybrid_engine/staging.py`). The expectations here are
worked out from the model's parameter sizes alone, not from the planner: at N = 2 and gen_tp = 1
every rank's generation weights are the whole model, and a decoder layer (every tensor splitting
evenly in two) stages its own half packed to send plus the gathered whole: 1.5 x its bytes. The
vocabulary tables (259 rows: uneven, the general exchange) stage 1.0 x theirs, less than a decoder
layer, so a slot is 1.5 decoder layers. A decoder layer stages more than 1 MiB here, so each is a
switch unit of its own (`staging.switch_units` merges only smaller ones): the units are embed_tokens,
the 8 layers, and the final norm with lm_head.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from conftest import free_port

F32 = 4
LAYERS = 8  # decoder layers of the test model; the plan adds embed_tokens, norm and lm_head
UNITS = LAYERS + 2  # embed_tokens, the decoder layers, norm + lm_head (merged: together under one layer's staging)
MODEL = dict(hidden_size=128, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, intermediate_size=320)
PERCENTS = (None, 0.1, 0.3, 1.0)


def _by_hand(named_shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """(model bytes, one slot's bytes) from the parameter shapes: fp32, N = 2, gen_tp = 1."""
    import math

    model = sum(math.prod(s) * F32 for s in named_shapes.values())
    layer = sum(math.prod(s) * F32 for n, s in named_shapes.items() if ".layers.0." in n)
    vocab = max(math.prod(s) * F32 for n, s in named_shapes.items() if "embed_tokens" in n or "lm_head" in n)
    assert vocab < 1.5 * layer  # the decoder layer sets the slot
    return model, 3 * layer // 2


def _expected_slots(percent: float | None, model: int, slot: int) -> tuple[int, bool]:
    """(W, honoured): unset 2; else the slots p x model holds, at least 1 (not honoured), at most
    every unit of the plan."""
    if percent is None:
        return 2, True
    fits = int(percent * model) // slot
    return max(1, min(fits, UNITS)), fits >= 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hybridflow.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("buffer") / "m", **MODEL)


def _shapes(path) -> dict[str, tuple[int, ...]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return {n: tuple(p.shape) for n, p in m.named_parameters()}


# ---------------------------------------------------------------- the rule and `hybridflow plan` (no processes)
def test_staging_plan_from_config_json_matches_the_budget_by_hand(model_dir):
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.hybrid_engine.staging import staging_plan
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import Cluster, MemoryInputs, plan_for, rows

    model, slot = _by_hand(_shapes(model_dir))
    assert (model, slot) == (6_315_520, 1_134_336)  # 8 x 756,224 + 2 x 132,608 + 512 bytes; 1.5 x 756,224
    plan = plan_for(load_arch(str(model_dir)), ParallelDims(dp=2), 1, F32)  # config.json alone
    seen = {}
    for percent in PERCENTS:
        s = staging_plan(plan, percent)
        slots, honoured = _expected_slots(percent, model, slot)
        assert (s.slots, s.honoured, s.slot_bytes) == (slots, honoured, [slot, slot]), percent
        assert [s.staging_bytes(r) for r in (0, 1)] == [slots * slot] * 2
        if percent is not None and honoured:
            assert s.staging_bytes(0) <= percent * model  # within the budget
        seen[percent] = s
    # 0.1 x 6.3 MB = 632 KB < one slot (1.13 MB): one layer at a time, and the note says so
    assert seen[0.1].note == ("actor_rollout_ref.hybrid_engine.resharding_buffer_percent=0.1 allows 0.60 MiB of staging per rank "
                              "(0.1 x 6.02 MiB of generation weights), less than one layer's staging (1.08 MiB): staging 1 layer at a "
                              "time (1.08 MiB per rank) instead")
    assert seen[1.0].note.startswith("actor_rollout_ref.hybrid_engine.resharding_buffer_percent=1.0: 5 layer(s) in flight, 5.41 MiB")
    assert seen[None].note == ""  # unset: the default, nothing to say
    # not used at all: said, never silent
    full = staging_plan(plan, 0.3, granularity="full")
    assert not full.honoured and "is not used: granularity=full" in full.note
    naive = staging_plan(plan, 0.3, optimized=False)
    assert not naive.honoured and "is not used: enable_resharding_opt=false" in naive.note
    # `hybridflow plan` rows carry it: layers in flight and staging bytes per rank
    arch = load_arch(str(model_dir))
    for percent in PERCENTS:
        row = rows(arch, ParallelDims(dp=2), 1, Cluster(gpus_per_node=2), MemoryInputs(buffer_percent=percent), "fp32")[0]
        assert (row["layers_in_flight"], row["staging_bytes_per_rank"]) == (seen[percent].slots, seen[percent].staging_bytes(0)), percent


def test_plan_cli_prints_the_staging(model_dir, capsys):
    from hybridflow.planning.cli import main_plan

    main_plan(["--model", str(model_dir), "--gpus-per-node", "2", "--gen-tp", "1", "--dtype", "fp32", "--resharding-buffer-percent", "0.1"])
    out = capsys.readouterr().out
    assert "staging (layer granularity, optimized): 1 layer(s) in flight, 1.08 MiB per rank" in out
    assert "allows 0.60 MiB of staging per rank" in out  # what was used instead, on the plan's own line


# ---------------------------------------------------------------- the engine (2 gloo processes)
def _engine_worker(rank: int, world: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hybridflow.config.schema import HybridEngineConfig
    from hybridflow.hybrid_engine.executor import HybridEngine
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.hybrid_engine.staging import staging_plan
    from hybridflow.parallel.fsdp import apply_fsdp2, make_mesh
    from hybridflow.parallel.tensor_parallel import apply_tensor_parallel, fsdp_shard_placement_fn, gen_mesh, gen_shard_dims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import plan_for

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model, slot = _by_hand({n: tuple(p.shape) for n, p in actor.named_parameters()})
    dims = gen_shard_dims(actor)
    apply_fsdp2(actor, make_mesh("cpu", world), shard_placement_fn=fsdp_shard_placement_fn(actor, world))
    opt = torch.optim.SGD(actor.parameters(), lr=0.1)
    ids = torch.randint(3, 200, (2, 7))
    # gen_tp 2: only the replicated norms and the uneven vocabulary tables move, so the whole switch
    # is one unit, a slot is tiny and 0.1 holds it (W capped at 1)
    for tp, percent in [(1, p) for p in PERCENTS] + [(2, 0.1)]:
        planned = plan_for(load_arch(path), ParallelDims(dp=world), tp, F32)
        where = f"gen_tp={tp} resharding_buffer_percent={percent} rank {rank}"
        rollout = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
        if tp > 1:
            apply_tensor_parallel(rollout, gen_mesh("cpu", world, tp)["tp"])
        engine = HybridEngine(actor, rollout, dims, tp, HybridEngineConfig(resharding_buffer_percent=percent), "cpu")
        predicted = staging_plan(planned, percent)  # `hybridflow plan`'s, from config.json alone
        assert (engine.slots, engine.staging_bytes) == (predicted.slots, predicted.staging_bytes(rank)), where
        if tp == 1:  # by hand: W slots of 1.5 decoder layers
            slots, _ = _expected_slots(percent, model, slot)
            assert (engine.slots, engine.staging_bytes) == (slots, slots * slot), where
        layers = len(engine.units)
        assert layers == (UNITS if tp == 1 else 1), where
        if tp == 2:  # the budget holds more than every unit: W = all of them, no more slots allocated
            assert engine.slots == layers and engine.staging_plan.honoured, where
        for streamed in (False, True):
            actor(input_ids=ids, labels=ids).loss.backward()  # new trained weights for every switch
            opt.step()
            opt.zero_grad()
            engine.release()
            if streamed:  # completed layer by layer by the forward's pre-hooks
                stream = engine.stream()
                handles = stream.hooks(rollout)
                with torch.no_grad():
                    rollout(input_ids=ids)
                for h in handles:
                    h.remove()
                stats = stream.finish()
            else:
                stats = engine.reshard()
            assert engine.max_abs_diff() == 0.0, where  # bit-exact at every setting
            assert stats["bytes_received"] == engine.plan.min_bytes(rank), where
            assert stats["layers_in_flight"] == min(engine.slots, layers), (where, streamed, stats["layers_in_flight"])
            assert stats["staging_bytes"] == engine.staging_bytes, where
        engine.release()
        del engine, rollout
    dist.destroy_process_group()


def test_engine_stages_the_budgeted_layers_bit_exact(model_dir):
    """At N = 2, gen_tp 1 with unset / 0.1 / 0.3 / 1.0 (and gen_tp 2 with 0.1): the engine's slots and
    staging bytes are the budget worked out by hand (gen_tp 1) and `hybridflow plan`'s (both), and the
    switch -- plain and streamed behind a forward -- keeps exactly that many layers in flight and is
    bit-exact."""
    import torch.multiprocessing as mp

    mp.spawn(_engine_worker, args=(2, free_port(), str(model_dir)), nprocs=2)


def test_weight_sync_logs_the_staging_note(caplog):
    """The driver logs the note once, with the plan: INFO when honoured, WARNING with what was used
    instead when not."""
    from hybridflow.config.schema import HybridFlowConfig, TrainerConfig
    from hybridflow.run_plan import resolve
    from hybridflow.trainer.weight_sync import WeightSync

    class Actor:
        world_size = 2

    plan = {"min_bytes_per_rank": [0, 0], "naive_bytes_per_rank": [0, 0], "cross_node_bytes": 0}
    for honoured, level in ((True, logging.INFO), (False, logging.WARNING)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hybridflow"):
            WeightSync(resolve(HybridFlowConfig()).actor, TrainerConfig(), Actor(), dict(plan, staging={"note": "the note", "honoured": honoured}))._log_plan()
        assert [(r.levelno, r.getMessage()) for r in caplog.records if r.getMessage() == "the note"] == [(level, "the note")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hybridflow"):
        WeightSync(resolve(HybridFlowConfig()).actor, TrainerConfig(), Actor(), dict(plan, staging={"note": "", "honoured": True}))._log_plan()
    assert len(caplog.records) == 2  # unset: only the two plan lines
