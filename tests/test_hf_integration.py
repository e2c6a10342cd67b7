"""Helpers for users' own loops: init_distributed, wrap_hf_model_with_fsdp, prepare_fsdp_model
(real FSDP2 on 2 torchrun processes), make_rl_data_loader, and the accelerate example."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import ROOT, rl_overrides, run_torchrun as _torchrun
from hybridflow.config import HybridFlowConfig, load_config
from hybridflow.data.loader import make_rl_data_loader



def test_fsdp_helpers_shard_across_two_processes(tiny_model_dir, tmp_path):
    _torchrun(os.path.join(ROOT, "tests", "fsdp_helpers_check.py"), str(tmp_path), str(tiny_model_dir))
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    full = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        want = float(full(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.sum())
    for r, rep in enumerate(reports):
        assert (rep["rank"], rep["world_size"], rep["backend"]) == (r, 2, "gloo")
        for key in ("wrap", "prepare"):
            local, total = rep[key]
            assert total == sum(p.numel() for p in full.parameters())
            assert 0.4 * total <= local <= 0.6 * total, (key, local, total)  # each rank holds about half
            assert rep[f"{key}_logits_sum"] == pytest.approx(want, rel=1e-5)  # the sharded model computes the same
    assert sum(rep["wrap"][0] for rep in reports) == reports[0]["wrap"][1]  # the halves add up to the model


def test_accelerate_example_trains(tmp_path):
    proc = _torchrun("examples/accelerate_fsdp.py", "--output-dir", str(tmp_path), "--steps", "5")
    losses = [float(line.split("Loss: ")[1]) for line in proc.stdout.splitlines() if line.startswith("Step ")]
    assert len(losses) == 5 and losses[-1] < losses[0]


def test_make_rl_data_loader_from_files_or_config(tiny_model_dir, task_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    loader = make_rl_data_loader([task_dir / "train.parquet"], tok, batch_size=4, max_prompt_length=32)
    batch = loader.next_batch()
    assert batch["input_ids"].shape == (4, 32) and len(batch["data_source"]) == 4
    cfg = load_config(None, rl_overrides(tiny_model_dir, task_dir, tmp_path), schema=HybridFlowConfig)
    from_cfg = make_rl_data_loader(config=cfg)
    assert from_cfg.batch_size == cfg.data.train_batch_size and from_cfg.next_batch()["input_ids"].shape[1] == cfg.data.max_prompt_length


def test_init_distributed_without_torchrun_is_one_rank():
    code = ("from hybridflow.utils.distributed import init_distributed; i = init_distributed(); "
            "print(i.rank, i.world_size, i.backend, i.device)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0", "1", "gloo", "cpu"]
