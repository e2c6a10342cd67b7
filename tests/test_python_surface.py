"""The verl/HybridFlow-style Python surface: `PPOTrainer` with and without a critic (the
quickstart example runs both)."""

from __future__ import annotations

import os
import sys

import pytest

from hybridflow.config import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


def test_ppo_trainer_keywords_map_onto_the_typed_config():
    from hybridflow.trainer.ppo_trainer import ppo_config

    cfg = ppo_config("actor", "critic", {"data": {"train_batch_size": 4}, "trainer.total_training_steps": 5})
    assert (cfg.algorithm.adv_estimator, cfg.critic.model.path, cfg.data.train_batch_size, cfg.trainer.total_training_steps) == ("gae", "critic", 4, 5)
    assert ppo_config("actor").algorithm.adv_estimator == "grpo"
    with pytest.raises(ConfigError, match="did you mean 'trainer.total_training_steps'"):
        ppo_config("actor", None, {"trainer.total_trainig_steps": 5})


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("critic", [False, True])
def test_ppo_trainer_quickstart_with_and_without_a_critic(critic, tmp_path, monkeypatch, caplog):
    """The quickstart trains with the HybridFlow post's keywords (with the critic: its flagship
    example as written, local paths), `resharding_buffer_percent=0.1` included."""
    import logging

    from overlap_record import assert_overlapped, record_overlap
    from ppo_trainer_quickstart import main

    from hybridflow.profiler import trace_resharding

    order = record_overlap(monkeypatch, loader_seconds=0.3)  # a loader slower than Ray's dispatch
    with trace_resharding(str(tmp_path / "trace.json")), caplog.at_level(logging.INFO, logger="hybridflow"):
        result = main(["--output-dir", str(tmp_path), "--steps", "2"] + (["--critic"] if critic else []))
    last = result["history"][-1]
    assert result["steps"] == 2 and "actor/pg_loss" in last
    assert ("critic/vf_loss" in last) == critic  # GAE with the critic; GRPO without
    # resharding_overlap_with_compute=True took effect: step 1's next batch was prepared while the
    # workers resharded (recorded order, tests/overlap_record.py)
    assert_overlapped(order, 2)
    # resharding_buffer_percent=0.1 took effect: 0.1 x the tiny model's 430 KB is less than one
    # decoder layer's staging (1.5 x 148 KB at N = 2, gen_tp 1), so one layer is in flight, and the
    # driver said so once
    assert last["reshard/layers_in_flight"] == 1.0
    said = [r for r in caplog.records if "resharding_buffer_percent=0.1 allows" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and "staging 1 layer at a time" in said[0].getMessage()


def test_seed_dataflow_snippet_from_the_top_level_package():
    """The seed's 4-line DataFlow, with `verl` renamed: `from hybridflow import DataFlow`."""
    import torch

    from hybridflow import DataFlow
    from hybridflow.protocol import Batch

    flow = DataFlow()
    flow.add_stage("double", lambda b: Batch.from_dict(tensors={"y": b["x"] * 2}), ["x"], ["y"])
    flow.add_stage("sum", lambda b: Batch.from_dict(tensors={"z": b["y"] + b["x"]}), ["x", "y"], ["z"])
    out = flow.run(Batch.from_dict(tensors={"x": torch.arange(4.0)}))
    assert out["z"].tolist() == [0.0, 3.0, 6.0, 9.0]


def test_import_hybridflow_stays_light():
    import subprocess

    code = "import sys, hybridflow; print('torch' in sys.modules, 'ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == ["False", "False"]


def test_the_top_level_names_the_docs_use_resolve():
    """README's snippets import from the package: every name in `hybridflow.__all__` resolves (lazily)."""
    import hybridflow
    from hybridflow import RLTrainer, load_config, make_rl_data_loader  # noqa: F401  (the README's imports)

    for name in hybridflow.__all__:
        assert getattr(hybridflow, name).__name__ == name
    assert "RLTrainer" in dir(hybridflow)


def test_ppo_trainer_takes_a_parallel_config_dict(tiny_model_dir, task_dir, tmp_path):
    """`PPOTrainer(..., parallel_config={...})`: the dict is the file's keys (it used to be read as a
    file name); only the keys it sets change the config; validated before any worker starts."""
    from hybridflow import PPOTrainer

    data = {"train_files": [f"{task_dir}/train.parquet"], "val_files": [f"{task_dir}/val.parquet"], "train_batch_size": 4,
            "max_prompt_length": 32, "max_response_length": 4}
    keys = {"actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
            "actor_rollout_ref.actor.fsdp_config.mixed_precision": "bf16",
            "trainer.default_local_dir": str(tmp_path)}
    trainer = PPOTrainer(actor_model=tiny_model_dir, data=data, parallel_config={"model_parallel_size": 1, "generation_tensor_parallel_size": 2},
                         **keys)
    assert trainer.cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert trainer.cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision == "bf16"  # not set by the dict: as given
    with pytest.raises(ConfigError, match="did you mean 'model_parallel_size'"):
        PPOTrainer(actor_model=tiny_model_dir, data=data, parallel_config={"model_paralel_size": 2}, **keys)


@pytest.mark.parametrize("dp, micro", [(1, 8), (2, 4), (4, 2)])
def test_the_seed_ppo_trainer_example_constructs_at_1_2_and_4_workers(dp, micro, tiny_model_dir, task_dir, tmp_path):
    """The resharding post's flagship example with local paths and the worker count as the only other
    keys: no default is refused. The micro-batches nobody set are derived: the largest divisor up to 8
    of the 8 prompts x 1 sample / dp sequences a worker gets per mini-batch. (It trains in
    test_ppo_trainer_quickstart_with_and_without_a_critic, at dp 2.)"""
    from hybridflow import PPOTrainer

    trainer = PPOTrainer(actor_model=tiny_model_dir, critic_model=tiny_model_dir,
                         parallel_config={"model_parallel_size": 1, "data_parallel_size": dp},
                         enable_resharding_opt=True, resharding_overlap_with_compute=True, resharding_buffer_percent=0.1,
                         data={"train_files": [f"{task_dir}/train.parquet"]},
                         **{"trainer.n_gpus_per_node": dp, "trainer.default_local_dir": str(tmp_path)})
    a, c = trainer.cfg.actor_rollout_ref.actor, trainer.cfg.critic
    assert (a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, c.ppo_micro_batch_size_per_gpu) == (8, micro, micro)
    assert trainer.cfg.actor_rollout_ref.hybrid_engine.resharding_buffer_percent == 0.1


def test_wrap_hf_model_with_fsdp_in_a_plain_python_process(tiny_model_dir):
    """The seed's snippet outside any launcher: the one-process group starts by itself."""
    import subprocess

    code = ("import torch; from transformers import AutoModelForCausalLM; "
            "from hybridflow.utils.hf_integration import wrap_hf_model_with_fsdp; "
            f"m = wrap_hf_model_with_fsdp(AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r}, dtype=torch.float32), "
            "{'mixed_precision': None, 'offload_params': False, 'sharding_strategy': 'FULL_SHARD'}); "
            "import torch.distributed as dist; out = m(input_ids=torch.tensor([[1, 2, 3]])); "
            "print(dist.get_world_size(), type(next(m.parameters())).__name__, tuple(out.logits.shape[:2]))")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-4:] == ["1", "DTensor", "(1,", "3)"]


