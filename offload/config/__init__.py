"""Typed, validated configuration for offload: dict / JSON / YAML / DeepSpeed -> OffloadConfig."""

from offload.config.auto_size import resolve_auto_buffer_size
from offload.config.errors import ConfigError
from offload.config.loader import load_config
from offload.config.offload_config import OffloadConfig
from offload.config.sections import (
    AioConfig,
    DistributedConfig,
    LossScaleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    PrefetchConfig,
    TelemetryConfig,
    WrapConfig,
)
from offload.config.sizes import AutoSize, parse_size

__all__ = [
    "AioConfig",
    "AutoSize",
    "ConfigError",
    "DistributedConfig",
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
    "resolve_auto_buffer_size",
]
