"""Where each unit's compute parameters live between uses (``offload_param.device``).

One strategy object is picked at wrap time; the hooks call the same four methods whatever it is:

- :class:`DeviceParams` (``"none"``): a flat device buffer per unit, the parameters are views into
  it and never released. The optimizer writes updated values into it (on CUDA through a pinned
  host staging buffer and one copy per piece).
- :class:`HostParams` (``"cpu"``): the home is a flat host buffer (pinned on CUDA); a forward or
  backward gathers the unit into the parameters' own storages and releases them after.
- :class:`NvmeParams` (``"nvme"``): the home is NVMe, one shard per piece, streamed through the
  ``offload_param`` buffer pool by the tiered store (whose trace-driven prefetcher brings the next
  units in while this one computes).

Note: gather and release keep the Parameter objects
    Releasing frees a parameter's storage in place (``untyped_storage().resize_(0)``); gathering
    resizes it back and copies into ``p.data``, which does not bump the autograd version counter,
    so tensors that autograd saved in forward stay valid for backward. Nobody outside sees a new
    tensor. With the compute on the CPU (Linux) the storages are instead views into one block
    per unit whose pages are handed back to the OS on release (``offload.engine.pages``).
"""

from __future__ import annotations

from collections import deque

import torch

from offload.engine import pages
from offload.engine.layout import FlatLayout
from offload.engine.transfer import Transfers
from offload.engine.units import Unit, alloc_storage, free_storage


