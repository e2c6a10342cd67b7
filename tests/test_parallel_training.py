"""3D-parallel training (TP x FSDP2, pipeline stages) and the engine's switch from those layouts.

- the math does not change: bench/parallel_equivalence.py's 3 SFT steps + 3 PPO updates under
  dp4, tp2xdp2, pp2xdp2 and pp2xtp2 on 4 processes match the single-process run to 1e-5 (fp32);
- from every 3D training layout into every generation TP size the layout allows, the switch is
  bit-exact and each rank receives exactly the planner's minimum, which `hybridflow plan`
  predicts from config.json alone; the naive path gathers whole tensors.
"""

from __future__ import annotations

import os
import sys

import pytest
from conftest import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_layouts_match_the_single_process_run(tmp_path):
    sys.path.insert(0, ROOT)
    from bench.parallel_equivalence import main

    rows = main(["--json", str(tmp_path / "eq.json"), "--layouts", "dp4,tp2xdp2,pp2xdp2,pp2xdp2-gpipe,pp2xtp2"])
    assert [r["layout"] for r in rows] == ["dp4", "tp2xdp2", "pp2xdp2", "pp2xdp2-gpipe", "pp2xtp2"]  # 1F1B and GPipe schedules
    for r in rows:
        assert r["max_loss_diff"] < 1e-5 and r["max_grad_norm_diff"] < 1e-5 and r["max_logprob_diff"] < 1e-5, r


SWITCHES = {"tp2xdp2": (1, 2, 4), "pp2xdp2": (1, 2, 4), "pp2xtp2": (1, 2, 4)}


def _switch_worker(rank: int, world: int, port: int, path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sys.path.insert(0, ROOT)
    from bench.parallel_equivalence import config, make_data
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import plan_for
    from hybridflow.run_plan import resolve
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker

    for label, gen_tps in SWITCHES.items():
        for gen_tp in gen_tps:
            cfg = config(path, label)
            cfg.actor_rollout_ref.rollout.tensor_model_parallel_size = gen_tp
            w = ActorRolloutRefWorker(resolve(cfg).actor, role="actor_rollout", total_training_steps=2)
            w.init_model()
            dp_i, dp, _ = w.dispatch_layout("train")
            w.sft_step(make_data(len(w.tokenizer))[0].chunk(dp)[dp_i])  # trained weights != the checkpoint the rollout loaded
            planned = plan_for(load_arch(path), ParallelDims.parse(label), gen_tp, 4)
            where = f"{label} gen_tp={gen_tp} rank {rank}"
            stats = w.reshard(measure_baseline=True, check=True)
            assert stats["max_diff"] == 0.0, where
            assert stats["bytes_received"] == w.plan.min_bytes(rank) == planned.min_bytes(rank), where
            assert stats["baseline"]["bytes_received"] == w.plan.naive_bytes(rank) == planned.naive_bytes(rank), where
            assert stats["bytes_received"] <= stats["baseline"]["bytes_received"], where  # equal at gen_tp 1: everyone needs all
            w.rollout.sleep()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny_4heads(tmp_path_factory):
    from hybridflow.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("pt") / "m", hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64)


def test_switch_from_3d_layouts_is_bit_exact_and_minimal(tiny_4heads):
    import torch.multiprocessing as mp

    mp.spawn(_switch_worker, args=(4, free_port(), str(tiny_4heads)), nprocs=4)


def _resume_worker(rank: int, world: int, port: int, path: str, ckpt: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sys.path.insert(0, ROOT)
    from bench.parallel_equivalence import config, make_data
    from hybridflow.run_plan import resolve
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker

    w = ActorRolloutRefWorker(resolve(config(path, "pp2xtp2")).actor, role="actor", total_training_steps=6)
    w.init_model()
    dp_i, dp, _ = w.dispatch_layout("train")
    sft = make_data(len(w.tokenizer))[0].chunk(dp)[dp_i]
    w.sft_step(sft)
    w.save_checkpoint(ckpt)
    after = [w.sft_step(sft) for _ in range(2)]
    w.load_checkpoint(ckpt)  # model, optimizer (per-FQN param groups: each stage holds its own), scheduler, RNG
    assert [w.sft_step(sft) for _ in range(2)] == after, f"rank {rank}"
    dist.destroy_process_group()


def test_pipeline_and_tensor_parallel_checkpoint_resumes_bit_exact(tiny_4heads, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_resume_worker, args=(4, free_port(), str(tiny_4heads), str(tmp_path / "ckpt")), nprocs=4)
