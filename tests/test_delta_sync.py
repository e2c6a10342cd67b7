"""Delta weight sync (hybrid_engine/delta.py) of the cross-pool sync and of the colocated switch's
gathers: only what changed moves, the receiver's result is CRC-checked against the trainer's tensor,
a bad delta is repaired whole."""

from __future__ import annotations


import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.hybrid_engine.cross_pool import PoolReceiver, publish
from hybridflow.hybrid_engine.delta import DeltaSender, apply, encode, payload_bytes
from hybridflow.parallel.tensor_parallel import gen_shard_dims


def test_a_few_changed_elements_travel_as_index_value_pairs_and_rebuild_the_piece():
    last = torch.randn(64, 32).to(torch.bfloat16)
    new = last.clone()
    new[3, 5], new[40, 0] = new[3, 5] * 2, -new[40, 0]
    new[7, 7] = -0.0 if last[7, 7] == 0.0 else last[7, 7]  # unchanged bits stay unsent
    payload, changed = encode(new, last, force_full=False)
    assert payload[0] == "sparse" and changed == 2 and payload_bytes(payload) == 2 * (4 + 2)
    assert torch.equal(apply(payload, last).view(torch.int16), new.view(torch.int16))
    everything = new + 1
    payload, changed = encode(everything, last, force_full=False)
    assert payload[0] == "full" and changed == everything.numel()  # most changed: the whole piece is smaller
    assert encode(new, last, force_full=True)[0][0] == "full" and encode(new, None, force_full=False)[0][0] == "full"


def test_a_corrupted_delta_or_a_missing_base_fails_its_checksum():
    last = torch.randn(128).to(torch.bfloat16)
    new = last.clone()
    new[:4] += 1
    payload, _ = encode(new, last, force_full=False)
    flipped = payload[2].clone()
    flipped.view(torch.int16)[0] ^= 1  # one bit of one value, in transit
    assert apply(("sparse", payload[1], flipped, payload[3]), last) is None
    assert apply(payload, None) is None  # a receiver that missed a sync (a restarted replica)
    assert apply(payload, last) is not None