def flatten_values(layout: FlatLayout, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """A new host tensor with elements ``[lo, hi)`` of the unit's flat buffer, from the params'
    current values (zero in the padding). Used once at wrap time."""
    out = torch.zeros(hi - lo, dtype=dtype)
    for seg, a, b in layout.overlaps(lo, hi):
        src = seg.param.detach().reshape(-1)[a:b]
        out[seg.offset + a - lo : seg.offset + b - lo].copy_(src)
    return out


def _copy_pairs(layout: FlatLayout, flat: torch.Tensor, lo: int, hi: int):
    """(param slice, flat slice) pairs for the part of ``[lo, hi)`` covered by parameters, where
    ``flat`` holds elements ``[lo, hi)``."""
    pairs = []
    for seg, a, b in layout.overlaps(lo, hi):
        dst = seg.param.data.view(-1)[a:b]
        pairs.append((dst, flat[seg.offset + a - lo : seg.offset + b - lo]))
    return pairs


class ParamHome:
    """Interface of the parameter placement strategies."""

    _pending = None  # event of the last copy out of the host home (HostParams)

    def setup(self, unit: Unit) -> None:
        """Takes the unit's current parameter values as its home copy (wrap time)."""
        raise NotImplementedError

    def gather(self, unit: Unit) -> None:
        """Makes the unit's parameters usable on the compute device (idempotent)."""

    def release(self, unit: Unit) -> None:
        """Frees the unit's device copies (idempotent)."""

    def pieces_in(self, unit: Unit, lo: int, hi: int) -> list[tuple[int, int]]:
        """The ranges, covering ``[lo, hi)``, that :meth:`out_buffer`, :meth:`read` and
        :meth:`write` accept (the home's own pieces; one range when it has none)."""
        return [(lo, hi)] if hi > lo else []

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        """Where the optimizer writes updated compute values of elements ``[lo, hi)``."""
        raise NotImplementedError

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        """The optimizer finished writing ``out_buffer(unit, lo, hi)``."""

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        """Current compute values of elements ``[lo, hi)`` as a host tensor (checkpoints)."""
        raise NotImplementedError

    def write(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        """Overwrites compute values of elements ``[lo, hi)`` (checkpoint load)."""
        out = self.out_buffer(unit, lo, hi)
        out.copy_(values)
        self.commit(unit, lo, hi)

    def quiesce(self) -> None:
        """Waits until no copy out of the host home is in flight (before the step rewrites it)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def master_alias(self, unit: Unit) -> torch.Tensor | None:
        """A host fp32 tensor over ``[0, trainable)`` that may double as the fp32 master (so the
        step updates the compute params in place), or None."""
        return None

    def close(self) -> None:
        if self._blocks is not None:
            self._blocks.close()

    # released storage, shared by HostParams and NvmeParams (see the module Note)
    _blocks: pages.PageBlocks | None = None

    def _detach(self, unit: Unit) -> None:
        """Wrap time: the unit's parameters start released."""
        if self._blocks is not None:
            self._blocks.attach(unit)
            self._blocks.drop(unit)
            return
        for seg in unit.layout.segments:
            seg.param.data = torch.empty(seg.shape, dtype=self.dtype, device=self.device)
            free_storage(seg.param)

    def _make_room(self, unit: Unit) -> None:
        if self._blocks is None:
            for p in unit.params:
                alloc_storage(p)

    def _free(self, unit: Unit) -> None:
        if self._blocks is not None:
            self._blocks.drop(unit)
        else:
            for p in unit.params:
                free_storage(p)


class DeviceParams(ParamHome):
    def __init__(self, device: torch.device, dtype: torch.dtype, transfers: Transfers) -> None:
        self.device, self.dtype, self.transfers = device, dtype, transfers
        self.flat: dict[int, torch.Tensor] = {}
        self._staging: torch.Tensor | None = None

    def setup(self, unit: Unit) -> None:
        layout = unit.layout
        values = flatten_values(layout, 0, layout.total, self.dtype)
        flat = values.to(self.device) if self.device.type != "cpu" else values
        for seg in layout.segments:
            seg.param.data = flat[seg.offset : seg.end].view(seg.shape)
        self.flat[unit.index] = flat
        unit.gathered = True

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        if self.device.type == "cpu":
            return self.flat[unit.index][lo:hi]
        if self._staging is None or self._staging.numel() < hi - lo:
            self._staging = self.transfers.host_empty(hi - lo, self.dtype, pin=True)
        return self._staging[: hi - lo]

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        if self.device.type != "cpu":
            pair = (self.flat[unit.index][lo:hi], self._staging[: hi - lo])
            self.transfers.to_device([pair]).wait()  # the staging buffer is reused next piece

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.flat[unit.index][lo:hi].to("cpu", copy=True)

    def master_alias(self, unit: Unit) -> torch.Tensor | None:
        flat = self.flat[unit.index]
        if flat.device.type == "cpu" and flat.dtype == torch.float32:
            return flat[: unit.layout.trainable]
        return None


class HostParams(ParamHome):
    def __init__(
        self, device: torch.device, dtype: torch.dtype, transfers: Transfers, pin: bool
    ) -> None:
        self.device, self.dtype, self.transfers, self.pin = device, dtype, transfers, pin
        self.flat: dict[int, torch.Tensor] = {}
        self._blocks = pages.blocks_for(device, dtype)

    def setup(self, unit: Unit) -> None:
        layout = unit.layout
        flat = self.transfers.host_empty(layout.total, self.dtype, self.pin)
        flat.copy_(flatten_values(layout, 0, layout.total, self.dtype))
        self.flat[unit.index] = flat
        self._detach(unit)
        unit.gathered = False

    def gather(self, unit: Unit) -> None:
        if unit.gathered:
            return
        self._make_room(unit)
        flat = self.flat[unit.index]
        self._pending = self.transfers.to_device(
            _copy_pairs(unit.layout, flat, 0, unit.layout.total)
        )
        unit.gathered = True

    def release(self, unit: Unit) -> None:
        if not unit.gathered:
            return
        self._free(unit)
        unit.gathered = False

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.flat[unit.index][lo:hi]

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.flat[unit.index][lo:hi].clone()

    def master_alias(self, unit: Unit) -> torch.Tensor | None:
        if self.dtype == torch.float32:
            return self.flat[unit.index][: unit.layout.trainable]
        return None


class NvmeParams(ParamHome):
    """Compute params on NVMe, one store shard per piece (pieces never straddle the trainable
    prefix's end, so the optimizer can overwrite a trainable piece without reading it)."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        transfers: Transfers,
        store,
        piece_numel: int,
        window: int,
    ) -> None:
        from offload.store import Tier  # noqa: PLC0415

        self.device, self.dtype, self.transfers = device, dtype, transfers
        self.store, self.piece_numel, self.tier = store, piece_numel, Tier.HOST
        self.window = max(1, window)  # pieces fetched ahead while gathering one unit
        self._tier_mod = Tier
        self.pieces: dict[int, list[tuple[int, int]]] = {}
        self._blocks = pages.blocks_for(device, dtype)

    @staticmethod
    def key(unit: Unit, lo: int) -> str:
        return f"param.u{unit.index}.{lo}"

    def setup(self, unit: Unit) -> None:
        layout = unit.layout
        pieces = layout.pieces(self.piece_numel, layout.trainable)
        pieces += [
            (layout.trainable + a, layout.trainable + b)
            for a, b in FlatLayout.pieces(layout, self.piece_numel, layout.total - layout.trainable)
        ]
        self.pieces[unit.index] = pieces
        for lo, hi in pieces:
            init = flatten_values(layout, lo, hi, self.dtype)
            self.store.register(
                self.key(unit, lo), hi - lo, self.dtype, self._tier_mod.NVME, init=init
            )
        self._detach(unit)
        unit.gathered = False

    def pieces_in(self, unit: Unit, lo: int, hi: int) -> list[tuple[int, int]]:
        return [(a, b) for a, b in self.pieces[unit.index] if a >= lo and b <= hi]

    def gather(self, unit: Unit) -> None:
        if unit.gathered:
            return
        self._make_room(unit)
        pieces = self.pieces[unit.index]
        for lo, _ in pieces:
            self.store.use(self.key(unit, lo), self.tier)
        # demand fetches run at most `window` pieces ahead: the pool must keep a buffer free
        inflight: deque = deque()
        for i in range(len(pieces)):
            while len(inflight) < self.window and i + len(inflight) < len(pieces):
                a, b = pieces[i + len(inflight)]
                inflight.append((a, b, self.store.fetch(self.key(unit, a), self.tier)))
            a, b, fut = inflight.popleft()
            buf = fut.wait()
            # the pool buffer goes back to the store next line: wait for this copy's event
            self.transfers.to_device(_copy_pairs(unit.layout, buf, a, b)).wait()
            self.store.release(self.key(unit, a), self.tier)
        unit.gathered = True

    def release(self, unit: Unit) -> None:
        if not unit.gathered:
            return
        self._free(unit)
        unit.gathered = False

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.store.fetch(self.key(unit, lo), self.tier, read=False).wait()

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        self.store.release(self.key(unit, lo), self.tier, dirty=True)

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=self.dtype)
        self.store.read_into(self.key(unit, lo), out)
        return out

    def write(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        self.store.write_from(self.key(unit, lo), values.to(self.dtype).contiguous())
