"""verl users' command lines: the GRPO quickstart's overrides run (paths and sizes scaled to the
tiny model); verl-only keys are mapped, accepted when they mean what hybridflow does, or refused
with the reason."""

from __future__ import annotations


import pytest

from hybridflow.config import ConfigError, load_config


def test_verl_only_keys_map_accept_or_refuse_with_the_reason():
    cfg = load_config(None, ["trainer.max_actor_ckpt_to_keep=3", "actor_rollout_ref.actor.optim.warmup_style=cosine",
                             "critic.model.fsdp_config.param_offload=true", "actor_rollout_ref.model.use_remove_padding=true",
                             "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false", "trainer.critic_warmup=0",
                             "actor_rollout_ref.hybrid_engine=true", "data.reward_fn_key=data_source"])
    assert cfg.trainer.max_ckpt_to_keep == 3 and cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    assert cfg.critic.fsdp_config.param_offload is True and cfg.actor_rollout_ref.model.use_remove_padding is True  # a real switch now
    with pytest.raises(ConfigError) as e:
        load_config(None, ["trainer.critic_warmup=5", "critic.use_dynamic_bsz=true",
                           "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true", "actor_rollout_ref.rollout.multi_turn.max_turns=3"])
    msg = str(e.value)
    assert "cannot honour (4)" in msg
    for line in ("trainer.critic_warmup=5: critic warm-up steps are not implemented",
                 "critic.use_dynamic_bsz=True: token-budget micro-batches are actor_rollout_ref.actor.use_dynamic_bsz",
                 "optimizer_offload=True: optimizer offload is not implemented in hybridflow yet; use fsdp_config.param_offload",
                 "multi_turn.max_turns=3: use actor_rollout_ref.rollout.multi_turn.max_assistant_turns"):
        assert line in msg
    with pytest.raises(ConfigError, match="did you mean 'actor_rollout_ref.rollout.n'"):  # a typo is still a typo
        load_config(None, ["actor_rollout_ref.rollout.nn=5"])


def test_dead_schema_fields_are_accepted_verl_keys_with_a_reason(caplog):
    """actor.strategy, actor.shuffle and reward_model.reward_manager are no schema fields (nothing read
    them): verl's values that mean what hybridflow does are accepted (logged), others refused naming the key."""
    import dataclasses

    from hybridflow.config import HybridFlowConfig
    from hybridflow.config.schema import ActorConfig, RewardModelConfig

    assert not {"strategy", "shuffle"} & {f.name for f in dataclasses.fields(ActorConfig)}
    assert "reward_manager" not in {f.name for f in dataclasses.fields(RewardModelConfig)}
    for strategy in ("fsdp", "fsdp2"):
        with caplog.at_level("INFO", logger="hybridflow.config"):
            cfg = load_config(None, [f"actor_rollout_ref.actor.strategy={strategy}", "actor_rollout_ref.actor.shuffle=false",
                                     "reward_model.reward_manager=naive"])
        assert cfg == HybridFlowConfig()
        assert f"actor_rollout_ref.actor.strategy='{strategy}' (the actor trains with FSDP2)" in caplog.text
        assert "actor_rollout_ref.actor.shuffle=False (mini-batch shuffling is not implemented" in caplog.text
        assert "reward_model.reward_manager='naive' (rule rewards are scored one response at a time" in caplog.text
    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.shuffle=true",
                           "reward_model.reward_manager=prime"])
    msg = str(e.value)
    assert "cannot honour (3)" in msg
    for line in ("actor_rollout_ref.actor.strategy='megatron': the actor trains with FSDP2 (accepted: ['fsdp', 'fsdp2'])",
                 "actor_rollout_ref.actor.shuffle=True: mini-batch shuffling is not implemented in hybridflow yet (accepted: [False])",
                 "reward_model.reward_manager='prime': rule rewards are scored one response at a time"):
        assert line in msg


@pytest.mark.usefixtures("ray_cluster")
def test_verl_grpo_quickstart_command_line_runs(tiny_model_dir, task_dir, tmp_path, monkeypatch):
    """verl's GSM8K GRPO quickstart (examples/grpo_trainer), key for key; changed: paths, sizes for the
    tiny model (batch sizes, lengths, n, micro-batches, GPUs, 2 steps) and the module name.
    rollout.name stays vllm only where vLLM is installed (its own test venv): hf here."""
    from hybridflow.trainer.main_ppo import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    argv = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={task_dir}/train.parquet",
        f"data.val_files={task_dir}/val.parquet",
        "data.train_batch_size=4",
        "data.max_prompt_length=32",
        "data.max_response_length=4",
        "data.filter_overlong_prompts=True",
        "data.truncation='error'",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=['console','wandb']",
        "trainer.project_name='verl_grpo_example_gsm8k'",
        "trainer.experiment_name='qwen2_7b_function_rm'",
        "trainer.n_gpus_per_node=2",
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={out}",
    ]
    assert main(argv) == 0
    saved = (out / "config.yaml").read_text()
    assert "use_kl_loss: true" in saved and "tensor_model_parallel_size: 2" in saved
    assert list((out / "wandb").glob("offline-run-*"))  # trainer.logger took wandb (offline)
