"""What users call: ``wrap``, the optimizer it returns, checkpoints and export.

Owns: the public entry points and their errors. ``wrap`` turns a plan (``offload.plan``) into a
runtime (``offload.runtime``) over homes (``offload.homes``); everything below it is private.
"""

from offload.api.checkpoint import CheckpointError, export, load_checkpoint, save_checkpoint
from offload.api.optimizer import OffloadOptimizer
from offload.api.wrap import engine_of, wrap

__all__ = [
    "CheckpointError",
    "OffloadOptimizer",
    "engine_of",
    "export",
    "load_checkpoint",
    "save_checkpoint",
    "wrap",
]
