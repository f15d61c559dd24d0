"""offload: train PyTorch models beyond accelerator memory.

Parameters, gradients and optimizer state live on three tiers (device, pinned host memory, NVMe
files) and stream between them through asynchronous queues; a native CPU Adam runs the optimizer
step. The public face is small::

    model, optimizer = offload.wrap(model, config)

Everything else lives in subpackages (``offload.optim``, ``offload.io``, ``offload.store``,
``offload.api``, ...) whose ``__init__`` re-exports only what users need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first use, so `import offload` is cheap)
_EXPORTS = {
    "wrap": "offload.api",
    "save_checkpoint": "offload.api",
    "load_checkpoint": "offload.api",
    "export": "offload.api",
    "CheckpointError": "offload.api",
    "from_pretrained": "offload.api",
    "save_pretrained": "offload.api",
    "route_clipping": "offload.api.clipping",
    "OffloadTrainer": "offload.api.trainer",  # needs transformers: not in __all__
    "OffloadConfig": "offload.config",
    "load_config": "offload.config",
    "ConfigError": "offload.config",
    "CPUAdam": "offload.optim",
}

__all__ = [
    "__version__",
    "wrap",
    "save_checkpoint",
    "load_checkpoint",
    "export",
    "CheckpointError",
    "from_pretrained",
    "save_pretrained",
    "route_clipping",
    "OffloadConfig",
    "load_config",
    "ConfigError",
    "CPUAdam",
]

if TYPE_CHECKING:  # pragma: no cover
    from offload.api import (
        CheckpointError,
        export,
        from_pretrained,
        load_checkpoint,
        save_checkpoint,
        save_pretrained,
        wrap,
    )
    from offload.api.clipping import route_clipping
    from offload.api.trainer import OffloadTrainer  # noqa: F401 (needs transformers)
    from offload.config import ConfigError, OffloadConfig, load_config
    from offload.optim import CPUAdam


def __getattr__(name: str) -> Any:
    modname = _EXPORTS.get(name)
    if modname is None:
        raise AttributeError(f"module 'offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(modname), name)
    globals()[name] = value
    return value
