"""Typed, validated configuration for offload: dict / JSON / YAML / DeepSpeed -> OffloadConfig."""

from offload.config.errors import ConfigError
from offload.config.loader import load_config
from offload.config.offload_config import OffloadConfig
from offload.config.sections import (
    AioConfig,
    LossScaleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    PrefetchConfig,
    TelemetryConfig,
    WrapConfig,
)
from offload.config.sizes import parse_size

__all__ = [
    "AioConfig",
    "ConfigError",
    "LossScaleConfig",
    "OffloadConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "PrefetchConfig",
    "TelemetryConfig",
    "WrapConfig",
    "load_config",
    "parse_size",
]
