"""hybridflow: RL post-training for LLMs (single controller on Ray, FSDP2 workers, PPO/GRPO/...)."""

__version__ = "0.1.0"

# Top-level names, imported on first use so that `import hybridflow` stays light (no torch, no Ray).
_LAZY = {
    "RLTrainer": "hybridflow.trainer.rl",
    "PPOTrainer": "hybridflow.trainer.ppo_trainer",
    "DPOTrainer": "hybridflow.trainer.dpo",
    "DataFlow": "hybridflow.trainer.dataflow",
    "Batch": "hybridflow.protocol",
    "load_config": "hybridflow.config",
    "HybridFlowConfig": "hybridflow.config",
    "SFTConfig": "hybridflow.config",
    "ParallelConfig": "hybridflow.config.parallel",
    "make_rl_data_loader": "hybridflow.data.loader",
    "init_distributed": "hybridflow.utils.distributed",
    "wrap_hf_model_with_fsdp": "hybridflow.utils.hf_integration",
    "prepare_fsdp_model": "hybridflow.utils.hf_integration",
}


def __getattr__(name: str):
    """`from hybridflow import RLTrainer, load_config` without importing torch/Ray for `import hybridflow`."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")


__all__ = list(_LAZY)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
