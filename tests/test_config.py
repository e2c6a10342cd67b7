"""Config loading (YAML + dotlist, typed) and driver-side validation."""

import glob
import json
import importlib.util
import os
import re

import pytest

from hybridflow.config import (ConfigError, HybridFlowConfig, RewardTrainConfig, SFTConfig, load_config, save_config, to_dict,
                               validate_config, validate_sft_config)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- loader
def test_defaults():
    cfg = load_config(None)
    assert cfg == HybridFlowConfig()
    assert cfg.actor_rollout_ref.rollout.name == "hf"
    assert isinstance(load_config(None, schema=SFTConfig), SFTConfig)


def test_yaml_then_dotlist_precedence(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  train_batch_size: 4\n  max_prompt_length: 10\nactor_rollout_ref:\n  rollout:\n    n: 2\n")
    cfg = load_config(str(f), ["actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.optim.lr=5e-4",
                               "actor_rollout_ref.model.tokenizer_path=null", "trainer.logger=[console]"])
    assert cfg.data.train_batch_size == 4 and cfg.data.max_prompt_length == 10  # from YAML
    assert cfg.actor_rollout_ref.rollout.n == 8  # override wins
    assert cfg.actor_rollout_ref.actor.optim.lr == 5e-4
    assert cfg.actor_rollout_ref.model.tokenizer_path is None
    assert cfg.trainer.logger == ["console"]
    assert cfg.data.shuffle is True  # untouched default


def test_empty_yaml(tmp_path):
    f = tmp_path / "e.yaml"
    f.write_text("")
    assert load_config(str(f)) == HybridFlowConfig()


def test_unknown_key_dotlist():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor_rollout_ref.rollout.nn=8"])
    assert "actor_rollout_ref.rollout.nn" in str(e.value)
    assert "did you mean 'actor_rollout_ref.rollout.n'" in str(e.value)


def test_unknown_key_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  train_batch_sise: 4\n")
    with pytest.raises(ConfigError, match=r"data\.train_batch_sise.*did you mean 'data\.train_batch_size'"):
        load_config(str(f))


@pytest.mark.parametrize("item, suggestion", [
    ("actor.clip_ratio_high=0.28", "'actor_rollout_ref.actor.clip_ratio_high'"),
    ("actor.policy_loss.loss_mode=gspo", "'actor_rollout_ref.actor.policy_loss.loss_mode'"),
    ("rollout.n=4", "'actor_rollout_ref.rollout.n'"),
    ("ref.log_prob_micro_batch_size_per_gpu=2", "'actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu'"),
    ("model.path=m", "'actor_rollout_ref.model.path' or 'critic.model.path'"),
])
def test_a_section_written_without_its_parent_names_the_full_key(item, suggestion):
    """verl nests actor, rollout, ref and model under actor_rollout_ref: a bare `actor.*` key says so."""
    key = item.split("=")[0]
    with pytest.raises(ConfigError, match=rf"unknown config key '{re.escape(key)}'; did you mean {re.escape(suggestion)}"):
        load_config(None, [item])


def test_auto_resume_refuses_the_checkpoints_of_another_run(tmp_path):
    """Checkpoints are on by default and resume_mode=auto picks up what trainer.default_local_dir holds:
    a run with another model / algorithm there is refused (naming the keys), the same run is not."""
    import torch

    from hybridflow.trainer import checkpoints

    run = load_config(None, [f"trainer.default_local_dir={tmp_path}", "actor_rollout_ref.model.path=runs/tiny_model"])
    step = tmp_path / "global_step_20"
    step.mkdir()
    torch.save({"global_step": 20, "run_keys": checkpoints.run_keys(run)}, step / checkpoints.STATE)
    (tmp_path / checkpoints.LATEST).write_text("20")
    found = checkpoints.resume_path(run.trainer)
    checkpoints.check_same_run(found, run)  # the same run (the kill -9 and rerun case): fine
    other = load_config(None, [f"trainer.default_local_dir={tmp_path}", "actor_rollout_ref.model.path=./runs/sft_model",
                               "algorithm.adv_estimator=gae", "trainer.total_training_steps=100"])
    with pytest.raises(ConfigError, match=r"holds checkpoints of another run \(global_step_20; actor_rollout_ref.model.path: "
                                          r"'runs/tiny_model' there, 'runs/sft_model' now; algorithm.adv_estimator: 'grpo' there, 'gae' now\).*"
                                          r"trainer.resume_mode=disable"):
        checkpoints.check_same_run(found, other)
    torch.save({"global_step": 20}, step / checkpoints.STATE)  # a checkpoint from before the keys were recorded
    checkpoints.check_same_run(found, other)


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'zzz'.*valid keys.*actor_rollout_ref"):
        load_config(None, ["zzz=1"])


@pytest.mark.parametrize("item, pattern", [
    ("data.train_batch_size=abc", r"data\.train_batch_size must be int, got 'abc' \(str\)"),
    ("data.shuffle=1", r"data\.shuffle must be bool"),
    ("data.max_prompt_length=1.5", r"data\.max_prompt_length must be int"),
    ("actor_rollout_ref.actor.optim.lr=fast", r"actor_rollout_ref\.actor\.optim\.lr must be float"),
    ("data.val_batch_size=x", r"data\.val_batch_size must be Optional\[int\]"),
    ("data=5", r"data is a section"),
    ("critic.model.path=null", r"critic\.model\.path must be str, got None"),
    ("data.train_files=[1,2]", r"data\.train_files\[0\] must be str"),
])
def test_type_errors(item, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [item])


def test_coercions():
    cfg = load_config(None, ["data.train_files=a.parquet", "actor_rollout_ref.actor.optim.lr=1",
                             "data.val_batch_size=null", "data.val_files=[a.parquet,b.parquet]"])
    assert cfg.data.train_files == ["a.parquet"]
    assert cfg.data.val_files == ["a.parquet", "b.parquet"]
    assert cfg.actor_rollout_ref.actor.optim.lr == 1.0 and isinstance(cfg.actor_rollout_ref.actor.optim.lr, float)
    assert cfg.data.val_batch_size is None


def test_override_without_equals():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["actor_rollout_ref.rollout.n"])


def test_round_trip(tmp_path):
    cfg = load_config(None, ["actor_rollout_ref.rollout.n=4", "data.train_files=[x.parquet]",
                             "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.optim.lr=3e-6"])
    save_config(cfg, str(tmp_path / "out" / "config.yaml"))
    assert load_config(str(tmp_path / "out" / "config.yaml")) == cfg
    sft = SFTConfig(max_length=17)
    save_config(sft, str(tmp_path / "sft.yaml"))
    assert load_config(str(tmp_path / "sft.yaml"), schema=SFTConfig) == sft
    assert to_dict(cfg)["actor_rollout_ref"]["rollout"]["n"] == 4


@pytest.mark.parametrize("name, schema", [("grpo_tiny.yaml", HybridFlowConfig), ("ppo_tiny.yaml", HybridFlowConfig),
                                          ("sft_tiny.yaml", SFTConfig), ("dpo_tiny.yaml", HybridFlowConfig),
                                          ("rm_tiny.yaml", RewardTrainConfig), ("dapo_tiny.yaml", HybridFlowConfig)])
