"""Parallelism does not change the math: 3 SFT steps and 3 PPO updates of a tiny fp32 model under
dp4, tp2xdp2, pp2xdp2 and pp2xtp2 (1F1B; pp2xdp2 also with GPipe) on 4 processes against the
single-process run. The layouts run the chunked log-prob pass (model.use_fused_kernels, 4-token
chunks: several per micro-batch; under TP the vocab-sharded LM head is gathered), the
single-process reference the plain logits pass, so each row also checks the one against the other.

Every run goes through the real actor worker (`ActorRolloutRefWorker`, role "actor") exactly as
the trainer calls it: each data-parallel rank gets its chunk (the controller's split), a pipeline
x TP group shares one, and the reported metrics are the mean over the collected ranks (the last
stage's TP rank 0 of every dp group). PPO: `compute_log_prob` (old log-probs, through the pipeline
where there is one) then `update_actor` (one mini-batch = one optimizer step). Every row has the
same number of loss tokens, so the mean over dp ranks of their token-means is the global mean.

    .venv/bin/python bench/parallel_equivalence.py --json runs/parallel_equivalence.json

Rows: layout, max_loss_diff, max_grad_norm_diff (over the 3 + 3 steps, against the single
process), max_logprob_diff (old log-probs of the PPO steps) and the seconds it took.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYOUTS = ("dp4", "tp2xdp2", "pp2xdp2", "pp2xtp2", "pp2xdp2-gpipe")  # "-gpipe": that schedule instead of 1F1B; "-plain": the logits pass
FUSED_CHUNK = 4  # tokens per chunk of the chunked log-prob pass: a micro-batch (2 x 5 response tokens) takes 3
ROWS, PROMPT, RESPONSE, MICRO = 16, 6, 5, 2


def make_data(vocab: int, seed: int = 0):
    """SFT and PPO batches of ROWS rows: left-padded prompts of varied length, full responses."""
    import torch

    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, PROMPT + 1, (ROWS,), generator=g)
    prompt_mask = (torch.arange(PROMPT)[None] >= PROMPT - plen[:, None]).long()
    ids = torch.randint(3, vocab, (ROWS, PROMPT + RESPONSE), generator=g)
    mask = torch.cat([prompt_mask, torch.ones(ROWS, RESPONSE, dtype=torch.long)], 1)
    ids = ids * mask
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    loss_mask = torch.cat([torch.zeros(ROWS, PROMPT, dtype=torch.long), torch.ones(ROWS, RESPONSE, dtype=torch.long)], 1)
    sft = Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos, "loss_mask": loss_mask})
    ppo = Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, PROMPT:],
                                   "response_mask": torch.ones(ROWS, RESPONSE), "advantages": torch.randn(ROWS, RESPONSE, generator=g)})
    return sft, ppo


def config(model: str, layout: str):
    from hybridflow.config.schema import HybridFlowConfig
    from hybridflow.parallel.dims import ParallelDims

    layout, *suffixes = layout.split("-")
    lay = ParallelDims.parse(layout)
    cfg = HybridFlowConfig()
    cfg.actor_rollout_ref.actor.pipeline_schedule = "gpipe" if "gpipe" in suffixes else "1f1b"
    arr = cfg.actor_rollout_ref
    arr.model.path = model
    arr.model.use_fused_kernels, arr.model.fused_kernel_chunk_size = "plain" not in suffixes, FUSED_CHUNK
    a = arr.actor
    a.tensor_model_parallel_size, a.pipeline_model_parallel_size = lay.tp, lay.pp
    a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu = ROWS, MICRO  # one optimizer step per update
    a.optim.lr, a.optim.lr_warmup_steps, a.grad_clip = 1e-2, 0, 1.0
    arr.rollout.n, arr.rollout.log_prob_micro_batch_size_per_gpu = 1, MICRO
    cfg.trainer.device, cfg.trainer.n_gpus_per_node = "cpu", lay.world  # the spec's layout: pp x tp x dp over these ranks
    return cfg


def worker(rank: int, world: int, port: int, model: str, layouts: list[str], out: str) -> None:
    """Every layout in turn in one process group: spawning 4 processes (torch, transformers and our
    imports) costs more than a layout's 6 steps, so a group is started once."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    import torch

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from hybridflow.run_plan import resolve
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker

    for layout in layouts:
        t0 = time.perf_counter()
        w = ActorRolloutRefWorker(resolve(config(model, layout)).actor, role="actor", total_training_steps=6)
        w.init_model()
        dp_i, dp, collect = w.dispatch_layout("train")
        sft, ppo = make_data(len(w.tokenizer))
        steps, logps = [], []
        for _ in range(3):
            m = w.sft_step(sft.chunk(dp)[dp_i])
            steps.append((m["train/loss"], m["train/grad_norm"]))
        for _ in range(3):
            part = ppo.chunk(dp)[dp_i]
            old = w.compute_log_prob(part)
            part.tensors["old_log_probs"] = old["old_log_probs"]
            m = w.update_actor(part)
            steps.append((m["actor/pg_loss"] if collect else 0.0, m["actor/grad_norm"]))
            logps.append(old["old_log_probs"])
        torch.distributed.barrier()  # every rank done with this layout before the next one builds its meshes
        if collect:
            with open(f"{out}/{layout}.{rank}", "wb") as f:
                pickle.dump({"dp_i": dp_i, "steps": steps, "logps": logps, "seconds": time.perf_counter() - t0}, f)
        del w
    torch.distributed.destroy_process_group()


