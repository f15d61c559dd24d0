"""Where each unit's compute parameters live between uses (``offload_param.device``).

One home is built at wrap time (from the plan); the runtime calls the same methods whatever it
is. "Load my shard" and "unshard" are separate calls: :meth:`ParamHome.create` and
:meth:`ParamHome.load_shard` fill the home's own bytes (this rank's share, piece by piece, from
any source of values), :meth:`ParamHome.unshard` makes the unit usable on the compute device and
:meth:`ParamHome.reshard` drops that working copy.

- :class:`DeviceParams` (``"none"``): a flat device buffer per unit; the parameters are views
  into it and never released. The optimizer writes updated values into it through the device's
  writer (``offload.device.DeviceWriter``).
- :class:`HostParams` (``"cpu"``): the home is a flat host buffer (pinned on CUDA); a forward or
  backward gathers the unit into the parameters' own storages and releases them after.
- :class:`NvmeParams` (``"nvme"``): the home is NVMe, one shard per piece, streamed through the
  ``offload_param`` buffer pool by the tiered store (whose trace-driven prefetcher brings the next
  units in while this one computes).

Note: gather and release keep the Parameter objects
    Releasing frees a parameter's storage in place; gathering gives it back and copies into
    ``p.data``, which does not bump the autograd version counter, so tensors that autograd
    saved in forward stay valid for backward. Nobody outside sees a new tensor. How the storage
    is freed and given back is the device's (``offload.device.storage_for``: page-released
    blocks on the CPU, resized storages on CUDA).

Note: the gather's window
    An NVMe gather keeps at most ``param_window`` pieces in flight (the pool must keep a buffer
    free for the trace prefetcher's demand). A pool buffer goes back to the store once its copy
    to the device has completed; the host waits for those copies once per unit, not per piece.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable

import torch

from offload.device import COMPLETED, Event, HostMemory, Transfers, storage_for
from offload.plan import Plan, Unit

PieceValues = Callable[[int, int], torch.Tensor]
"""``(lo, hi) -> values`` of a unit's elements ``[lo, hi)`` in the compute dtype."""


def _param_view(seg) -> torch.Tensor:
    return seg.param.data.view(-1)