def test_wrap_hf_model_with_fsdp_mixed_precision_true_and_amp_outside_a_launcher(tiny_model_dir):
    """The seeds' `{"mixed_precision": True, "sharding_strategy": "FULL_SHARD"}` and `{"mixed_precision":
    "amp"}` in a plain python process: the CPU's preferred low precision is bf16, so the forward runs
    in bf16 over fp32 shards (its logits come out bf16); false keeps meaning off (fp32 logits)."""
    import subprocess

    code = ("import torch; from transformers import AutoModelForCausalLM; "
            "from hybridflow.utils.hf_integration import prepare_fsdp_model, wrap_hf_model_with_fsdp; "
            f"load = lambda: AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r}, dtype=torch.float32); "
            "ids = torch.tensor([[1, 2, 3]]); "
            "models = [wrap_hf_model_with_fsdp(load(), {'mixed_precision': True, 'sharding_strategy': 'FULL_SHARD'}), "
            "wrap_hf_model_with_fsdp(load(), {'mixed_precision': 'amp'}), wrap_hf_model_with_fsdp(load(), {'mixed_precision': False}), "
            "prepare_fsdp_model(load(), None, {'mixed_precision': 'amp'})]; "
            "print(*[str(m(input_ids=ids).logits.dtype) + '/' + str(next(m.parameters()).dtype) for m in models])")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU's answer, also on a machine with a GPU
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bf16, fp32 = "torch.bfloat16/torch.float32", "torch.float32/torch.float32"  # logits / the stored shards
    assert proc.stdout.split()[-4:] == [bf16, bf16, fp32, bf16]
