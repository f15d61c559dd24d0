"""Units: the modules whose parameters move together, chosen once at wrap (the auto-wrap policy).

A unit is a group of modules whose parameters move together: by default one transformer block.
Units are chosen by class name (``wrap.module_classes``), or automatically (repeated classes
whose name ends in ``Block`` or ``Layer``, and torch's Transformer layers), or by a parameter
count threshold (``wrap.min_params``). Units never nest: the outermost match wins. Parameters
outside every unit, and parameters used by more than one unit (tied weights) or registered in a
unit and outside every unit, belong to the root unit, which stays gathered from the start of a
forward to the end of its backward. A module's forward that reads a parameter registered
elsewhere (``F.linear(x, self.blocks[2].fc.weight)``) says so with
``offload.register_external_parameter(module, parameter)`` before wrap: the parameter counts as
used where that module is, as if registered there too (:func:`note_external_use`).

The :class:`Unit` record is read-only after wrap: what changes during training (gathered or
not, grads pending) lives in the runtime's and the homes' own records, keyed by unit.
"""

from __future__ import annotations

import enum
import weakref
from collections import Counter
from dataclasses import dataclass

import torch.nn as nn

from offload.plan.layout import FlatLayout, ShardSpec

_AUTO_CLASSES = ("TransformerEncoderLayer", "TransformerDecoderLayer")

# module -> the parameters registered elsewhere that its forward reads
# (``offload.register_external_parameter``), read by :func:`build_units`. Weak in the module, so
# a model dropped before wrap takes its registrations with it; its ``copy.deepcopy`` has none.
_EXTERNAL: weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]] = weakref.WeakKeyDictionary()


def note_external_use(module: nn.Module, param: nn.Parameter) -> None:
    """Records that ``module``'s forward reads ``param`` (idempotent); the caller checks that no
    wrapped model's plan is past taking it into account."""
    uses = _EXTERNAL.setdefault(module, [])
    if not any(p is param for p in uses):
        uses.append(param)


class Residency(enum.Enum):
    """How long a unit's parameters stay gathered once used."""

    TRANSIENT = "transient"
    """Released after each forward and after its backward (the default for a unit)."""
    PERSISTENT = "persistent"
    """Small (under ``offload_param.persistence_threshold``): kept from first use to the step."""
    ROOT = "root"
    """The root unit: gathered from the start of a forward to the end of its backward."""


@dataclass(frozen=True, eq=False, slots=True)
class Unit:
    index: int
    name: str  # qualified module name ("" for the root)
    module: nn.Module
    layout: FlatLayout
    persistent: bool = False  # small: stays gathered from first use until the step ends
    is_root: bool = False

    @property
    def residency(self) -> Residency:
        if self.is_root:
            return Residency.ROOT
        return Residency.PERSISTENT if self.persistent else Residency.TRANSIENT

    @property
    def params(self) -> list[nn.Parameter]:
        return [s.param for s in self.layout.segments]

    @property
    def trainable_params(self) -> list[nn.Parameter]:
        return [s.param for s in self.layout.segments if s.trainable]

    @property
    def label(self) -> str:
        return self.name or "<root>"


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


def build_units(
    model: nn.Module,
    module_classes: list[str],
    min_params: int,
    *,
    persistence_threshold: int | None,
    shard: ShardSpec | None = None,
) -> list[Unit]:
    """The root unit (index 0) and one unit per selected module. ``persistence_threshold``:
    units of at most this many (padded) elements stay gathered until the step; None: none do
    (the params live on the device anyway)."""
    chosen = select_units(model, module_classes, min_params)
    # Every place a parameter is registered counts, the unit it is under or the root (-1):
    # one registered on a unit's module and also on a module outside every unit (the model
    # using ``self.w = self.blocks[2].fc.weight`` itself) is the root's, as one shared by two
    # units is. Owned by the unit alone, it read as zeros (released) where the root used it.
    # A registration with register_external_parameter counts as one on its module.
    unit_of = {id(mod): i for i, (_, mod) in enumerate(chosen)}
    modules = dict(model.named_modules(remove_duplicate=False))

    def unit_under(qual: str) -> int:
        """The unit the module ``qual`` is (or is under), -1 where it is under none."""
        parts = qual.split(".") if qual else []
        for k in range(1, len(parts) + 1):
            owner = unit_of.get(id(modules[".".join(parts[:k])]), -1)
            if owner >= 0:
                return owner
        return -1

    users: dict[nn.Parameter, set[int]] = {}
    names: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, name)
        users.setdefault(p, set()).add(unit_under(name.rpartition(".")[0]))
    for qual, mod in modules.items():
        for p in _EXTERNAL.get(mod, ()):
            if p not in users:
                raise ValueError(
                    f"offload.register_external_parameter: module '{qual or '<model>'}' "
                    f"({type(mod).__name__}) reads a parameter of shape {tuple(p.shape)} that "
                    "is not this model's: register a parameter of the model being wrapped"
                )
            users[p].add(unit_under(qual))
    per_unit: list[list[tuple[str, nn.Parameter]]] = [[] for _ in chosen]
    root: list[tuple[str, nn.Parameter]] = []
    for p, name in names.items():
        owner = next(iter(users[p])) if len(users[p]) == 1 else -1
        (per_unit[owner] if owner >= 0 else root).append((name, p))
    units = [Unit(0, "", model, FlatLayout.build(root, shard), is_root=True)]
    for i, ((qual, mod), named) in enumerate(zip(chosen, per_unit)):
        layout = FlatLayout.build(named, shard)
        small = persistence_threshold is not None and layout.total <= persistence_threshold
        units.append(Unit(i + 1, qual, mod, layout, persistent=small))
    return units