class ParamHome:
    """Interface of the parameter homes (see the module docstring)."""

    def __init__(self, plan: Plan, transfers: Transfers, memory: HostMemory) -> None:
        self.plan, self.transfers, self.memory = plan, transfers, memory
        self.device, self.dtype = plan.placement.device, plan.placement.dtype
        self._gathered: set[int] = set()
        self._pending: Event = COMPLETED  # the last copy out of a host home

    def create(self, unit: Unit, values: PieceValues) -> None:
        """Builds the unit's home from ``values`` of each piece (wrap time). The parameters
        keep their own storage until :meth:`attach`, so their values can be read meanwhile."""
        raise NotImplementedError

    def attach(self, unit: Unit) -> None:
        """Points the unit's parameters at their working storage (wrap time, after every other
        home has read their old values)."""
        raise NotImplementedError

    def load_shard(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        """Overwrites compute values of elements ``[lo, hi)`` (a piece) in the home; a gathered
        copy of the unit is stale afterwards (the caller reshards it)."""
        out = self.out_buffer(unit, lo, hi)
        out.copy_(values)
        self.commit(unit, lo, hi)

    def unshard(self, unit: Unit) -> None:
        """Makes the unit's parameters usable on the compute device (idempotent)."""

    def reshard(self, unit: Unit) -> None:
        """Drops the unit's working copy (idempotent)."""

    def gathered(self, unit: Unit) -> bool:
        return unit.index in self._gathered

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        """Where the optimizer writes updated compute values of elements ``[lo, hi)``."""
        raise NotImplementedError

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        """The optimizer finished writing ``out_buffer(unit, lo, hi)``."""

    def give_up_out(self, unit: Unit, lo: int, hi: int) -> None:
        """The optimizer failed before committing ``out_buffer(unit, lo, hi)``: the home keeps
        its values from before where it can (an NVMe piece's buffer is dropped unwritten)."""

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        """Current compute values of elements ``[lo, hi)`` as a new host tensor."""
        raise NotImplementedError

    def master_view(self, unit: Unit) -> torch.Tensor:
        """The home's fp32 host buffer over this rank's trainable share, when it is the master
        (``MasterOwner.PARAMS``; only built then)."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold the fp32 master")

    def quiesce(self) -> None:
        """Waits until no copy out of the home is in flight (before the update rewrites it)."""
        self.transfers.wait(self._pending, "host->device")
        self._pending = COMPLETED

    def close(self) -> None:
        pass


class DeviceParams(ParamHome):
    def __init__(self, plan: Plan, transfers: Transfers, memory: HostMemory, writer) -> None:
        super().__init__(plan, transfers, memory)
        self.writer = writer
        self.flat: dict[int, torch.Tensor] = {}

    def create(self, unit: Unit, values: PieceValues) -> None:
        flat = torch.empty(unit.layout.total, dtype=self.dtype, device=self.device)
        for lo, hi in self.plan.pieces(unit):
            self.transfers.wait(
                self.transfers.to_device([(flat[lo:hi], values(lo, hi))]), "host->device"
            )
        self.flat[unit.index] = flat

    def attach(self, unit: Unit) -> None:
        flat = self.flat[unit.index]
        for seg in unit.layout.segments:
            seg.param.data = flat[seg.offset : seg.end].view(seg.shape)
        self._gathered.add(unit.index)

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.writer.out(self.flat[unit.index], lo, hi)

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        self.writer.commit(self.flat[unit.index], lo, hi)

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        self.transfers.count("device->host", (hi - lo) * self.dtype.itemsize)
        return self.flat[unit.index][lo:hi].to("cpu", copy=True)

    def master_view(self, unit: Unit) -> torch.Tensor:
        lo, hi = unit.layout.local_trainable
        return self.flat[unit.index][lo:hi]

    def quiesce(self) -> None:
        self.writer.quiesce()


class _Released(ParamHome):
    """A home whose unit is gathered into the parameters' own storage and released after."""

    def __init__(self, plan: Plan, transfers: Transfers, memory: HostMemory) -> None:
        super().__init__(plan, transfers, memory)
        self.storage = storage_for(self.device, self.dtype)

    def attach(self, unit: Unit) -> None:
        """The unit's parameters get their storage and start released."""
        self.storage.attach(unit)
        self.storage.drop(unit)

    def reshard(self, unit: Unit) -> None:
        if unit.index in self._gathered:
            self.storage.drop(unit)
            self._gathered.discard(unit.index)

    def close(self) -> None:
        self.storage.close()


class HostParams(_Released):
    def __init__(self, plan: Plan, transfers: Transfers, memory: HostMemory, pin: bool) -> None:
        super().__init__(plan, transfers, memory)
        self.pin = pin
        self.flat: dict[int, torch.Tensor] = {}

    def create(self, unit: Unit, values: PieceValues) -> None:
        flat = self.memory.empty(unit.layout.total, self.dtype, self.pin)
        for lo, hi in self.plan.pieces(unit):
            flat[lo:hi].copy_(values(lo, hi))
        self.flat[unit.index] = flat

    def unshard(self, unit: Unit) -> None:
        if unit.index in self._gathered:
            return
        self.storage.make_room(unit)
        flat = self.flat[unit.index]
        self._pending = self.transfers.to_device(
            unit.layout.pairs(0, unit.layout.total, flat, _param_view)
        )
        self._gathered.add(unit.index)

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.flat[unit.index][lo:hi]

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.flat[unit.index][lo:hi].clone()

    def master_view(self, unit: Unit) -> torch.Tensor:
        lo, hi = unit.layout.local_trainable
        return self.flat[unit.index][lo:hi]


class NvmeParams(_Released):
    """Compute params on NVMe, one store shard ``param.u<unit>.<lo>`` per piece."""

    def __init__(self, plan: Plan, transfers: Transfers, memory: HostMemory, store) -> None:
        from offload.store import Tier  # noqa: PLC0415

        super().__init__(plan, transfers, memory)
        self.store, self.tier, self._nvme = store, Tier.HOST, Tier.NVME
        self.window = plan.placement.param_window

    @staticmethod
    def key(unit: Unit, lo: int) -> str:
        return f"param.u{unit.index}.{lo}"

    def create(self, unit: Unit, values: PieceValues) -> None:
        for lo, hi in self.plan.pieces(unit):
            self.store.register(
                self.key(unit, lo), hi - lo, self.dtype, self._nvme, init=values(lo, hi)
            )

    def unshard(self, unit: Unit) -> None:
        if unit.index in self._gathered:
            return
        self.storage.make_room(unit)
        pieces = self.plan.pieces(unit)
        fetching: deque = deque()  # (lo, hi) of the pieces fetched, not copied yet
        copying: deque = deque()  # (key, event): a pool buffer whose copy up is in flight
        try:
            self._stream_in(unit, pieces, fetching, copying)
        except BaseException:  # a failed read: let go of every piece, the unit stays released
            keys = [self.key(unit, a) for a, _ in fetching]
            steps = [lambda k=k: self.store.release(k, self.tier) for k in keys]
            steps += [lambda c=c: self._give_back(*c) for c in copying]
            for step in steps:
                with contextlib.suppress(Exception):  # the read's own error is the one raised
                    step()
            self.storage.drop(unit)
            raise
        self._gathered.add(unit.index)

    def _stream_in(self, unit: Unit, pieces, fetching: deque, copying: deque) -> None:
        """The gather's loop (see the module Note on its window); what it holds is in
        ``fetching`` and ``copying`` at any moment."""
        futures: deque = deque()  # the fetches of ``fetching``, once made
        ahead = copied = 0
        while copied < len(pieces):
            while ahead < len(pieces) and len(fetching) + len(copying) < self.window:
                a, b = pieces[ahead]
                key = self.key(unit, a)
                # the use is recorded as the piece is pinned: a recorded, unpinned piece would
                # look used already to the eviction planner and be the first given up
                self.store.use(key, self.tier)
                fetching.append((a, b))  # held from here, even if the fetch is refused
                futures.append(self.store.fetch(key, self.tier))
                ahead += 1
            if not fetching:  # the window is full of copies: the oldest gives its buffer back
                self._give_back(*copying[0])
                copying.popleft()
                continue
            a, b = fetching[0]
            event = self.transfers.to_device(
                unit.layout.pairs(a, b, futures[0].wait(), _param_view)
            )
            fetching.popleft()
            futures.popleft()
            copying.append((self.key(unit, a), event))
            copied += 1
            while copying and copying[0][1].done():
                self.store.release(copying[0][0], self.tier)
                copying.popleft()
        while copying:
            self._give_back(*copying[0])
            copying.popleft()

    def _give_back(self, key: str, event: Event) -> None:
        self.transfers.wait(event, "host->device")
        self.store.release(key, self.tier)

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.store.fetch(self.key(unit, lo), self.tier, read=False).wait()

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        self.store.release(self.key(unit, lo), self.tier, dirty=True)

    def give_up_out(self, unit: Unit, lo: int, hi: int) -> None:
        self.store.release(self.key(unit, lo), self.tier, discard=True)

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=self.dtype)
        self.store.read_into(self.key(unit, lo), out)
        return out

    def load_shard(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        self.store.write_from(self.key(unit, lo), values.to(self.dtype).contiguous())
