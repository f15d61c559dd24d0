"""Values in and out of the homes: the one scatter/gather between a unit's flat pieces and its
parameters (``FlatLayout.pairs``), fed by value sources.

A :class:`ValueSource` gives the flat values of one piece of one kind of state; sources are
the live parameters (at wrap), a model's weights in safetensors files or tensors by name
(``wrap(..., weights=)``, ``offload.runtime.weights``), per-parameter tensors
(``optimizer.load_state_dict``) and checkpoint files (``offload.api.checkpoint``).
:meth:`Values.load` writes a source into the homes piece by piece, the master through its owner
(which derives the compute params), so nothing is ever held whole. :meth:`Values.read` scatters
the homes' pieces into one tensor per parameter.

Kinds: ``master``, ``exp_avg``, ``exp_avg_sq`` (fp32, over the trainable prefix) and
``frozen`` (compute dtype, over the frozen suffix).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from offload.dist import LocalComm
from offload.homes.optim import KINDS, OptimHome
from offload.homes.params import ParamHome
from offload.plan import FlatLayout, Plan, Segment, Unit

FROZEN = "frozen"


def gather_piece(
    layout: FlatLayout,
    lo: int,
    hi: int,
    dtype: torch.dtype,
    view_of: Callable[[Segment], torch.Tensor | None],
) -> torch.Tensor:
    """A new flat tensor of elements ``[lo, hi)`` from per-parameter flat views (zero where no
    parameter is, or ``view_of`` gives None). A view may be anything sliced like a flat tensor
    that gives a tensor (a tensor in a file, ``offload.runtime.weights``): only the elements
    inside ``[lo, hi)`` are asked for."""
    out = torch.zeros(hi - lo, dtype=dtype)
    for param_side, flat_side in layout.pairs(lo, hi, out, view_of):
        flat_side.copy_(param_side)
    return out


class ValueSource:
    """Flat values of one piece; None: the source has none of that kind (it stays as it is,
    zero in a new state)."""

    def piece(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        raise NotImplementedError


class ParamValues(ValueSource):
    """A value for every parameter and nothing else: what a new state is built from at wrap.
    The master and the frozen compute values are gathered from each parameter's flat view
    (:meth:`view_of`); there are no moments (a new state starts them at zero)."""

    def __init__(self, compute_dtype: torch.dtype) -> None:
        self.dtype = compute_dtype

    def view_of(self, seg: Segment):
        """The parameter's values, flat: a 1-D tensor or anything sliced like one."""
        raise NotImplementedError

    def fill_buffers(self, model: nn.Module) -> None:
        """Gives the model's buffers their values before wrap casts them (a live model's are
        its own already)."""

    def close(self) -> None:
        """Releases what the source holds open (files)."""

    def piece(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        if kind in KINDS[1:]:
            return None
        return self.values(unit, lo, hi, torch.float32 if kind == "master" else self.dtype)

    def values(self, unit: Unit, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the unit's flat buffer, in ``dtype``."""
        return gather_piece(unit.layout, lo, hi, dtype, self.view_of)


class LiveParams(ParamValues):
    """The parameters' current values (what a materialized model holds when it is wrapped)."""

    def view_of(self, seg: Segment) -> torch.Tensor:
        return seg.param.detach().reshape(-1)


class ParamTensors(ValueSource):
    """Per-parameter tensors by kind (``{kind: {param: tensor}}``), checked against the layout."""

    def __init__(self, values: dict[str, dict[nn.Parameter, torch.Tensor]], what: str) -> None:
        self.values, self.what = values, what

    def piece(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        by_param = self.values.get(kind)
        if by_param is None:
            return None

        def view(seg: Segment) -> torch.Tensor:
            if seg.param not in by_param:
                raise ValueError(f"{self.what}: no saved state for parameter '{seg.name}'")
            saved = by_param[seg.param]
            # (the shape, not only the count: a [144, 48] state loaded into a [48, 144]
            # parameter was read in the new shape, and trained on, where torch's step raises)
            if tuple(saved.shape) != tuple(seg.shape):
                raise ValueError(
                    f"{self.what}: '{kind}' of parameter '{seg.name}' has shape "
                    f"{list(saved.shape)}; the model's parameter is {list(seg.shape)}"
                )
            return saved.reshape(-1)

        return gather_piece(unit.layout, lo, hi, torch.float32, view)


class GivenValues(ValueSource):
    """Values for some parameters (``model.load_state_dict``): the master of the trainable ones
    and the frozen values of the others; a piece with parameters the caller did not give
    starts from their current values (``current``), so they keep them; no moments (they stay)."""

    def __init__(
        self, given: dict[nn.Parameter, torch.Tensor], current: Callable, dtype: torch.dtype
    ) -> None:
        self.given, self.current, self.dtype = given, current, dtype

    def piece(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        if kind in KINDS[1:]:
            return None
        frozen = kind == FROZEN
        segs = [s for s, _, _ in unit.layout.overlaps(lo, hi) if s.trainable != frozen]
        if not any(s.param in self.given for s in segs):
            return None
        dtype = self.dtype if frozen else torch.float32
        if all(s.param in self.given for s in segs):
            out = torch.zeros(hi - lo, dtype=dtype)
        else:
            out = self.current(unit, kind, lo, hi).to(dtype)
        view = lambda s: self.given[s.param].reshape(-1) if s.param in self.given else None  # noqa: E731
        for param_side, flat_side in unit.layout.pairs(lo, hi, out, view):
            flat_side.copy_(param_side)
        return out


class Values:
    """Reads and loads one wrapped model's state (its plan and homes).

    Note: across ranks
        Each rank's owners hold its share (``offload.plan.ownership``). :meth:`flat` and
        :meth:`pieces` are this rank's share (what a checkpoint file of this rank holds);
        :meth:`read` and :meth:`full` give whole parameters, all-gathering the shares (a
        collective: every rank calls it for the same units in the same order); :meth:`load`
        writes this rank's share of each kind, and every frozen piece the param home holds
        (stages 1 and 2 keep the whole frozen suffix on every rank).
    """

    def __init__(self, plan: Plan, params: ParamHome, optim: OptimHome, comm=None) -> None:
        self.plan, self.params, self.optim = plan, params, optim
        self.comm = comm or LocalComm()

    def pieces(self, unit: Unit, kind: str) -> list[tuple[int, int]]:
        """This rank's share of ``kind`` over the unit, in pieces."""
        return self.plan.frozen_pieces(unit) if kind == FROZEN else self.plan.trainable_pieces(unit)

    def _load_pieces(self, unit: Unit, kind: str) -> list[tuple[int, int]]:
        if kind != FROZEN:
            return self.plan.trainable_pieces(unit)
        return [(a, b) for a, b in self.plan.pieces(unit) if a >= unit.layout.trainable]

    def _gathered(self, unit: Unit, kind: str) -> tuple[int, torch.Tensor] | None:
        """``(begin, every rank's share of kind back to back)`` (a collective)."""
        pieces = self.pieces(unit, kind)
        if not pieces:
            return None
        local = torch.cat([self.flat(unit, kind, lo, hi) for lo, hi in pieces])
        out = torch.empty(local.numel() * self.comm.world, dtype=local.dtype)
        self.comm.all_gather(out, local, what=f"{unit.label} {kind}").wait()
        return (unit.layout.trainable if kind == FROZEN else 0), out

    def flat(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor:
        """A new host tensor with ``kind`` over a piece, from its owner."""
        if kind == FROZEN:
            return self.params.read(unit, lo, hi)
        return self.optim.read(unit, kind, lo, hi)

    def read(self, unit: Unit, kind: str) -> dict[nn.Parameter, torch.Tensor]:
        """``kind`` of every parameter it covers, as new 1-D host tensors."""
        segs = [s for s in unit.layout.segments if s.trainable != (kind == FROZEN)]
        dtype = self.params.dtype if kind == FROZEN else torch.float32
        out = {s.param: torch.empty(s.numel, dtype=dtype) for s in segs}
        if self.comm.world == 1:
            flats = [(lo, self.flat(unit, kind, lo, hi)) for lo, hi in self.pieces(unit, kind)]
        else:
            got = self._gathered(unit, kind)
            flats = [got] if got is not None else []
        for lo, flat in flats:
            for param_side, flat_side in unit.layout.pairs(
                lo, lo + flat.numel(), flat, lambda s: out.get(s.param)
            ):
                param_side.copy_(flat_side)
        return out

    def full(self, unit: Unit) -> dict[nn.Parameter, torch.Tensor]:
        """Current values of the unit's parameters, shaped: the fp32 master of trainable ones,
        the compute values of frozen ones."""
        values = self.read(unit, "master") | self.read(unit, FROZEN)
        return {p: t.view(p.shape) for p, t in values.items()}

    def load(self, unit: Unit, source: ValueSource) -> None:
        """Writes every kind ``source`` has into the unit's homes, piece by piece (a gathered
        copy of the unit is stale afterwards: the caller releases it)."""
        for kind in (*KINDS, FROZEN):
            for lo, hi in self._load_pieces(unit, kind):
                values = source.piece(unit, kind, lo, hi)
                if values is None:
                    continue
                if kind == FROZEN:
                    self.params.load_shard(unit, lo, hi, values)
                else:
                    self.optim.load(unit, kind, lo, hi, values)
