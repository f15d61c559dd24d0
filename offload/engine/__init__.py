"""The training engine: ``wrap``, checkpoints and export."""

from offload.engine.checkpoint import export, load_checkpoint, save_checkpoint
from offload.engine.optimizer import OffloadOptimizer
from offload.engine.wrap import wrap

__all__ = ["OffloadOptimizer", "export", "load_checkpoint", "save_checkpoint", "wrap"]
