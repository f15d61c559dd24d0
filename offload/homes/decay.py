"""Which hyperparameters each trainable parameter's update takes, and each update piece cut at
their edges.

Recipes give parameters different hyperparameters in two ways: weight decay leaves biases and
norm weights alone (transformers' Trainer, nanoGPT, timm), and param groups give some a
learning rate of their own (a new head's, layer-wise decay, LoRA+'s B matrices). offload's
update runs over flat pieces of a unit, in which such parameters sit side by side;
:class:`UpdateRuns` cuts a piece into runs at their edges, and the update makes one kernel call
per run with the run's group's hyperparameters, weight decay 0 where the run is undecayed.
That is the same arithmetic, element for element, as a torch optimizer with those groups (the
kernel is elementwise). With one group and every parameter decayed a piece is one run: the
update is the one call it was, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from offload.plan import Unit

Run = tuple[int, int, int, bool]
"""``(begin, end, group, decayed)``: a stretch of a piece in the unit's flat coordinates, its
param group's index and whether weight decay moves it."""


class UpdateRuns:
    """The trainable parameters weight decay does not move (``optimizer.no_decay``, or
    ``OffloadOptimizer.set_no_decay``), the param group of each (``wrap``'s ``param_groups``;
    group 0 for a parameter not in ``group_of``), and the runs of each piece (cached: the
    pieces are the same every step)."""

    __slots__ = ("no_decay", "group_of", "_runs")

    def __init__(
        self,
        no_decay: Iterable[torch.nn.Parameter] = (),
        group_of: Mapping[torch.nn.Parameter, int] | None = None,
    ) -> None:
        self.no_decay = frozenset(no_decay)
        self.group_of = dict(group_of or {})
        self._runs: dict[tuple[int, int, int], tuple[Run, ...]] = {}

    def with_no_decay(self, no_decay: Iterable[torch.nn.Parameter]) -> UpdateRuns:
        """The same groups with another undecayed set (a new object: an update in flight keeps
        the one it started with)."""
        return UpdateRuns(no_decay, self.group_of)

    def key(self, param: torch.nn.Parameter) -> tuple[int, bool]:
        """``(group, decayed)`` of a trainable parameter."""
        return self.group_of.get(param, 0), param not in self.no_decay

    def runs(self, unit: Unit, lo: int, hi: int) -> tuple[Run, ...]:
        """``[lo, hi)`` in runs, in order and covering it; padding joins the run before it (its
        gradient and value are 0, so any decay or learning rate leaves it 0)."""
        key = (unit.index, lo, hi)
        cached = self._runs.get(key)
        if cached is None:
            cached = self._runs[key] = self._cut(unit, lo, hi)
        return cached

    def _cut(self, unit: Unit, lo: int, hi: int) -> tuple[Run, ...]:
        if not self.no_decay and not self.group_of:
            return ((lo, hi, 0, True),)
        runs: list[list] = []
        for seg, a, _ in unit.layout.overlaps(lo, hi, trainable_only=True):
            key = self.key(seg.param)
            if runs and tuple(runs[-1][2:]) == key:
                continue
            start = seg.offset + a if runs else lo
            if runs:
                runs[-1][1] = start
            runs.append([start, hi, *key])
        return tuple((a, b, g, d) for a, b, g, d in runs) or ((lo, hi, 0, True),)
