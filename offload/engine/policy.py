"""Which modules form offload units (the auto-wrap policy).

A unit is a group of modules whose parameters move together: by default one transformer block.
Units are chosen by class name (``wrap.module_classes``), or automatically (repeated classes
whose name ends in ``Block`` or ``Layer``, and torch's Transformer layers), or by a parameter
count threshold (``wrap.min_params``). Units never nest: the outermost match wins. Parameters
outside every unit, and parameters used by more than one unit (tied weights), belong to the
root unit, which stays gathered from the start of a forward to the end of its backward.
"""

from __future__ import annotations

from collections import Counter

import torch.nn as nn

_AUTO_CLASSES = ("TransformerEncoderLayer", "TransformerDecoderLayer")


def _auto_classes(model: nn.Module) -> set[str]:
    counts = Counter(type(m).__name__ for m in model.modules() if m is not model)
    names = {n for n in _AUTO_CLASSES if n in counts}
    for name, count in counts.items():
        if count >= 2 and (name.endswith("Block") or name.endswith("Layer")):
            names.add(name)
    return names


def select_units(
    model: nn.Module, module_classes: list[str], min_params: int
) -> list[tuple[str, nn.Module]]:
    """The (qualified name, module) of each unit, in registration order; the root is not listed."""
    classes = set(module_classes) if module_classes else _auto_classes(model)
    units: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> bool:
        """Adds units under ``module``; returns whether any was added."""
        found = False
        for name, child in module.named_children():
            qual = f"{prefix}.{name}" if prefix else name
            n_params = sum(p.numel() for p in child.parameters())
            if n_params == 0:
                continue
            if type(child).__name__ in classes:
                units.append((qual, child))
                found = True
            elif classes or min_params <= 0 or n_params < min_params:
                found |= visit(qual, child)
            elif not visit(qual, child):  # by size: the innermost modules over the threshold
                units.append((qual, child))
                found = True
            else:
                found = True
        return found

    visit("", model)
    if module_classes and not units:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"wrap.module_classes={module_classes!r} matches no module of this model; "
            f"classes present: {', '.join(present)}"
        )
    return units
