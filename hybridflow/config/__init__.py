"""Typed config (schema), YAML + dotlist loading (loader) and driver-side checks (validate)."""

from hybridflow.config.loader import ConfigError, load_config, save_config, to_dict
from hybridflow.config.schema import HybridFlowConfig, RewardTrainConfig, SFTConfig
from hybridflow.config.validate import validate_config, validate_rm_config, validate_sft_config

__all__ = [
    "HybridFlowConfig",
    "SFTConfig",
    "RewardTrainConfig",
    "ConfigError",
    "load_config",
    "validate_config",
    "validate_sft_config",
    "validate_rm_config",
    "to_dict",
    "save_config",
]
