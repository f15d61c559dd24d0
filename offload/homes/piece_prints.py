"""What code outside offload wrote into device-resident parameters (``DeviceParams``).

Note: writes by code outside offload
    Where the fp32 master is a copy apart from the parameters that stay on the device
    (``Placement.master_apart_from_device_params``, one rank), the next update writes the values
    derived from the master over them, so a write through ``p.data`` (which moves no version
    counter) was dropped without a word (0.0013 off torch in a scratch probe). :class:`PiecePrints`
    keeps the :func:`~offload.device.memory.fingerprint` of each piece as offload last wrote it
    (at wrap, each update's commit, each load) and :meth:`PiecePrints.touched` names the pieces
    whose fingerprint moved since: the runtime's check (``offload.runtime.watch``) then narrows
    them to the parameters that differ from their master and refuses, as for a released unit's
    written pages. An update looks too, before it writes (:meth:`PiecePrints.writing`), where
    the device buffer reads without waiting for the compute (the CPU:
    ``DeviceWriter.reads_before_write``): a piece written meanwhile is said by
    :meth:`PiecePrints.overwritten` (its values gone, the whole piece); on CUDA such a write
    (after the unit's first forward use since its update, or while an update still runs after
    ``step()``) is not seen. The cost is one read of a unit's pieces at its first use in a
    forward after an update or a load (:meth:`PiecePrints.looked`; on CUDA a reduction and a
    host sync) and at ``state_dict()``, ``save_pretrained`` and ``export``, and per update one
    read after its write (on CUDA of the staging slot, on the host) and on the CPU one before
    it; a piece being updated (between :meth:`PiecePrints.writing` and
    :meth:`PiecePrints.committed`) is not looked at. Where the master is the parameters
    themselves, a write lasts as in torch and nothing is kept (:class:`NoPrints`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from offload.device import fingerprint
from offload.plan import Unit

Piece = Callable[[Unit, int, int], torch.Tensor]
"""``(unit, lo, hi) -> the device buffer's elements [lo, hi)`` of the unit's home."""


class NoPrints:
    """Nothing kept: the parameters are the master, so a write into them lasts."""

    def created(self, unit: Unit, pieces: list[tuple[int, int]]) -> None:
        pass

    def writing(self, unit: Unit, lo: int, hi: int) -> None:
        pass

    def committed(self, unit: Unit, lo: int, flat: torch.Tensor, a: int, b: int) -> None:
        pass

    def loading(self, unit: Unit, lo: int) -> None:
        pass

    def looked(self, unit: Unit) -> bool:
        return False

    def touched(self, unit: Unit, pieces: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        return []

    def overwritten(self, unit: Unit) -> list[tuple[int, int]]:
        return []


class PiecePrints(NoPrints):
    """The fingerprints of one home's pieces (the module Note), read through ``piece`` and
    written by ``writer`` (``offload.device.DeviceWriter``)."""

    def __init__(self, piece: Piece, writer) -> None:
        self.piece, self.writer = piece, writer
        # (unit, lo) -> (fingerprint,) as offload last wrote the piece; None while an update
        # writes it. A fresh tuple each time: a check that read one sees whether it changed
        self._prints: dict[tuple[int, int], tuple[int] | None] = {}
        # pieces written outside offload that an update then wrote over: (unit, lo) -> hi
        self._overwritten: dict[tuple[int, int], int] = {}
        self._looked: set[int] = set()  # units looked at since offload last wrote them

    def created(self, unit: Unit, pieces: list[tuple[int, int]]) -> None:
        """The unit's home was filled (wrap)."""
        for lo, hi in pieces:
            self._prints[unit.index, lo] = (int(fingerprint(self.piece(unit, lo, hi))),)

    def writing(self, unit: Unit, lo: int, hi: int) -> None:
        """An update is about to write the piece: a write into it since offload's last is
        noted first where the device buffer reads without waiting for the compute."""
        key = (unit.index, lo)
        seen, self._prints[key] = self._prints.get(key), None  # (being written: not looked at)
        self._looked.discard(unit.index)
        if (
            seen is not None
            and self.writer.reads_before_write
            and int(fingerprint(self.piece(unit, lo, hi))) != seen[0]
        ):
            self._overwritten[key] = hi

    def committed(self, unit: Unit, lo: int, flat: torch.Tensor, a: int, b: int) -> None:
        """The writer committed the piece (``flat[a:b]``)."""
        self._prints[unit.index, lo] = (self.writer.committed_print(flat, a, b),)

    def loading(self, unit: Unit, lo: int) -> None:
        """A load replaces what the piece held: nothing to say of it (its commit records)."""
        self._prints[unit.index, lo] = None
        self._looked.discard(unit.index)

    def looked(self, unit: Unit) -> bool:
        """Whether :meth:`touched` looked at ``unit`` since offload last wrote it: a forward
        looks once per update (a generate() runs one per token), and a write after it is
        seen by the next update's :meth:`writing` (on the CPU)."""
        return unit.index in self._looked

    def touched(self, unit: Unit, pieces: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        """Those of the unit's ``pieces`` written by code outside offload since offload last
        wrote them, each said once."""
        self._looked.add(unit.index)
        self.writer.quiesce()  # (CUDA) the update's copies up have landed
        kept = [(lo, hi, self._prints.get((unit.index, lo))) for lo, hi in pieces]
        kept = [(lo, hi, seen) for lo, hi, seen in kept if seen is not None]
        if not kept:
            return []
        now = torch.stack([fingerprint(self.piece(unit, lo, hi)) for lo, hi, _ in kept]).tolist()
        moved = []
        for (lo, hi, seen), value in zip(kept, now, strict=True):
            key = (unit.index, lo)
            # not written by an update meanwhile (its writing() replaced the record)
            if value != seen[0] and self._prints.get(key) is seen:
                self._prints[key] = (value,)
                moved.append((lo, hi, True))
        return moved

    def overwritten(self, unit: Unit) -> list[tuple[int, int]]:
        """The unit's pieces that code outside offload wrote and an update then wrote over
        before a check looked (a write right after ``optimizer.step()`` while its update still
        ran after the backward): which parameters of them, their values no longer say. Each
        said once."""
        keys = [k for k in self._overwritten if k[0] == unit.index]
        return [(lo, self._overwritten.pop((u, lo))) for u, lo in keys]
