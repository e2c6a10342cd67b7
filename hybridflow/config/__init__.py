"""Typed config (schema), YAML + dotlist loading (loader) and driver-side checks (validate)."""

from hybridflow.config.loader import ConfigError, load_config, save_config, to_dict
from hybridflow.config.schema import HybridFlowConfig, SFTConfig
from hybridflow.config.validate import validate_config, validate_sft_config

__all__ = [
    "HybridFlowConfig",
    "SFTConfig",
    "ConfigError",
    "load_config",
    "validate_config",
    "validate_sft_config",
    "to_dict",
    "save_config",
]