def test_the_receiver_repairs_a_corrupted_delta_from_the_whole_piece(ray_cluster, tiny_model_dir):
    """Two syncs of a real model through the object store (one training rank, one generation rank,
    bf16): the second after an update that changes few bf16 elements, with one parameter's delta
    corrupted in transit (a test flips bits of its values). The receiver's checksum catches it, the
    whole piece of that parameter is fetched, and every slice it hands the backend equals the
    trainer's tensor cast to bf16 bit for bit."""
    import ray

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    dims = gen_shard_dims(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    sender, receiver = DeltaSender(full_every=10), PoolReceiver(shapes, dims, 1, 0, 1)

    def sync(refs) -> dict[str, torch.Tensor]:
        receiver.stage([refs])
        return {p.name: p.tensor.clone() for p in receiver.pieces()}

    first = sync(publish(model, dims, 0, 1, 1, 1, torch.bfloat16, sender))
    assert receiver.last_stats["delta_repairs"] == 0 and receiver.last_stats["delta_changed"] == receiver.last_stats["delta_elements"]
    with torch.no_grad():  # an "update": a few elements of every matrix move past bf16's rounding
        for p in model.parameters():
            p.view(-1)[:3] += 0.5
    (ref,) = publish(model, dims, 0, 1, 1, 1, torch.bfloat16, sender)
    obj = ray.get(ref)
    victim = "model.layers.0.mlp.down_proj.weight"
    (box, payload), = obj["delta"][victim][1]
    assert payload[0] == "sparse"
    bad = payload[2].clone()
    bad.view(torch.int16)[0] ^= 0x40
    obj = {"delta": {**obj["delta"], victim: (obj["delta"][victim][0], [(box, ("sparse", payload[1], bad, payload[3]))])}, "full": obj["full"]}
    second = sync([ray.put(obj)])
    stats = receiver.last_stats
    assert stats["delta_repairs"] == 1 and stats["delta_repaired"] == [victim]
    for name, p in model.named_parameters():
        assert torch.equal(second[name].view(-1).view(torch.int16), p.detach().to(torch.bfloat16).reshape(-1).view(torch.int16)), name
    assert not torch.equal(second[victim], first[victim])
    assert stats["delta_sent_bytes"] < stats["delta_full_bytes"] / 4  # few elements changed: a fraction of the bytes moved
    assert 0 < stats["delta_changed"] < stats["delta_elements"] / 10


def _colocated_worker(rank: int, world: int, port: int, path: str) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1")
    import torch.distributed as dist

    from hybridflow.config.schema import HybridEngineConfig
    from hybridflow.hybrid_engine import executor
    from hybridflow.hybrid_engine.executor import HybridEngine
    from hybridflow.parallel.fsdp import apply_fsdp2, make_mesh
    from hybridflow.parallel.tensor_parallel import fsdp_shard_placement_fn

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dims = gen_shard_dims(actor)
    apply_fsdp2(actor, make_mesh("cpu", world), shard_placement_fn=fsdp_shard_placement_fn(actor, world))
    rollout = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval().requires_grad_(False)
    engine = HybridEngine(actor, rollout, dims, 1, HybridEngineConfig(delta_sync=True, delta_full_every=4), "cpu", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-6)
    ids = torch.randint(3, 200, (2, 9))
    gather, corrupt = executor._all_gather, [False]

    def flipping(out, inp, **kw):  # in transit, on rank 1: the high byte of rank 0's first changed value
        work = gather(out, inp, **kw)
        if corrupt[0] and rank == 1 and out.dtype == torch.uint8:
            work.wait()
            k = inp.numel() // (4 + 2)  # the payload: k int32 indices, then k bf16 values
            out[4 * k + 1] ^= 0x40
            corrupt[0] = False
        return work

    executor._all_gather = flipping
    stats = []
    for step in range(6):
        engine.release()
        corrupt[0] = step == 2
        stats.append(engine.reshard())
        assert engine.max_abs_diff() == 0.0, step  # bit-exact after every sync, the repaired one included
        actor(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    executor._all_gather = gather
    full = [s["delta_sent_bytes"] == s["delta_full_bytes"] for s in stats]
    assert full == [True, False, False, False, True, False], full  # the first and every 4th whole
    for s in stats:
        if s["delta_sent_bytes"] < s["delta_full_bytes"]:
            assert s["delta_sent_bytes"] < s["delta_full_bytes"] / 3 and 0 < s["delta_changed"] < s["delta_elements"] / 10, s
    assert [s["delta_repairs"] for s in stats] == [0, 0, 1, 0, 0, 0]  # on both ranks: every rank gathers the unit whole
    dist.destroy_process_group()


def test_colocated_switch_sends_deltas_checks_them_and_repairs_a_corrupted_one(tiny_model_dir):
    """The colocated switch with delta_sync (2 gloo ranks, FSDP2 fp32 -> bf16 generation, gen_tp 1):
    six syncs around real AdamW steps at lr 1e-6, each bit-exact against the trained weights; the
    first and the 4th whole (delta_full_every=4), the others a fraction of the bytes; one payload
    corrupted in transit on rank 1 fails its CRC-32, and that unit is gathered whole on every rank."""
    import torch.multiprocessing as mp
    from conftest import free_port

    mp.spawn(_colocated_worker, args=(2, free_port(), str(tiny_model_dir)), nprocs=2)


@pytest.mark.slow
def test_async_grpo_with_delta_sync_keeps_the_rollout_bit_exact(ray_cluster, tiny_model_dir, task_dir, varied_reward, tmp_path):
    """12 async GRPO steps in bf16 at lr 1e-6 (a rollout pool of its own) with delta sync and
    trainer.check_weight_sync: after every sync the rollout pool's weights equal the trainer's bit
    for bit (fingerprints of every generation slice); apart from the first and every 10th sync
    (whole) only the changed elements travel, a fraction of the full sync's bytes; nothing needed a
    repair. (20 steps, fp32 too, and SmolLM2: bench/delta_sync.py.)"""
    from conftest import rl_overrides, train_and_read_metrics

    rows = train_and_read_metrics(rl_overrides(
        tiny_model_dir, task_dir, tmp_path, f"custom_reward_function.path={varied_reward}", "trainer.total_training_steps=12",
        "trainer.async_rollout=true", "resource_pool.pools.actor_pool.workers_per_node=2", "resource_pool.pools.rollout_pool.workers_per_node=1",
        "resource_pool.mapping.actor_rollout=actor_pool", "resource_pool.mapping.rollout=rollout_pool", "trainer.check_weight_sync=true",
        "actor_rollout_ref.hybrid_engine.delta_sync=true", "actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16",
        "actor_rollout_ref.actor.optim.lr=1e-6"), tmp_path)
    syncs = [r for r in rows if "sync/delta_bytes_per_rank" in r]
    assert len(syncs) >= 11 and all(r["reshard/weight_max_diff"] == 0.0 for r in syncs)
    assert all(r["sync/delta_repairs"] == 0 for r in syncs)
    for i, r in enumerate(syncs):
        if i % 10 == 0:  # the first, and every delta_full_every-th (10): every piece whole
            assert r["sync/delta_bytes_per_rank"] == r["sync/full_bytes_per_rank"]
        else:  # bf16 rounds most of an lr-1e-6 update away: a few percent of the elements change
            assert r["sync/delta_bytes_per_rank"] < r["sync/full_bytes_per_rank"] / 4 and r["sync/delta_changed_fraction"] < 0.1
