"""A unit: the modules whose parameters move together, and the engine's record of it.

State lives here, keyed by unit, never as attributes glued onto the user's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from offload.engine.layout import FlatLayout


@dataclass(eq=False, slots=True)
class Unit:
    index: int
    name: str  # qualified module name ("" for the root)
    module: nn.Module
    layout: FlatLayout
    persistent: bool = False  # small: stays gathered from first use until the step ends
    is_root: bool = False
    gathered: bool = False  # params' device storages hold current values
    grads_pending: int = 0  # trainable params whose grad is not final yet in this backward
    backward_done: bool = False  # grads of this backward are off the device
    hook_handles: list = field(default_factory=list)

    @property
    def params(self) -> list[nn.Parameter]:
        return [s.param for s in self.layout.segments]

    @property
    def trainable_params(self) -> list[nn.Parameter]:
        return [s.param for s in self.layout.segments if s.trainable]

    @property
    def label(self) -> str:
        return self.name or "<root>"


def free_storage(p: torch.Tensor) -> None:
    """Releases a parameter's storage in place; the Parameter object stays the same."""
    st = p.untyped_storage()
    if st.nbytes() != 0:
        st.resize_(0)


def alloc_storage(p: torch.Tensor) -> bool:
    """Gives a released parameter its storage back (contents undefined); True if it had none."""
    st = p.untyped_storage()
    need = p.numel() * p.element_size()
    if st.nbytes() == need:
        return False
    st.resize_(need)
    return True
