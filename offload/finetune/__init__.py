"""``offload finetune``: fine-tune a Hugging Face model directory on a data file.

Owns: reading and packing the data (``data``) and the recipe (``recipe``: the training loop,
checkpoints, resume, export). The command-line face is ``offload.cli.finetune``.
"""

from offload.finetune.data import Packed, load_data
from offload.finetune.recipe import Options, finetune

__all__ = ["Options", "Packed", "finetune", "load_data"]