def test_shipped_configs_parse(name, schema):
    cfg = load_config(os.path.join(ROOT, "configs", name), schema=schema)
    assert isinstance(cfg, schema)
    assert len(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))) >= 3


# ---------------------------------------------------------------- validation
@pytest.fixture
def world(tmp_path):
    """A fake model dir and data files; returns a valid GRPO config over them."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 64, "num_attention_heads": 4,
                                                   "num_key_value_heads": 2}))
    for name in ("train.parquet", "val.parquet", "reward.py"):
        (tmp_path / name).write_text("")
    return load_config(os.path.join(ROOT, "configs", "grpo_tiny.yaml"), [
        f"actor_rollout_ref.model.path={model}", f"data.train_files=[{tmp_path / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'val.parquet'}]"])


def _problems(cfg):
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    return str(e.value)


def test_valid_configs_pass(world):
    validate_config(world)
    a = world.actor_rollout_ref
    a.rollout.n, a.actor.ppo_micro_batch_size_per_gpu, world.critic.ppo_micro_batch_size_per_gpu = 4, 16, 16
    world.algorithm.adv_estimator = "gae"
    validate_config(world)  # the ppo_tiny shape


# (data.train_batch_size, rollout.n, workers, extra keys) -> (mini-batch, actor micro, critic micro), by hand:
# mini = the largest divisor of train_batch_size <= 8 whose prompts x n split over the workers; micro = the
# largest divisor <= 8 of mini x n / workers (DPO: pairs, micro even over both sides); critic as the actor.
DERIVED = [
    ((8, 1, 2, {}), (8, 4, 4)),  # the seed's PPOTrainer example: 8 x 1 / 2 = 4 sequences per worker
    ((8, 1, 1, {}), (8, 8, 8)),
    ((8, 1, 4, {}), (8, 2, 2)),
    ((8, 8, 4, {}), (8, 8, 8)),  # 16 per worker: the cap
    ((6, 1, 2, {}), (6, 3, 3)),
    ((4, 2, 4, {}), (4, 2, 2)),  # a batch below the cap
    ((12, 1, 4, {}), (4, 1, 1)),  # 6 does not split over 4 workers, 4 does
    ((16, 2, 2, {"actor_rollout_ref.actor.recompute_old_log_prob": False}), (16, 8, 8)),  # one on-policy pass: the whole batch
    ((8, 2, 2, {"critic.ppo_mini_batch_size": 2}), (8, 8, 2)),  # the critic's own mini-batch: 2 x 2 / 2 = 2
]


@pytest.mark.parametrize("sizes, expected", DERIVED)
def test_unset_batch_sizes_are_derived_from_the_layout(sizes, expected, world):
    from hybridflow.config.derive import derive_defaults

    train, n, workers, extra = sizes
    cfg = load_config(None, [f"actor_rollout_ref.model.path={world.actor_rollout_ref.model.path}", f"data.train_files={world.data.train_files}",
                             "data.max_prompt_length=32", "algorithm.adv_estimator=gae", f"data.train_batch_size={train}", f"actor_rollout_ref.rollout.n={n}",
                             f"trainer.n_gpus_per_node={workers}", *(f"{k}={v}" for k, v in extra.items())])
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is None  # not set by the user
    validate_config(cfg)  # a default is never refused
    out = derive_defaults(cfg)
    a = out.actor_rollout_ref.actor
    assert (a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, out.critic.ppo_micro_batch_size_per_gpu) == expected
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is None  # derive_defaults returns a copy


@pytest.mark.parametrize("train, workers, expected", [(8, 2, (8, 8)), (6, 2, (6, 6)), (8, 4, (8, 4))])
def test_unset_dpo_batch_sizes_are_derived_in_whole_pairs(train, workers, expected, world):
    from hybridflow.config.derive import derive_defaults

    cfg = load_config(None, [f"actor_rollout_ref.model.path={world.actor_rollout_ref.model.path}", f"data.train_files={world.data.train_files}",
                             "data.max_prompt_length=32", f"data.train_batch_size={train}", f"trainer.n_gpus_per_node={workers}"])
    validate_config(cfg, "dpo")
    a = derive_defaults(cfg, "dpo").actor_rollout_ref.actor
    assert (a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu) == expected


@pytest.mark.parametrize("keys, kind, n", [
    ([], "rl", 8),  # grpo, the default estimator, compares a prompt's samples: 8 (TRL's num_generations)
    (["algorithm.adv_estimator=rloo"], "rl", 8),
    (["algorithm.adv_estimator=gae"], "rl", 1),  # verl's default: one sample per prompt
    (["algorithm.adv_estimator=reinforce_plus_plus"], "rl", 1),
    ([], "dpo", 1),  # offline pairs: nothing is sampled for the pairs
    (["dpo.online=true"], "dpo", 8),  # best vs worst of n
    (["actor_rollout_ref.rollout.n=3"], "rl", 3),  # set: kept
])
def test_unset_rollout_n_follows_the_algorithm_and_the_default_config_validates(keys, kind, n, world):
    from hybridflow.config.derive import derive_defaults

    cfg = load_config(None, [f"actor_rollout_ref.model.path={world.actor_rollout_ref.model.path}", f"data.train_files={world.data.train_files}",
                             "data.max_prompt_length=32", *keys])
    validate_config(cfg, kind)  # with no batch or sample count set, nothing is refused
    assert derive_defaults(cfg, kind).actor_rollout_ref.rollout.n == n
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.n must be >= 2 for algorithm\.adv_estimator=grpo"):
        validate_config(load_config(None, [f"actor_rollout_ref.model.path={world.actor_rollout_ref.model.path}",
                                           f"data.train_files={world.data.train_files}", "actor_rollout_ref.rollout.n=1"]))


def test_a_size_the_user_set_is_still_refused_and_a_derived_one_is_logged_once(world, caplog, monkeypatch):
    from hybridflow.config import derive
    from hybridflow.trainer.rl import resolve_config

    monkeypatch.setattr(derive, "_LOGGED", set())  # other tests in this process may have logged it already
    base = [f"actor_rollout_ref.model.path={world.actor_rollout_ref.model.path}", f"data.train_files={world.data.train_files}",
            "data.max_prompt_length=32", "algorithm.adv_estimator=gae"]
    with pytest.raises(ConfigError) as e:
        validate_config(load_config(None, [*base, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]))
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (8) is larger than the per-worker mini-batch" in str(e.value)
    assert "critic.ppo_micro_batch_size_per_gpu" not in str(e.value)  # unset: derived, not refused
    with caplog.at_level("INFO", logger="hybridflow"):
        for _ in range(2):  # a second trainer in the same process does not repeat it
            cfg = resolve_config(load_config(None, base), None, {}, "rl")
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("actor micro batch 4: derived from")]
    assert len(lines) == 1 and "per-worker mini-batch of 4 sequences" in lines[0], lines


def _set(cfg, dotted, value):
    *parents, leaf = dotted.split(".")
    obj = cfg
    for p in parents:
        obj = getattr(obj, p)
    setattr(obj, leaf, value)


@pytest.mark.parametrize("changes, expected", [
    ({"trainer.n_gpus_per_node": 0}, "trainer.nnodes * trainer.n_gpus_per_node must be >= 1"),
    ({"data.train_batch_size": 3, "actor_rollout_ref.rollout.n": 3, "actor_rollout_ref.actor.ppo_mini_batch_size": 3},
     "set data.train_batch_size to a multiple of 2"),
    ({"actor_rollout_ref.actor.ppo_mini_batch_size": 16}, "actor_rollout_ref.actor.ppo_mini_batch_size (16) must be <="),
    ({"actor_rollout_ref.actor.ppo_mini_batch_size": 3}, "must be a multiple of actor_rollout_ref.actor.ppo_mini_batch_size"),
    ({"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 64}, "lower actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ({"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 5}, "divisible by actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ({"algorithm.adv_estimator": "gae", "critic.ppo_micro_batch_size_per_gpu": 64}, "lower critic.ppo_micro_batch_size_per_gpu"),
    ({"algorithm.adv_estimator": "gae", "critic.ppo_mini_batch_size": 16}, "critic.ppo_mini_batch_size (16) must be <="),
    ({"data.max_prompt_length": 0}, "data.max_prompt_length must be a positive integer"),
    ({"data.max_response_length": -1}, "data.max_response_length must be a positive integer"),
    ({"actor_rollout_ref.actor.ppo_epochs": 0}, "actor_rollout_ref.actor.ppo_epochs must be a positive"),
    ({"actor_rollout_ref.rollout.n": 0}, "actor_rollout_ref.rollout.n must be a positive"),
    ({"actor_rollout_ref.actor.clip_ratio": 0.0}, "actor_rollout_ref.actor.clip_ratio must be > 0"),
    ({"actor_rollout_ref.actor.clip_ratio_c": 1.0}, "actor_rollout_ref.actor.clip_ratio_c must be > 1"),
    ({"actor_rollout_ref.rollout.temperature": -0.1}, "actor_rollout_ref.rollout.temperature must be >= 0"),
    ({"actor_rollout_ref.rollout.top_p": 0.0}, "actor_rollout_ref.rollout.top_p must be in (0, 1]"),
    ({"actor_rollout_ref.rollout.name": "sglang"}, "unknown rollout backend 'sglang' (actor_rollout_ref.rollout.name); registered: ['hf', 'vllm'"),
    ({"async_training.max_staleness": -1}, "async_training.max_staleness must be an integer >= 0"),
    ({"async_training.max_staleness": 2}, "async_training.max_staleness=2 applies to trainer.async_rollout=true"),
    ({"async_training.partial_rollout": True}, "async_training.partial_rollout=true pauses running requests for the weight updates that "
     "reach a rollout pool of its own (trainer.async_rollout=true)"),
    ({"async_training.partial_rollout_chunk": 0}, "async_training.partial_rollout_chunk must be a positive number of tokens"),
    ({"actor_rollout_ref.hybrid_engine.delta_sync": True, "actor_rollout_ref.hybrid_engine.granularity": "full"},
     "actor_rollout_ref.hybrid_engine.delta_sync=true needs the layer-wise optimized switch for the colocated rollout"),
    ({"async_training.partial_rollout_chunk": 8}, "async_training.partial_rollout_chunk=8 applies to async_training.partial_rollout=true"),
    ({"actor_rollout_ref.rollout.request_timeout_s": 0}, "actor_rollout_ref.rollout.request_timeout_s must be > 0 seconds, got 0"),
    ({"actor_rollout_ref.actor.loss_agg_mode": "sum"}, "actor_rollout_ref.actor.loss_agg_mode must be one of"),
    ({"actor_rollout_ref.actor.kl_loss_type": "k9"}, "actor_rollout_ref.actor.kl_loss_type must be one of"),
    ({"algorithm.kl_penalty": "k9"}, "algorithm.kl_penalty must be one of"),
    ({"algorithm.kl_ctrl.type": "pid"}, "algorithm.kl_ctrl.type must be one of"),
    ({"algorithm.adv_estimator": "dpo"}, "algorithm.adv_estimator must be one of"),
    ({"actor_rollout_ref.actor.optim.lr_scheduler_type": "linear"}, "actor_rollout_ref.actor.optim.lr_scheduler_type"),
    ({"trainer.device": "tpu"}, "trainer.device must be one of"),
    ({"trainer.resume_mode": "always"}, "trainer.resume_mode must be one of"),
    ({"data.truncation": "middle"}, "data.truncation must be one of"),
    ({"trainer.logger": ["console", "mlflow"]}, "trainer.logger must be one of ['console', 'jsonl', 'tensorboard', 'wandb'], got 'mlflow'"),
    ({"trainer.prometheus.port": 70000}, "trainer.prometheus.port must be in [0, 65535]"),
    ({"actor_rollout_ref.actor.recompute_old_log_prob": False, "actor_rollout_ref.actor.ppo_epochs": 2},
     "actor_rollout_ref.actor.recompute_old_log_prob=false needs the update to be one on-policy pass"),
    ({"trainer.max_ckpt_to_keep": 0}, "trainer.max_ckpt_to_keep must be >= 1"),
    ({"custom_reward_function.timeout_s": 0.0}, "custom_reward_function.timeout_s must be > 0"),
    ({"actor_rollout_ref.rollout.n": 1, "data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1}, "must be >= 2 for algorithm.adv_estimator=grpo"),
    ({"actor_rollout_ref.rollout.tensor_model_parallel_size": 3},
     "actor_rollout_ref.rollout.tensor_model_parallel_size (3) must divide the number of actor workers (2 = "),
    ({"actor_rollout_ref.rollout.tensor_model_parallel_size": 0},
     "actor_rollout_ref.rollout.tensor_model_parallel_size must be an integer >= 1, got 0"),
    ({"reward_model.enable": True}, "reward_model.model.path: '' is not a directory containing config.json"),
    ({"reward_model.enable": True, "reward_model.score_weight": 0.0}, "reward_model.score_weight and reward_model.rule_weight are both 0"),
    ({"actor_rollout_ref.model.path": "/nonexistent/m"}, "hybridflow make-model /nonexistent/m"),
    ({"data.max_prompt_length": 61}, "data.max_prompt_length + data.max_response_length (61+4) exceeds the model's max_position_embeddings (64)"),
    ({"critic.model.path": "/nonexistent/c"}, "critic.model.path: '/nonexistent/c'"),
    ({"data.train_files": []}, "data.train_files is empty"),
    ({"data.train_files": ["/nonexistent/t.parquet"]}, "data.train_files: file '/nonexistent/t.parquet' does not exist"),
    ({"data.val_files": ["/nonexistent/v.parquet"]}, "data.val_files: file '/nonexistent/v.parquet'"),
    ({"custom_reward_function.path": "/nonexistent/r.py"}, "custom_reward_function.path: file '/nonexistent/r.py'"),
    ({"data.val_batch_size": 0}, "data.val_batch_size must be a positive integer"),
    ({"actor_rollout_ref.actor.use_dynamic_bsz": True, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 10},
     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu (10) must hold one whole sequence"),
    ({"actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": True, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 10},
     "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu (10) must hold one whole sequence"),
    ({"trainer.memory_budget_gib": 0.0}, "trainer.memory_budget_gib must be > 0"),
    ({"actor_rollout_ref.model.dtype": "float8"},
     "actor_rollout_ref.model.dtype must be one of ['float32', 'fp32', 'bfloat16', 'bf16', 'float16', 'fp16'], got 'float8'"),
    ({"reward_model.overlong_buffer.enable": True, "reward_model.overlong_buffer.len": 0},
     "reward_model.overlong_buffer.len must be in [1, data.max_response_length (4)] with overlong_buffer.enable=true, got 0"),
    # DAPO's dynamic sampling and rollout correction
    ({"algorithm.filter_groups.enable": True, "actor_rollout_ref.rollout.n": 1}, "which needs actor_rollout_ref.rollout.n >= 2 samples per prompt (got 1)"),
    ({"algorithm.filter_groups.enable": True, "algorithm.filter_groups.max_num_gen_batches": -1},
     "algorithm.filter_groups.max_num_gen_batches must be >= 0 (0 = no limit), got -1"),
    ({"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "seq_final_reward", "algorithm.use_kl_in_reward": True},
     "algorithm.filter_groups.metric=seq_final_reward (rewards after the KL penalty) is not available"),
    ({"algorithm.rollout_correction.rollout_rs": "token", "algorithm.rollout_correction.rollout_rs_threshold_lower": 3.0},
     "algorithm.rollout_correction: rejection needs 0 < rollout_rs_threshold_lower < rollout_rs_threshold, got 3.0 and 2.0"),
    ({"algorithm.rollout_correction.rollout_token_veto_threshold": 2.0}, "algorithm.rollout_correction.rollout_token_veto_threshold must be in (0, 1)"),
    # LoRA: its own keys, then what it does not combine with yet (each names the key to change)
    ({"actor_rollout_ref.model.lora_rank": -1}, "actor_rollout_ref.model.lora_rank must be an integer >= 0 (0 = full fine-tuning), got -1"),
    ({"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.lora_alpha": 0.0}, "actor_rollout_ref.model.lora_alpha must be > 0"),
    ({"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.lora_dropout": 1.0}, "actor_rollout_ref.model.lora_dropout must be in [0, 1)"),
    ({"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.target_modules": ["q_proj", "qkv"]},
     "actor_rollout_ref.model.target_modules must be [all-linear] or a list of ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', "
     "'up_proj', 'down_proj'], got ['q_proj', 'qkv']"),
    ({"actor_rollout_ref.model.lora_rank": 600, "actor_rollout_ref.rollout.name": "vllm"},
     "actor_rollout_ref.model.lora_rank=600 is above vLLM's largest max_lora_rank (512)"),
    ({"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.rollout.tensor_model_parallel_size": 2, "actor_rollout_ref.model.lora_dropout": 0.1},
     "LoRA is not supported with dropout under tensor parallelism (TP ranks would draw different masks: set actor_rollout_ref.model.lora_dropout=0) yet"),
    ({"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.actor.freeze_modules": ["*embed*"]},
     "together with actor_rollout_ref.actor.freeze_modules (LoRA freezes the whole base already) yet"),
    ({"critic.model.lora_rank": 8, "algorithm.adv_estimator": "gae", "critic.tensor_model_parallel_size": 2, "critic.model.lora_dropout": 0.1},
     "critic.model.lora_rank=8: LoRA is not supported with dropout under tensor parallelism (TP ranks would draw different masks: "
     "set critic.model.lora_dropout=0) yet"),
])
def test_validator_rules(world, changes, expected):
    for k, v in changes.items():
        _set(world, k, v)
    assert expected in _problems(world)


def test_freeze_modules_name_parameters_of_the_model(world, tiny_model_dir):
    _set(world, "actor_rollout_ref.model.path", str(tiny_model_dir))
    _set(world, "actor_rollout_ref.actor.freeze_modules", ["*embed_tokens*"])
    validate_config(world)
    _set(world, "actor_rollout_ref.actor.freeze_modules", ["*embed*", "*wte*"])
    assert "freeze_modules: '*wte*' matches no parameter of the model (names look like 'model.embed_tokens.weight'" in _problems(world)
    _set(world, "actor_rollout_ref.actor.freeze_modules", ["*"])
    assert "freeze_modules freezes every parameter: nothing would train" in _problems(world)


def test_gen_tp_valid(world):
    world.actor_rollout_ref.rollout.tensor_model_parallel_size = 2  # 2 workers, 4 heads, 2 KV heads
    validate_config(world)


def test_gen_tp_must_divide_kv_heads(world):
    model = world.actor_rollout_ref.model.path
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"max_position_embeddings": 64, "num_attention_heads": 4, "num_key_value_heads": 1}, f)
    world.actor_rollout_ref.rollout.tensor_model_parallel_size = 2
    msg = _problems(world)
    assert ("actor_rollout_ref.rollout.tensor_model_parallel_size (2) must divide the model's num_key_value_heads (1)"
            in msg and "set it to one of [1]" in msg)
    assert "num_attention_heads" not in msg and "1 problem" in msg


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_missing_message_and_all_problems_collected(world):
    world.actor_rollout_ref.rollout.name = "vllm"
    world.trainer.device = "tpu"
    world.reward_model.enable = True
    msg = _problems(world)
    assert "vLLM is not installed" in msg and "scripts/bootstrap_vllm.sh" in msg and "hybridflow[vllm]" in msg
    assert "3 problems" in msg and "trainer.device" in msg and "reward_model.model.path" in msg


def test_sft_validation(tmp_path, world):
    model = world.actor_rollout_ref.model.path
    (tmp_path / "sft.parquet").write_text("")
    cfg = load_config(os.path.join(ROOT, "configs", "sft_tiny.yaml"),
                      [f"model.path={model}", f"train_files=[{tmp_path / 'sft.parquet'}]"], schema=SFTConfig)
    validate_sft_config(cfg)
    cfg.train_batch_size, cfg.max_length, cfg.val_files = 63, 100, ["/nonexistent/v.parquet"]
    cfg.model.path = str(tmp_path / "nomodel")
    with pytest.raises(ConfigError) as e:
        validate_sft_config(cfg)
    msg = str(e.value)
    assert "train_batch_size (63) must be divisible by n_workers" in msg
    assert "model.path" in msg and "hybridflow make-model" in msg
    assert "val_files: file '/nonexistent/v.parquet'" in msg
    cfg.train_batch_size, cfg.model.path, cfg.val_files, cfg.micro_batch_size_per_gpu = 32, model, [], 32  # set: 32 x 2 workers > 32
    with pytest.raises(ConfigError, match=r"(?s)micro_batch_size_per_gpu \* n_workers.*max_length \(100\) exceeds"):
        validate_sft_config(cfg)


# ---------------------------------------------------------------- resource pools
def _pools(world, *items):
    return load_config(None, list(items), schema=HybridFlowConfig).resource_pool


def test_pool_mapping_parses_and_sizes_roles(world):
    from hybridflow.config.pools import Role, role_pools, role_world_size

    world.algorithm.adv_estimator = "gae"
    world.critic.ppo_micro_batch_size_per_gpu = 16
    world.resource_pool = _pools(world, "resource_pool.pools.a.workers_per_node=2", "resource_pool.pools.c.workers_per_node=1",
                                 "resource_pool.pools.c.resources.H100=1", "resource_pool.mapping.actor_rollout=a", "resource_pool.mapping.critic=c")
    assert world.resource_pool.pools["c"].resources == {"H100": 1.0}
    validate_config(world)
    assert role_pools(world) == {Role.ACTOR_ROLLOUT: "a", Role.CRITIC: "c"}
    assert role_world_size(world, Role.CRITIC) == 1
    world.critic.ppo_micro_batch_size_per_gpu = 48  # 8 prompts x 8 samples on 1 critic worker: 64 per worker
    assert "per-worker mini-batch (64 sequences) must be divisible by critic.ppo_micro_batch_size_per_gpu (48)" in _problems(world)


@pytest.mark.parametrize("items, expected", [
    (["resource_pool.mapping.actor=global_pool"],
     "resource_pool.mapping: unknown role 'actor'; roles are ['actor_rollout', 'rollout', 'ref', 'critic', 'reward_model', 'teacher']"),
    (["resource_pool.mapping.critic=gpu"], "resource_pool.mapping.critic: unknown pool 'gpu'"),
    (["resource_pool.pools.a.workers_per_node=0", "resource_pool.mapping.actor_rollout=a"],
     "resource_pool.pools.a.workers_per_node must be a positive integer"),
    (["resource_pool.pools.a.resources.H100=0", "resource_pool.mapping.actor_rollout=a"], "resource_pool.pools.a.resources.H100 must be > 0"),
    (["trainer.async_rollout=true"], "trainer.async_rollout=true needs the rollout on a pool of its own"),
    (["trainer.async_rollout=true", "resource_pool.pools.a.workers_per_node=2", "resource_pool.pools.r.workers_per_node=1",
      "resource_pool.mapping.actor_rollout=a", "resource_pool.mapping.rollout=r", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     "tensor_model_parallel_size (2) must divide the number of actor workers (1"),
    (["algorithm.adv_estimator=gae", "resource_pool.pools.a.workers_per_node=2", "resource_pool.mapping.actor_rollout=a"],
     "resource_pool.mapping.critic is not set and 'global_pool' is not among the pools ['a']"),
    (["trainer.async_rollout=true", "algorithm.adv_estimator=gae", "resource_pool.pools.a.workers_per_node=2",
      "resource_pool.pools.r.workers_per_node=1", "resource_pool.mapping.actor_rollout=a", "resource_pool.mapping.rollout=r",
      "resource_pool.mapping.critic=r"], "the rollout pool 'r' must hold only the rollout role"),
    (["trainer.async_rollout=true", "algorithm.adv_estimator=remax", "resource_pool.pools.a.workers_per_node=2",
      "resource_pool.pools.r.workers_per_node=1", "resource_pool.mapping.actor_rollout=a", "resource_pool.mapping.rollout=r"],
     "does not combine with trainer.async_rollout=true"),
    (["trainer.async_rollout=true", "async_training.partial_rollout=true", "async_training.partial_rollout_chunk=4",
      "resource_pool.pools.a.workers_per_node=2", "resource_pool.pools.r.workers_per_node=1", "resource_pool.mapping.actor_rollout=a",
      "resource_pool.mapping.rollout=r"],
     "async_training.partial_rollout_chunk=4 >= data.max_response_length=4: no response would ever pause for a weight update; set it below (e.g. 1)"),
])
def test_pool_validation(world, items, expected):
    cfg = load_config(None, items, schema=HybridFlowConfig)
    world.resource_pool, world.trainer.async_rollout, world.async_training = cfg.resource_pool, cfg.trainer.async_rollout, cfg.async_training
    world.algorithm.adv_estimator = cfg.algorithm.adv_estimator
    world.critic.ppo_micro_batch_size_per_gpu = 8
    world.actor_rollout_ref.rollout.tensor_model_parallel_size = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    assert expected in _problems(world)


def test_missing_resources_names_pool_and_resource():
    from hybridflow.config.schema import PoolSpec
    from hybridflow.config.pools import bundle, missing_resources

    nodes = [{"Alive": True, "Resources": {"CPU": 2.0, "fake_h100": 4.0}}]
    spec = PoolSpec(workers_per_node=2, resources={"fake_h100": 1})
    assert missing_resources({"p": (spec, bundle(spec, 0.5, "cpu"))}, nodes) == []
    gpu = PoolSpec(workers_per_node=2, resources={"H100": 1})
    (msg,) = missing_resources({"gpu_pool": (gpu, bundle(gpu, 0.5, "cpu"))}, nodes)
    assert "resource_pool.pools.gpu_pool" in msg and "['H100']" in msg
    two_nodes = PoolSpec(workers_per_node=1, nnodes=2)
    assert "on each of 2 node(s)" in missing_resources({"wide": (two_nodes, bundle(two_nodes, 0.5, "cpu"))}, nodes)[0]
    many = {f"p{i}": (spec, bundle(spec, 0.5, "cpu")) for i in range(3)}  # 6 x 0.5 CPU > 2
    assert any("all pools together need 3 CPU" in m for m in missing_resources(many, nodes))


def test_cross_pool_pieces_cover_each_generation_slice_exactly():
    from hybridflow.hybrid_engine.cross_pool import need_box
    from hybridflow.hybrid_engine.plan import intersect, shard_box, volume

    # 2 training ranks -> a 2-rank rollout pool with gen_tp 2: column-parallel q [64, 32] (dim 0),
    # row-parallel o [32, 64] (dim 1), a replicated norm [32]; FSDP2 shards along the TP dim.
    for shape, train_dim, gen_dim in [((64, 32), 0, 0), ((32, 64), 1, 1), ((32,), 0, None)]:
        own = [shard_box(shape, train_dim, 2, s) for s in range(2)]
        for d in range(2):
            need = need_box(shape, gen_dim, 2, 2, d)
            pieces = [intersect(o, need) for o in own]
            assert sum(volume(p) for p in pieces) == volume(need)  # exactly its slice, nothing twice
            if gen_dim is not None:
                assert [bool(p) for p in pieces] == [d == 0, d == 1]  # aligned: one source each


def test_3d_training_layout_is_checked_before_workers_start(world):
    """pp x tp x dp vs the workers, heads / KV heads vs tp, layers vs pp, gen_tp vs the layout."""
    model = world.actor_rollout_ref.model.path
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"max_position_embeddings": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}, f)
    a = world.actor_rollout_ref
    world.trainer.n_gpus_per_node, world.data.train_batch_size = 4, 8
    a.actor.ppo_mini_batch_size, a.actor.ppo_micro_batch_size_per_gpu = 8, 2
    for tp, pp, gen_tp in [(2, 1, 2), (1, 2, 2), (2, 2, 2), (2, 1, 1)]:
        a.actor.tensor_model_parallel_size, a.actor.pipeline_model_parallel_size, a.rollout.tensor_model_parallel_size = tp, pp, gen_tp
        validate_config(world)
    a.actor.tensor_model_parallel_size, a.actor.pipeline_model_parallel_size, a.rollout.tensor_model_parallel_size = 3, 1, 1
    assert ("pp x tp x dp must equal the actor's 4 workers (trainer.nnodes * trainer.n_gpus_per_node): "
            "actor_rollout_ref.actor.pipeline_model_parallel_size (1) x actor_rollout_ref.actor.tensor_model_parallel_size (3) = 3 "
            "does not divide 4") in _problems(world)
    a.actor.tensor_model_parallel_size = 4
    assert "actor_rollout_ref.actor.tensor_model_parallel_size (4) must divide the model's num_key_value_heads (2)" in _problems(world)
    a.actor.tensor_model_parallel_size, a.actor.pipeline_model_parallel_size = 1, 4
    assert ("actor_rollout_ref.actor.pipeline_model_parallel_size (4) must divide the model's num_hidden_layers (2): "
            "stages hold equal blocks of decoder layers; set it to one of [1, 2]") in _problems(world)
    # 6 workers as pp2 x dp3: a generation TP of 2 would split a training shard across two generation ranks
    world.trainer.n_gpus_per_node, world.data.train_batch_size, a.actor.ppo_mini_batch_size = 6, 6, 6
    a.actor.pipeline_model_parallel_size, a.rollout.tensor_model_parallel_size = 2, 2
    msg = _problems(world)
    assert ("actor_rollout_ref.rollout.tensor_model_parallel_size (2) does not fit the training layout pp2 x tp1 x dp3: it must divide "
            "tp x dp = 3 or be 3 times a divisor of pp") in msg and "set it to one of [1, 3, 6]" in msg
    world.trainer.n_gpus_per_node, world.data.train_batch_size, a.actor.ppo_mini_batch_size = 4, 8, 8
    a.rollout.tensor_model_parallel_size = 1
    validate_config(world)
    a.actor.use_dynamic_bsz = True
    assert "not supported with dynamic batch sizes" in _problems(world)
    a.actor.use_dynamic_bsz, a.actor.pipeline_model_parallel_size = False, 1
    world.algorithm.adv_estimator, world.critic.tensor_model_parallel_size = "gae", 3
    assert "critic.tensor_model_parallel_size (3) must divide the critic's 4 workers; set it to one of [1, 2, 4]" in _problems(world)
    world.critic.tensor_model_parallel_size = 4
    assert "critic.tensor_model_parallel_size (4) must divide the critic model's num_key_value_heads (2)" in _problems(world)
    world.critic.tensor_model_parallel_size = 2
    validate_config(world)


_AT, _AP, _RT = ("actor_rollout_ref.actor.tensor_model_parallel_size", "actor_rollout_ref.actor.pipeline_model_parallel_size",
                  "actor_rollout_ref.rollout.tensor_model_parallel_size")
_PP2 = {_AT: 1, _AP: 2, _RT: 1}  # pp2 x dp2 on the 4 workers: valid on its own (2 layers, untied)
_UNSUPPORTED = f"{_AT}=2, {_AP}=1: not supported with "
_UNSUPPORTED_PP = f"{_AT}=1, {_AP}=2: not supported with "


# One row per refusal rule of the 3D layout (hybridflow/parallel/dims.py's registered checks and
# config/validate.py's _train_layout_problems / _critic_tp_problems), on top of a valid base: 4 workers,
# actor tp2 x dp2, generation TP 2, a model with 4 heads, 2 KV heads, 2 layers, untied. Each row:
# config overrides, config.json changes, the validator's kind, the message (which names the key).
@pytest.mark.parametrize("changes, model, kind, expected", [
    # _train_layout_problems: the sizes themselves
    ({_AT: 0}, {}, "rl", f"{_AT} must be a positive integer, got 0"),
    ({_AP: 0}, {}, "rl", f"{_AP} must be a positive integer, got 0"),
    # actor_layout: pp x tp x dp = the workers
    ({_AT: 3, _RT: 1}, {}, "rl", f"pp x tp x dp must equal the actor's 4 workers (trainer.nnodes * trainer.n_gpus_per_node): "
                                 f"{_AP} (1) x {_AT} (3) = 3 does not divide 4"),
    # actor_layout: tp divides the heads and the KV heads
    ({_AT: 4, _RT: 1}, {"num_attention_heads": 6}, "rl", f"{_AT} (4) must divide the model's num_attention_heads (6)"),
    ({_AT: 4, _RT: 1}, {}, "rl", f"{_AT} (4) must divide the model's num_key_value_heads (2)"),
    # actor_layout: layers split evenly over pp
    ({_AT: 1, _AP: 4, _RT: 1}, {}, "rl", f"{_AP} (4) must divide the model's num_hidden_layers (2)"),
    # actor_layout: pp > 1 with tied embeddings
    (_PP2, {"tie_word_embeddings": True}, "rl", f"{_AP} (2) > 1 needs untied embeddings"),
    # actor_layout: the generation TP fits the training layout (6 workers as pp2 x dp3)
    ({_AT: 1, _AP: 2, _RT: 2, "trainer.n_gpus_per_node": 6, "data.train_batch_size": 6, "actor_rollout_ref.actor.ppo_mini_batch_size": 6},
     {}, "rl", f"{_RT} (2) does not fit the training layout pp2 x tp1 x dp3"),
    # _train_layout_problems: NO_SHARD (actor or reference)
    ({"actor_rollout_ref.actor.fsdp_config.sharding_strategy": "NO_SHARD"}, {}, "rl",
     f"fsdp_config.sharding_strategy=NO_SHARD is not supported with {_AT} or {_AP} > 1"),
    ({"actor_rollout_ref.ref.fsdp_config.sharding_strategy": "NO_SHARD"}, {}, "rl",
     f"fsdp_config.sharding_strategy=NO_SHARD is not supported with {_AT} or {_AP} > 1"),
    # _train_layout_problems: features a 3D layout does not support (any tp or pp > 1)
    ({"actor_rollout_ref.rollout.name": "vllm"}, {}, "rl", _UNSUPPORTED + "actor_rollout_ref.rollout.name=vllm"),
    ({"trainer.async_rollout": True, "resource_pool": ["resource_pool.pools.a.workers_per_node=4", "resource_pool.pools.r.workers_per_node=2",
                                                       "resource_pool.mapping.actor_rollout=a", "resource_pool.mapping.rollout=r"]},
     {}, "rl", _UNSUPPORTED + "trainer.async_rollout"),
    ({}, {}, "dpo", _UNSUPPORTED + "DPO"),
    # ... and those pipeline stages do not support
    ({**_PP2, "trainer.save_hf_model": True}, {}, "rl", _UNSUPPORTED_PP + "trainer.save_hf_model"),
    ({**_PP2, "actor_rollout_ref.actor.use_dynamic_bsz": True}, {}, "rl", _UNSUPPORTED_PP + "dynamic batch sizes"),
    ({**_PP2, "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": True}, {}, "rl", _UNSUPPORTED_PP + "dynamic batch sizes"),
    ({**_PP2, "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": True}, {}, "rl", _UNSUPPORTED_PP + "dynamic batch sizes"),
    ({**_PP2, "actor_rollout_ref.model.use_remove_padding": True}, {}, "rl", _UNSUPPORTED_PP + "actor_rollout_ref.model.use_remove_padding"),
    # gen_tp: an integer >= 1, divides the workers, the heads and the KV heads
    ({_AT: 1, _RT: 0}, {}, "rl", f"{_RT} must be an integer >= 1, got 0"),
    ({_AT: 1, _RT: 3}, {}, "rl", f"{_RT} (3) must divide the number of actor workers (4 = trainer.nnodes * trainer.n_gpus_per_node)"),
    ({_RT: 4}, {"num_attention_heads": 6}, "rl", f"{_RT} (4) must divide the model's num_attention_heads (6)"),
    ({_RT: 4}, {}, "rl", f"{_RT} (4) must divide the model's num_key_value_heads (2)"),
    # critic_layout (gae): a positive tp that divides the critic's workers, its heads and KV heads
    ({"algorithm.adv_estimator": "gae", "critic.tensor_model_parallel_size": 0}, {}, "rl",
     "critic.tensor_model_parallel_size must be a positive integer, got 0"),
    ({"algorithm.adv_estimator": "gae", "critic.tensor_model_parallel_size": 3}, {}, "rl",
     "critic.tensor_model_parallel_size (3) must divide the critic's 4 workers"),
    ({"algorithm.adv_estimator": "gae", "critic.tensor_model_parallel_size": 4}, {"num_attention_heads": 6}, "rl",
     "critic.tensor_model_parallel_size (4) must divide the critic model's num_attention_heads (6)"),
    ({"algorithm.adv_estimator": "gae", "critic.tensor_model_parallel_size": 4}, {}, "rl",
     "critic.tensor_model_parallel_size (4) must divide the critic model's num_key_value_heads (2)"),
])
def test_every_3d_layout_rule_refuses_naming_its_key(world, changes, model, kind, expected):
    path = world.actor_rollout_ref.model.path
    spec = {"max_position_embeddings": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(spec, f)
    base = {"trainer.n_gpus_per_node": 4, "data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2, "critic.ppo_micro_batch_size_per_gpu": 2, _AT: 2, _AP: 1, _RT: 2}
    for k, v in base.items():
        _set(world, k, v)
    validate_config(world)  # the base is valid: the row's change alone is refused
    for k, v in changes.items():
        if k == "resource_pool":  # pools and mapping, as dotlist items
            world.resource_pool = load_config(None, v, schema=HybridFlowConfig).resource_pool
        else:
            _set(world, k, v)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**spec, **model}, f)
    with pytest.raises(ConfigError) as e:
        validate_config(world, kind=kind)
    assert expected in str(e.value), str(e.value)


# ---------------------------------------------------------------- one config route
def test_measure_baseline_is_off_by_default():
    """The naive full gather (every full parameter at once) is not budgeted by the memory pre-flight:
    a run measures it only when asked."""
    assert HybridFlowConfig().actor_rollout_ref.hybrid_engine.measure_baseline is False
    assert load_config(None, ["actor_rollout_ref.hybrid_engine.measure_baseline=true"]).actor_rollout_ref.hybrid_engine.measure_baseline


def test_a_reward_model_checkpoint_as_the_policy_is_refused(world, tmp_path, tiny_model_dir):
    """A sequence classifier at actor_rollout_ref.model.path would train with a fresh LM head: refused
    before Ray starts, naming the key, the path and the architecture found."""
    from hybridflow.models.tiny import make_tiny_model

    rm = str(make_tiny_model(tmp_path / "rm", reward=True, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=64, max_position_embeddings=64))
    _set(world, "actor_rollout_ref.model.path", rm)
    msg = _problems(world)
    assert (f"actor_rollout_ref.model.path: {rm!r} is a Qwen2ForSequenceClassification checkpoint, not a causal LM; the policy "
            f"needs a causal-LM checkpoint (architectures ...ForCausalLM) to generate and train; a reward model belongs in "
            f"reward_model.model.path") in msg
    assert "1 problem" in msg
    _set(world, "actor_rollout_ref.model.path", str(tiny_model_dir))  # Qwen2ForCausalLM
    validate_config(world)
    # a critic may start from either: a reward model's backbone is a fine value-model start
    world.algorithm.adv_estimator, world.critic.model.path = "gae", rm
    validate_config(world)


_DEFAULT_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                       "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error", "RAY_USAGE_STATS_ENABLED": "0"}


def _worker_envs(monkeypatch, **group_kwargs) -> list[dict]:
    """The env_vars RayWorkerGroup gives each worker's runtime_env, with Ray replaced by a recorder
    (no cluster: the group's constructor only needs ray.remote/options and the rendezvous calls)."""
    from types import SimpleNamespace

    import hybridflow.controller.worker_group as wg
    from hybridflow.controller.worker import Worker

    envs = []

    class Handle:  # a fake actor handle: every method's .remote() returns its result directly
        def __init__(self):
            self._actor_id = SimpleNamespace(hex=lambda: f"{id(self):x}")  # what the group keys its probes by

        def __getattr__(self, name):
            results = {"_group_node_ip": "127.0.0.1", "_group_master_endpoint": ("127.0.0.1", 12345)}
            return SimpleNamespace(remote=lambda *a, **k: results.get(name))

    def options(**opts):
        envs.append(opts["runtime_env"]["env_vars"])
        return SimpleNamespace(remote=lambda **init_kwargs: Handle())

    # ray.remote(concurrency_groups=...)(cls): the worker group starts actors with the probes' and the class's groups
    monkeypatch.setattr(wg, "ray", SimpleNamespace(remote=lambda **groups: lambda cls: SimpleNamespace(options=options), get=lambda x: x))
    monkeypatch.setattr(wg, "PlacementGroupSchedulingStrategy", lambda pg, **kw: None)
    pool = SimpleNamespace(world_size=2, procs_per_node=2, bundle={"CPU": 0.5}, name="p", slots=lambda: [(None, 0, 0), (None, 1, 1)])
    wg.RayWorkerGroup(pool, Worker, name="env_test", **group_kwargs)
    return envs


def test_worker_env_is_a_config_key_that_reaches_every_worker(monkeypatch):
    from hybridflow.config.schema import TrainerConfig

    assert TrainerConfig().worker_env == _DEFAULT_WORKER_ENV  # the default
    assert SFTConfig().trainer.worker_env == RewardTrainConfig().trainer.worker_env == _DEFAULT_WORKER_ENV
    for rank, env in enumerate(_worker_envs(monkeypatch)):  # not given: the default
        assert {k: env[k] for k in _DEFAULT_WORKER_ENV} == _DEFAULT_WORKER_ENV
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(rank), "2", str(rank))  # per-worker variables stay
    cfg = load_config(None, ['trainer.worker_env={OMP_NUM_THREADS: "4", MY_FLAG: "x"}'])
    assert cfg.trainer.worker_env == {"OMP_NUM_THREADS": "4", "MY_FLAG": "x"}  # the whole mapping
    for rank, env in enumerate(_worker_envs(monkeypatch, worker_env=cfg.trainer.worker_env)):
        assert {k: env[k] for k in ("OMP_NUM_THREADS", "MY_FLAG", "RANK")} == {"OMP_NUM_THREADS": "4", "MY_FLAG": "x", "RANK": str(rank)}
        assert "HF_HUB_OFFLINE" not in env  # replaced, not merged


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "3"}, "trainer.worker_env.RANK: set per worker by the worker group"),
    ({"OMP_NUM_THREADS": 4},
     "trainer.worker_env: 'OMP_NUM_THREADS': 4 is not an environment variable; names are non-empty strings without '=', values are strings"),
    ({"A=B": "1"}, "trainer.worker_env: 'A=B': '1' is not an environment variable"),
])
def test_worker_env_is_validated(world, env, expected):
    world.trainer.worker_env = env
    assert expected in _problems(world)
    with pytest.raises(ConfigError, match=r"trainer\.worker_env\.OMP_NUM_THREADS must be str, got 4 \(int\)"):
        load_config(None, ["trainer.worker_env.OMP_NUM_THREADS=4"])


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory):
    """What `hybridflow make-data runs/data` and `hybridflow make-model runs/tiny_model` (and the SFT
    model the README trains) create, under a directory the shipped configs' relative paths resolve in."""
    import shutil

    from hybridflow.data.tasks import make_max_task
    from hybridflow.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("readme")
    make_max_task(root / "runs" / "data")
    make_tiny_model(root / "runs" / "tiny_model")
    shutil.copytree(root / "runs" / "tiny_model", root / "runs" / "sft_model")
    return root


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_shipped_configs_validate_at_1_2_and_4_workers(workers, readme_runs, monkeypatch):
    """Every shipped config, as written, with only the worker count added (the user's one key), passes
    validation at 1, 2 and 4 data-parallel workers; each parallel config over each RL config with its
    own worker count. A batch size a file does not set is derived from the layout, never refused."""
    from hybridflow.config import validate_rm_config
    from hybridflow.config.parallel import apply_parallel_config, load_parallel_config

    monkeypatch.chdir(readme_runs)
    configs = os.path.join(ROOT, "configs")
    names = sorted(os.path.basename(f) for f in glob.glob(os.path.join(configs, "*.yaml")))
    run_configs = [n for n in names if not n.startswith("parallel_")]
    assert run_configs == ["dapo_tiny.yaml", "dpo_tiny.yaml", "grpo_tiny.yaml", "ppo_tiny.yaml", "rm_tiny.yaml", "sft_tiny.yaml"]
    count = [f"trainer.n_gpus_per_node={workers}"]
    for name in ("dapo_tiny.yaml", "grpo_tiny.yaml", "ppo_tiny.yaml"):
        validate_config(load_config(os.path.join(configs, name), count))
    validate_config(load_config(os.path.join(configs, "dpo_tiny.yaml"), count), "dpo")
    validate_sft_config(load_config(os.path.join(configs, "sft_tiny.yaml"), count, schema=SFTConfig))
    validate_rm_config(load_config(os.path.join(configs, "rm_tiny.yaml"), count, schema=RewardTrainConfig))
    parallel = [n for n in names if n.startswith("parallel_")]
    assert len(parallel) >= 4
    for name in parallel:
        p = load_parallel_config(os.path.join(configs, name))
        world = (p.pipeline_parallel_size or 1) * (p.model_parallel_size or 1) * p.data_parallel_size
        assert world in (1, 2, 4), name  # so one of the parametrizations checks it
        if world != workers:
            continue  # a parallel config runs at its own worker count
        for base in ("dapo_tiny.yaml", "grpo_tiny.yaml", "ppo_tiny.yaml"):
            validate_config(apply_parallel_config(load_config(os.path.join(configs, base), [f"trainer.n_gpus_per_node={world}"]), p))


