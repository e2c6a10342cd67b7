"""hybridflow: RL post-training for LLMs (single controller on Ray, FSDP2 workers, PPO/GRPO/...)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`from hybridflow import PPOTrainer` without importing torch/Ray for `import hybridflow`."""
    if name == "PPOTrainer":
        from hybridflow.trainer.ppo_trainer import PPOTrainer

        return PPOTrainer
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")


__all__ = ["PPOTrainer"]
