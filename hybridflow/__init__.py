"""hybridflow: RL post-training for LLMs (single controller on Ray, FSDP2 workers, PPO/GRPO/...)."""

__version__ = "0.1.0"
