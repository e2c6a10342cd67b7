"""verl's PPO-trainer keys that hybridflow's schema does not have, so that a verl config or command
line either works here or is refused with the reason -- never silently ignored.

Each key of verl's default `ppo_trainer.yaml` that is not a hybridflow key is one of:
- an alias: the same setting under hybridflow's name (`trainer.max_actor_ckpt_to_keep` ->
  `trainer.max_ckpt_to_keep`, `*.optim.warmup_style` -> `*.optim.lr_scheduler_type`, ...);
- a behaviour key: hybridflow always behaves one way; the values that mean that way are accepted
  (logged once as "accepted"), any other value is a ConfigError saying why and what to use;
- a speed/engine knob whose value cannot change results here: accepted, logged as having no effect.
Keys in neither table go on to the loader, which names the closest valid key.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any

from hybridflow.config.tree import ConfigError, dotted_tree, merge

logger = logging.getLogger("hybridflow.config")

ANY = object()  # every value is accepted (results do not depend on it here)
_NOT_IMPL = "not implemented in hybridflow yet"

# verl key (fnmatch pattern) -> hybridflow key ("{0}" = the pattern's leading part, e.g. the role).
ALIASES = {
    "data.tokenizer": "actor_rollout_ref.model.tokenizer_path",
    "actor_rollout_ref.actor.optim.warmup_style": "actor_rollout_ref.actor.optim.lr_scheduler_type",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler_type",
    "critic.model.fsdp_config.param_offload": "critic.fsdp_config.param_offload",
    "critic.model.fsdp_config.reshard_after_forward": "critic.fsdp_config.reshard_after_forward",
    "reward_model.model.fsdp_config.param_offload": "reward_model.fsdp_config.param_offload",
    "reward_model.model.fsdp_config.reshard_after_forward": "reward_model.fsdp_config.reshard_after_forward",
    "reward_model.micro_batch_size_per_gpu": "reward_model.micro_batch_size_per_gpu",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep": "trainer.max_ckpt_to_keep",
}

# verl key pattern -> (accepted values or ANY, why / what to use instead)
BEHAVIOUR: dict[str, tuple[Any, str]] = {
    "data.reward_fn_key": (("data_source",), "rewards dispatch on the data_source column"),
    "data.return_raw_input_ids": (ANY, "raw prompts are always kept; the reward model re-tokenizes them"),
    "data.return_raw_chat": (ANY, "raw prompts are always kept (raw_prompt)"),
    "data.filter_overlong_prompts_workers": (ANY, "filtering runs once at start-up; the worker count only changes its speed"),
    "data.image_key": (("images",), f"multimodal rows are {_NOT_IMPL}"),
    "data.video_key": (("videos",), f"multimodal rows are {_NOT_IMPL}"),
    "data.custom_cls.path": ((None,), f"custom dataset classes are {_NOT_IMPL}; write parquet rows in verl's schema"),
    "data.custom_cls.name": ((None,), f"custom dataset classes are {_NOT_IMPL}"),
    "actor_rollout_ref.hybrid_engine": ((True,), "the actor and its rollout always share the hybrid engine; for a separate "
                                                 "generation pool use resource_pool.mapping.rollout with trainer.async_rollout=true"),
    "*.external_lib": ((None,), "import your model's module before hybridflow loads the model"),
    "*.override_config": (({},), f"model config overrides are {_NOT_IMPL}; edit the checkpoint's config.json"),
    "*.use_remove_padding": (ANY,
                             "padding removal is actor_rollout_ref.model.use_remove_padding / critic.model.use_remove_padding; accepted with no effect here"),
    "actor_rollout_ref.model.use_liger": ((False,), f"Liger kernels are {_NOT_IMPL}"),
    "actor_rollout_ref.model.return_last_hidden_state": ((False,), _NOT_IMPL),
    "actor_rollout_ref.model.use_fused_loss": ((False,), f"fused losses are {_NOT_IMPL}"),
    "actor_rollout_ref.actor.strategy": (("fsdp", "fsdp2"), "the actor trains with FSDP2"),
    "*.strategy": (("fsdp", "fsdp2"), "training is FSDP2"),
    "*.ppo_micro_batch_size": ((None,), "deprecated in verl; set ppo_micro_batch_size_per_gpu"),
    "*.log_prob_micro_batch_size": ((None,), "deprecated in verl; set log_prob_micro_batch_size_per_gpu"),
    "*.forward_micro_batch_size": (ANY, "the critic's forward uses critic.ppo_micro_batch_size_per_gpu"),
    "*.forward_micro_batch_size_per_gpu": (ANY, "the critic's forward uses critic.ppo_micro_batch_size_per_gpu"),
    "*.micro_batch_size": ((None,), "deprecated in verl; set reward_model.micro_batch_size_per_gpu"),
    "*.use_dynamic_bsz": ((False,), "token-budget micro-batches are actor_rollout_ref.actor.use_dynamic_bsz and the rollout's and "
                                    "reference's log_prob_use_dynamic_bsz; here set the *_micro_batch_size_per_gpu keys"),
    "*max_token_len_per_gpu": (ANY, "only the actor's, the rollout's and the reference's token budgets are read"),
    "*.use_torch_compile": (ANY, "torch.compile is not applied (a speed switch: the same results); accepted with no effect"),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": (ANY, "the colocated reference scores in the actor's layout "
                                                                  "(actor_rollout_ref.actor.ulysses_sequence_parallel_size)"),
    "*.ulysses_sequence_parallel_size": ((1,), f"sequence parallelism (Ulysses) for the critic and reward model is {_NOT_IMPL}; the "
                                               "actor's is actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    "*.checkpoint.contents": (ANY, "model, optimizer and extra state are always saved; set trainer.save_hf_model=true for an HF copy"),
    "*.optim.min_lr_ratio": ((None,), "set a number to use it (hybridflow's default is 0.0)"),
    "*.fsdp_config.wrap_policy.min_num_params": ((0,), "every decoder layer is its own FSDP unit"),
    "*.fsdp_config.optimizer_offload": ((False,), f"optimizer offload is {_NOT_IMPL}; use fsdp_config.param_offload"),
    "*.fsdp_config.offload_policy": ((False,), f"{_NOT_IMPL}; use fsdp_config.param_offload"),
    "*.fsdp_config.fsdp_size": ((-1,), f"HSDP (fsdp_size) is {_NOT_IMPL}; FSDP spans the role's pool"),
    "actor_rollout_ref.rollout.mode": (("sync",), "the async engine mode is not implemented; trainer.async_rollout=true is the off-policy alternative"),
    "actor_rollout_ref.rollout.chat_scheduler": ((None,), f"chat schedulers are {_NOT_IMPL}"),
    "actor_rollout_ref.rollout.use_fire_sampling": ((False,), f"FIRE sampling is {_NOT_IMPL}"),
    "actor_rollout_ref.rollout.prompt_length": (ANY, "generation uses data.max_prompt_length"),
    "actor_rollout_ref.rollout.response_length": (ANY, "generation uses data.max_response_length"),
    "actor_rollout_ref.rollout.dtype": (ANY, "generation runs in actor_rollout_ref.model.dtype"),
    "actor_rollout_ref.rollout.ignore_eos": ((False,), f"ignore_eos is {_NOT_IMPL}"),
    "actor_rollout_ref.rollout.enforce_eager": (ANY, "a vLLM speed switch; hybridflow runs vLLM eagerly"),
    "actor_rollout_ref.rollout.free_cache_engine": (ANY, "generation memory is always released after each rollout"),
    "actor_rollout_ref.rollout.load_format": (ANY, "rollout weights always come from the hybrid engine"),
    "actor_rollout_ref.rollout.max_num_batched_tokens": (ANY, "a vLLM scheduling knob; hybridflow's vLLM engine sizes itself"),
    "actor_rollout_ref.rollout.max_model_len": (ANY, "the length is data.max_prompt_length + data.max_response_length"),
    "actor_rollout_ref.rollout.max_num_seqs": (ANY, "a vLLM scheduling knob; hybridflow's vLLM engine sizes itself"),
    "actor_rollout_ref.rollout.disable_log_stats": (ANY, "vLLM statistics are not logged"),
    "actor_rollout_ref.rollout.enable_chunked_prefill": (ANY, "a vLLM speed switch"),
    "actor_rollout_ref.rollout.engine_kwargs.*": ((None,), f"extra engine arguments are {_NOT_IMPL}"),
    "actor_rollout_ref.rollout.multi_turn.max_turns": ((None,), "use actor_rollout_ref.rollout.multi_turn.max_assistant_turns"),
    "critic.rollout_n": (ANY, "the critic reads actor_rollout_ref.rollout.n"),
    "critic.shuffle": ((False,), f"mini-batch shuffling is {_NOT_IMPL}"),
    "actor_rollout_ref.actor.shuffle": ((False,), f"mini-batch shuffling is {_NOT_IMPL}"),
    "reward_model.reward_manager": (("naive",), "rule rewards are scored one response at a time (verl's naive manager) by "
                                                "custom_reward_function or the data_source dispatcher"),
    "reward_model.model.input_tokenizer": (ANY, "responses are always decoded with the policy's tokenizer and re-tokenized with the reward model's"),
    "reward_model.max_length": ((None,), f"truncating reward-model inputs is {_NOT_IMPL}"),
    "reward_model.launch_reward_fn_async": ((False,), f"{_NOT_IMPL}; the reward stage already overlaps with old log-probs in the DataFlow"),
    "trainer.balance_batch": (ANY, "rows are split evenly by count (no token balancing: a speed switch, the same results)"),
    "trainer.log_val_generations": ((0,), f"logging validation generations is {_NOT_IMPL}"),
    "trainer.rollout_data_dir": ((None,), f"dumping rollouts is {_NOT_IMPL}"),
    "trainer.validation_data_dir": ((None,), f"dumping validation generations is {_NOT_IMPL}"),
    "trainer.critic_warmup": ((0,), f"critic warm-up steps are {_NOT_IMPL}: the actor updates from step 1"),
    "trainer.default_hdfs_dir": ((None,), "HDFS checkpoints are not supported; use trainer.default_local_dir"),
    "trainer.del_local_ckpt_after_load": ((False,), _NOT_IMPL),
    "trainer.ray_wait_register_center_timeout": (ANY, "worker start-up is bounded by the pool's placement timeout"),
    "*.use_shm": (ANY, "loading through shared memory is a speed switch"),
    "data.return_full_prompt": (ANY, "the full prompt is always kept (raw_prompt)"),
    "*.trust_remote_code": ((False,), "remote model code is not executed: the model must be one transformers ships"),
    "*.enable_activation_offload": ((False,), f"activation offload is {_NOT_IMPL}; use enable_gradient_checkpointing"),
    "*.lora_adapter_path": ((None,), f"starting from a saved PEFT adapter is {_NOT_IMPL}: adapters start at B = 0"),
    "*.exclude_modules": ((None, []), f"excluding modules from target_modules is {_NOT_IMPL}: list the targets instead"),
    "*.fused_kernel_options.impl_backend": (ANY, "the chunked log-prob pass (model.use_fused_kernels) is torch code on every device"),
    "*.optim.num_cycles": ((0.5,), "the cosine schedule is half a cycle"),
    "actor_rollout_ref.rollout.layered_summon": (ANY, "the hybrid engine always moves weights layer by layer (hybrid_engine.granularity)"),
    "reward_model.sandbox_fusion.url": ((None,), f"sandboxed code execution rewards are {_NOT_IMPL}; use custom_reward_function"),
    "reward_model.sandbox_fusion.max_concurrent": (ANY, "only read with sandbox_fusion.url"),
    "algorithm.use_pf_ppo": ((False,), f"PF-PPO reweighting is {_NOT_IMPL}"),
    "algorithm.pf_ppo.*": (ANY, "only read with algorithm.use_pf_ppo=true"),
    "ray_init.timeline_json_file": ((None,), "use hybridflow's profiler trace (hybrid_engine timeline)"),
}


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _schema_has(cls, parts: list[str], value: Any = None) -> bool:
    """Whether dotted `parts` name a field (or a key under a dict field) of dataclass `cls` that can
    take `value` (a section takes a mapping: verl's `actor_rollout_ref.hybrid_engine: True` is not ours)."""
    import dataclasses
    import typing

    node: Any = cls
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return typing.get_origin(node) is dict  # free-form keys under a dict field
        hints = typing.get_type_hints(node)
        if part not in hints:
            return False
        node = hints[part]
        args = [a for a in typing.get_args(node) if a is not type(None)]
        if typing.get_origin(node) is typing.Union and len(args) == 1:
            node = args[0]
    return not (dataclasses.is_dataclass(node) and not isinstance(value, dict))


def _match(key: str, table: dict) -> str | None:
    return next((pattern for pattern in table if fnmatch.fnmatchcase(key, pattern)), None)


def translate_verl_keys(tree: dict, schema) -> dict:
    """Map verl-only keys of a raw config tree onto hybridflow's, or raise one ConfigError listing
    every refused key with its reason."""
    flat = _flatten(tree)
    kept: dict[str, Any] = {}
    refused, accepted = [], []
    for key, value in flat.items():
        if _schema_has(schema, key.split("."), value):
            kept[key] = value
        elif key in ALIASES:
            if value is not None:
                kept.setdefault(ALIASES[key], value)
                accepted.append(f"{key} -> {ALIASES[key]}")
        elif (pattern := _match(key, BEHAVIOUR)) is not None:
            allowed, why = BEHAVIOUR[pattern]
            if allowed is ANY or value in allowed:
                accepted.append(f"{key}={value!r} ({why})")
            else:
                refused.append(f"{key}={value!r}: {why}" + ("" if allowed is ANY else f" (accepted: {list(allowed)})"))
        else:
            kept[key] = value  # the loader names the closest valid key
    if refused:
        lines = "\n".join(f"  - {r}" for r in refused)
        raise ConfigError(f"verl config keys hybridflow cannot honour ({len(refused)}):\n{lines}")
    if accepted:
        logger.info("verl keys accepted: %s", "; ".join(accepted))
    out: dict = {}
    for key, value in kept.items():
        out = merge(out, dotted_tree(key, value))
    return out
