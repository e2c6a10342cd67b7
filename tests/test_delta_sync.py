"""Delta weight sync of the cross-pool sync (hybrid_engine/delta.py): only what changed moves, the
receiver's result is CRC-checked against the trainer's tensor, a bad delta is repaired whole."""

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