def test_bf16_mixed_precision_generates_in_bf16(tiny_model_dir):
    """One key sets the precision: bf16 mixed precision on the actor makes the rollout's weights bf16
    too (the pre-flight memory plan counts 2 bytes per generation weight), model.dtype otherwise."""
    from hybridflow.planning.preflight import pool_memory

    base = [f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_files=[x]"]
    fp32, bf16 = load_config(None, base), load_config(None, [*base, "actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16"])
    assert fp32.actor_rollout_ref.generation_dtype() == "float32"
    assert bf16.actor_rollout_ref.generation_dtype() == "bfloat16"
    assert load_config(None, [*base, "actor_rollout_ref.model.dtype=bfloat16"]).actor_rollout_ref.generation_dtype() == "bfloat16"
    gen = [next(iter(pool_memory(c).values()))["parts"]["actor_rollout"]["gen_weights"] for c in (fp32, bf16)]
    assert gen[1] * 2 == gen[0] > 0


class EchoRollout:
    """A user's trivial rollout backend (registered below, from tests/): the response repeats the prompt."""

    tp_index, dp_index, gen_tp = 0, 0, 1

    def __init__(self, ctx):
        self.ctx = ctx

    def layout(self):
        from hybridflow.protocol import GenLayout

        return GenLayout(1, consecutive=False, shard_dims={})

    def update_weights(self, pieces):
        return {"pieces": sum(1 for _ in pieces)}

    def generate_requests(self, requests):
        from hybridflow.protocol import Completion

        return [Completion(tuple(r.prompt_ids[: r.params.max_new_tokens]), tuple(0.0 for _ in r.prompt_ids[: r.params.max_new_tokens]), "length")
                for r in requests]

    def generate(self, prompts, params):
        raise NotImplementedError

    def sleep(self):
        pass

    def wake(self):
        pass


def _echo_check(spec) -> list[str]:
    top_k = spec.rollout.top_k  # the RolloutSpec: the backend sees its own slice of the config
    return [] if top_k <= 0 else [f"echo: actor_rollout_ref.rollout.top_k is not supported, got {top_k}"]


def build_echo(ctx):
    return EchoRollout(ctx)


def test_a_users_rollout_backend_is_validated_and_built_by_name(world):
    """A backend registered from the user's module (here, tests/) passes validation by its name, its
    own check runs, the registry builds it by name, and an import path works without registering."""
    from hybridflow.protocol import Request, SamplingParams
    from hybridflow.rollout.base import ROLLOUT_BACKENDS, RolloutContext, make_rollout, register_rollout
    from hybridflow.run_plan import resolve

    register_rollout("echo", check=_echo_check)(build_echo)
    try:
        world.actor_rollout_ref.rollout.name = "echo"
        world.actor_rollout_ref.rollout.top_k = 5
        assert "echo: actor_rollout_ref.rollout.top_k is not supported, got 5" in _problems(world)  # the backend's own check ran
        world.actor_rollout_ref.rollout.top_k = -1
        validate_config(world)
        backend = make_rollout("echo", RolloutContext(resolve(world).rollout, None, "cpu", 0, 1))
        out = backend.generate_requests([Request((5, 6, 7), SamplingParams(max_new_tokens=2))])
        assert isinstance(backend, EchoRollout) and out[0].token_ids == (5, 6)
        world.actor_rollout_ref.rollout.name = f"{__name__}:build_echo"  # by import path: no registration needed
        validate_config(world)
        assert isinstance(make_rollout(world.actor_rollout_ref.rollout.name, RolloutContext(resolve(world).rollout, None, "cpu", 0, 1)), EchoRollout)
        world.actor_rollout_ref.rollout.name = f"{__name__}:no_such_builder"
        assert "cannot import" in _problems(world)
    finally:
        ROLLOUT_BACKENDS.pop("echo", None)