def run_layouts(model: str, layouts: list[str], world: int, out: str) -> dict[str, list[dict]]:
    """{layout: per collected rank (one per dp index, in dp order) its steps, old log-probs and seconds}."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(out, exist_ok=True)
    mp.spawn(worker, args=(world, port, model, layouts, out), nprocs=world)
    found = {layout: [pickle.load(open(os.path.join(out, f), "rb")) for f in sorted(os.listdir(out)) if f.startswith(layout + ".")]
             for layout in layouts}
    return {layout: sorted(rows, key=lambda r: r["dp_i"]) for layout, rows in found.items()}


def compare(ref: list[dict], got: list[dict]) -> dict:
    import torch

    ref_steps = ref[0]["steps"]
    steps = [tuple(sum(r["steps"][i][j] for r in got) / len(got) for j in range(2)) for i in range(len(ref_steps))]
    logp = torch.cat([torch.cat(r["logps"], 1) for r in got])
    return {
        "max_loss_diff": max(abs(a[0] - b[0]) for a, b in zip(steps, ref_steps)),
        "max_grad_norm_diff": max(abs(a[1] - b[1]) for a, b in zip(steps, ref_steps)),
        "max_logprob_diff": float((logp - torch.cat(ref[0]["logps"], 1)).abs().max()),
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated training layouts on 4 processes (suffix -gpipe: GPipe)")
    p.add_argument("--model-dir", default=None, help="an HF causal LM (default: a tiny Qwen2 built here)")
    args = p.parse_args(argv)
    from bench.common import print_rows
    from hybridflow.models.tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_dir or str(make_tiny_model(os.path.join(tmp, "model"), hidden_size=32, num_hidden_layers=2, intermediate_size=64))
        t0 = time.perf_counter()
        ref = run_layouts(model, ["dp1-plain"], 1, os.path.join(tmp, "ref"))["dp1-plain"]
        print(f"single process: {time.perf_counter() - t0:.1f} s; steps (loss, grad_norm): "
              + ", ".join(f"({a:.5f}, {b:.5f})" for a, b in ref[0]["steps"]))
        layouts = args.layouts.split(",")
        runs = run_layouts(model, layouts, 4, os.path.join(tmp, "layouts"))
        rows = []
        for layout in layouts:
            got = runs[layout]
            print(f"{layout}: steps (loss, grad_norm) per dp rank: " + "; ".join(", ".join(f"({a:.5f}, {b:.5f})" for a, b in r["steps"]) for r in got))
            rows.append({"layout": layout, **compare(ref, got), "seconds": max(r["seconds"] for r in got)})
    print_rows("Training layouts on 4 processes (chunked log-probs) vs one process (plain logits; fp32, 3 SFT steps + 3 PPO updates)",
               [("layout", "layout", "<14"), ("max_loss_diff", "max_loss_diff", ">14.2e"), ("max_grad_norm_diff", "max_grad_norm_diff", ">19.2e"),
                ("max_logprob_diff", "max_logprob_diff", ">17.2e"), ("seconds", "seconds", ">8.1f")], rows, args.json)
    return rows


if __name__ == "__main__":
    main()
