"""What users call: ``wrap``, the optimizer it returns, checkpoints, export and Hugging Face
directories in and out (``from_pretrained``, ``save_pretrained``).

Owns: the public entry points and their errors. ``wrap`` turns a plan (``offload.plan``) into a
runtime (``offload.runtime``) over homes (``offload.homes``); everything below it is private.
"""

from offload.api.checkpoint import CheckpointError, export, load_checkpoint, save_checkpoint
from offload.api.optimizer import OffloadOptimizer
from offload.api.pretrained import from_pretrained, save_pretrained
from offload.api.wrap import engine_of, register_external_parameter, wrap

__all__ = [
    "CheckpointError",
    "OffloadOptimizer",
    "engine_of",
    "export",
    "from_pretrained",
    "load_checkpoint",
    "register_external_parameter",
    "save_checkpoint",
    "save_pretrained",
    "wrap",
]
