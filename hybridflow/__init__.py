"""hybridflow: RL post-training for LLMs (single controller on Ray, FSDP2 workers, PPO/GRPO/...)."""

__version__ = "0.1.0"

# Top-level names, imported on first use so that `import hybridflow` stays light (no torch, no Ray).
_LAZY = {
    "PPOTrainer": "hybridflow.trainer.ppo_trainer",
    "DataFlow": "hybridflow.trainer.dataflow",
    "ParallelConfig": "hybridflow.config.parallel",
}


def __getattr__(name: str):
    """`from hybridflow import PPOTrainer, DataFlow` without importing torch/Ray for `import hybridflow`."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")


__all__ = list(_LAZY)
