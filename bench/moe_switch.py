"""The MoE weight switch under expert parallelism: bytes measured against the planner's minimum and the naive gather.

For each (world, ep, gen_tp) it builds the actor worker on a tiny Qwen3-MoE (the ActorRolloutRefWorker with
the HF rollout, `actor_rollout_ref.actor.expert_parallel_size=ep`), takes one optimizer step so the trained
weights differ from the checkpoint the rollout loaded, then switches to the generation layout twice: the
naive path (gather every whole tensor, then slice) and the optimized one, with the weight check (every
generation weight equal to the trained one, bit for bit). Per rank: bytes received (counted from the
buffers handed to the collectives), the plan's minimum, `hybridflow plan`'s prediction from config.json,
the naive volume. Generation keeps whole experts (HF's forward); attention is split at gen_tp > 1.

    .venv/bin/python bench/moe_switch.py                    # worlds 2 and 4, every layout below
    .venv/bin/python bench/moe_switch.py --worlds 2
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {2: [(2, 1), (2, 2)], 4: [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]}  # world -> (ep, gen_tp)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    sys.path.insert(0, ROOT)
    from hybridflow.config.schema import HybridFlowConfig
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.planning.arch import load_arch
    from hybridflow.planning.cost import plan_for
    from hybridflow.protocol import Batch
    from hybridflow.run_plan import resolve
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker

    rows = []
    for ep, gen_tp in LAYOUTS[world]:
        cfg = HybridFlowConfig()
        arr = cfg.actor_rollout_ref
        arr.model.path, arr.actor.expert_parallel_size, arr.rollout.tensor_model_parallel_size = path, ep, gen_tp
        arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size_per_gpu, arr.rollout.n = 8, 2, 1
        cfg.trainer.device, cfg.trainer.n_gpus_per_node = "cpu", world
        w = ActorRolloutRefWorker(resolve(cfg).actor, role="actor_rollout", total_training_steps=1)
        w.init_model()
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(3, len(w.tokenizer), (2, 12), generator=g)
        part = Batch.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(12).repeat(2, 1),
                                        "responses": ids[:, 6:]})
        w.actor.forward_backward(part, lambda lp, ent, mb: -lp.mean(), 2)
        w.actor.step()
        stats = w.reshard(measure_baseline=True, check=True)
        planned = plan_for(load_arch(path), ParallelDims(dp=world, ep=ep), gen_tp, 4)
        rows.append(dict(world=world, ep=ep, gen_tp=gen_tp, rank=rank, measured=stats["bytes_received"], minimum=w.plan.min_bytes(rank),
                         planned=planned.min_bytes(rank), naive=stats["baseline"]["bytes_received"], max_diff=stats["max_diff"]))
        w.rollout.sleep()
    with open(f"{out}/{rank}", "wb") as f:
        pickle.dump(rows, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from hybridflow.models.tiny import make_tiny_model

    tmp = tempfile.mkdtemp()
    path = str(make_tiny_model(os.path.join(tmp, "m"), arch="qwen3_moe", hidden_size=32, intermediate_size=64, num_experts=4,
                                num_attention_heads=4, num_key_value_heads=4))  # 4 KV heads: gen_tp 4 holds whole heads
    out = []
    for world in (int(x) for x in args.worlds.split(",")):
        d = tempfile.mkdtemp(dir=tmp)
        mp.spawn(_worker, args=(world, _free_port(), path, d), nprocs=world)
        out += [r for rank in range(world) for r in pickle.load(open(os.path.join(d, str(rank)), "rb"))]
    print(f"{'layout':<12} {'gen':>5} {'rank':>4} {'measured B':>11} {'minimum B':>10} {'planned B':>10} {'naive B':>9} {'max diff':>8}")
    for r in sorted(out, key=lambda r: (r["world"], r["ep"], r["gen_tp"], r["rank"])):
        label = f"ep{r['ep']}xdp{r['world']}"
        print(f"{label:<12} {'tp' + str(r['gen_tp']):>5} {r['rank']:>4} {r['measured']:>11} {r['minimum']:>10} {r['planned']:>10} {r['naive']:>9} "
              f"{r['max_diff']:>8}")
    bad = [r for r in out if not (r["measured"] == r["minimum"] == r["planned"] and r["max_diff"] == 0.0)]
    print("every switch bit-exact, measured = the plan's minimum = hybridflow plan's" if not bad else f"MISMATCH: {bad}")
    return out


if __name__ == "__main__":
    main()
