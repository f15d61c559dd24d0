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

A parameter that got no gradient in a step (an MoE expert no token was routed to, a multi-task
head its batch did not use, a branch not taken) is left alone by torch's optimizers: not its
value, not its moments, not its step count, which is each parameter's own (its bias
correction). :class:`StepCounts` holds that: each parameter's steps without a gradient and the
parameters the open step's update moves; a piece with such a parameter is cut into runs at
their edges too, each run with its own step, the skipped ones left out of the update.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from offload.plan import Unit

Run = tuple[int, int, int, bool]
"""``(begin, end, group, decayed)``: a stretch of a piece in the unit's flat coordinates, its
param group's index and whether weight decay moves it."""

CountedRun = tuple[int, int, int, bool, int]
"""A :data:`Run` and its parameters' step count this step (0: they got no gradient, and the
update leaves them alone)."""


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
        return _cut(unit, lo, hi, self.key) or ((lo, hi, 0, True),)

    def counted_runs(
        self, unit: Unit, lo: int, hi: int, counts: StepCounts, step: int
    ) -> tuple[CountedRun, ...]:
        """:meth:`runs` cut also where the parameters' step counts differ (``step``: the
        optimizer's; :meth:`StepCounts.step_of`). Not cached: which parameters got a gradient
        changes from step to step."""
        return _cut(unit, lo, hi, lambda p: (*self.key(p), counts.step_of(p, step))) or (
            (lo, hi, 0, True, step),
        )


def _cut(unit: Unit, lo: int, hi: int, key) -> tuple[tuple, ...]:
    """``[lo, hi)`` as ``(begin, end, *key(param))`` stretches of equal keys, in order and
    covering it (padding joins the stretch before it); empty where it holds no trainable
    parameter."""
    runs: list[list] = []
    for seg, a, _ in unit.layout.overlaps(lo, hi, trainable_only=True):
        k = key(seg.param)
        if runs and tuple(runs[-1][2:]) == k:
            continue
        start = seg.offset + a if runs else lo
        if runs:
            runs[-1][1] = start
        runs.append([start, hi, *k])
    return tuple(tuple(r) for r in runs)


class StepCounts:
    """Each trainable parameter's own step count, as torch keeps one per parameter: the
    optimizer's steps less those it got no gradient in (``missed``; absent: none), and the
    parameters the open step's update moves, those that got a gradient (``seen``: the set the
    gradients' owner fills as units' gradients arrive, so a speculative update begun before
    the backward reads each unit's once it is final; None: every parameter). One object per
    step: ``missed`` is never changed in place (:meth:`advanced`), so an update still running
    keeps the counts it began with."""

    __slots__ = ("missed", "seen")

    def __init__(
        self,
        missed: Mapping[torch.nn.Parameter, int] | None = None,
        seen: set[torch.nn.Parameter] | None = None,
    ) -> None:
        self.missed = {} if missed is None else missed  # (never changed: see advanced)
        self.seen = seen

    def step_of(self, param: torch.nn.Parameter, step: int) -> int:
        """``param``'s step count in the optimizer's step number ``step``; 0 where it got no
        gradient (the update leaves it alone)."""
        if self.seen is not None and param not in self.seen:
            return 0
        return step - self.missed.get(param, 0)

    def uniform(self, unit: Unit) -> bool:
        """Whether every trainable parameter of ``unit`` got a gradient and has the optimizer's
        step count (the update of its pieces is the one it always was)."""
        params = unit.trainable_params
        if self.missed and any(p in self.missed for p in params):
            return False
        return self.seen is None or all(p in self.seen for p in params)

    def advanced(self, trainable: Iterable[torch.nn.Parameter]) -> dict:
        """``missed`` after this step, a new mapping: one more for each of ``trainable`` that
        got no gradient."""
        if self.seen is None:
            return self.missed
        missed = dict(self.missed)
        for p in trainable:
            if p not in self.seen:
                missed[p] = missed.get(p, 0) + 1
        return missed
