"""Which trainable parameters weight decay leaves alone, and each update piece cut at them.

Most fine-tuning recipes (transformers' Trainer, nanoGPT, timm) decay the weight matrices and
leave biases and norm weights undecayed. offload's update runs over flat pieces of a unit, in
which those parameters sit between the matrices; :class:`NoDecay` cuts a piece into runs at
their edges, and the update makes one kernel call per run: the decayed runs with the step's
weight decay, the others with none. That is the same arithmetic, element for element, as a
torch optimizer with two param groups (the kernel is elementwise). With no such parameter a
piece is one run: the update is the one call it was, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from offload.plan import Unit

Run = tuple[int, int, bool]
"""``(begin, end, decayed)``: a stretch of a piece in the unit's flat coordinates."""


class NoDecay:
    """The trainable parameters weight decay does not move (``optimizer.no_decay``, or
    ``OffloadOptimizer.set_no_decay``), and the runs of each piece (cached: the pieces are the
    same every step)."""

    __slots__ = ("params", "_runs")

    def __init__(self, params: Iterable[torch.nn.Parameter] = ()) -> None:
        self.params = frozenset(params)
        self._runs: dict[tuple[int, int, int], tuple[Run, ...]] = {}

    def runs(self, unit: Unit, lo: int, hi: int) -> tuple[Run, ...]:
        """``[lo, hi)`` in runs, in order and covering it; padding joins the run before it (its
        gradient and value are 0, so any decay leaves it 0)."""
        key = (unit.index, lo, hi)
        cached = self._runs.get(key)
        if cached is None:
            cached = self._runs[key] = self._cut(unit, lo, hi)
        return cached

    def _cut(self, unit: Unit, lo: int, hi: int) -> tuple[Run, ...]:
        if not self.params:
            return ((lo, hi, True),)
        runs: list[list] = []
        for seg, a, _ in unit.layout.overlaps(lo, hi, trainable_only=True):
            decayed = seg.param not in self.params
            if runs and runs[-1][2] == decayed:
                continue
            start = seg.offset + a if runs else lo
            if runs:
                runs[-1][1] = start
            runs.append([start, hi, decayed])
        return tuple((a, b, d) for a, b, d in runs) or ((lo, hi, True),)
