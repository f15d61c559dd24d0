"""One shard's record: its copies, its state and the transfer in flight, moved by checked methods.

Note: the record is bookkeeping only
    A ``Shard`` never starts IO or copies; the store does that and then calls the matching
    transition here, which checks that the shard is in a state that accepts it (and that the move
    is in ``state.LEGAL_TRANSITIONS``) before changing anything. Every in-flight move is a
    ``Transfer`` record holding what completes it (an ``IOHandle`` or a device ``Event``); a shard
    has at most one, in ``pending``, and its destination is not readable until the transfer has
    been waited on and ``finish_pending`` has run.

    Pins count fetches not yet released, per tier. A pinned copy is never evicted, and by the
    inclusive hierarchy (see ``state.py``) a pinned device copy also keeps its host buffer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from offload.store.budget import Slab
from offload.store.state import IN_FLIGHT, ShardState, Tier, base_state, check_transition

logger = logging.getLogger("offload.store")


@dataclass(eq=False, slots=True)
class Transfer:
    """One asynchronous move of a shard's bytes from ``src`` to ``dst``."""

    src: Tier
    dst: Tier
    nbytes: int
    handle: Any
    """What completes it: an ``IOHandle`` or a device ``Event`` (both have ``wait``/``done``)."""
    keep: Any = None
    """Anything that must stay alive until the transfer completes (e.g. a staging buffer)."""
    issued: float = field(default_factory=time.perf_counter)

    @property
    def pair(self) -> str:
        return f"{self.src.name.lower()}->{self.dst.name.lower()}"

    def done(self) -> bool:
        return bool(self.handle.done())

    def wait(self) -> float:
        """Block until complete; returns the seconds spent blocked."""
        if self.handle.done():
            self.handle.wait()  # surfaces an IO error even when already complete
            return 0.0
        start = time.perf_counter()
        self.handle.wait()
        return time.perf_counter() - start


@dataclass(eq=False, slots=True)
class Shard:
    """A registered shard: ``numel`` elements of ``dtype`` homed at ``home``."""

    key: str
    numel: int
    dtype: torch.dtype
    home: Tier
    io_nbytes: int
    """Bytes moved to and from NVMe (``nbytes`` rounded up to 4096 when the buffer allows)."""
    state: ShardState = ShardState.NVME
    home_tensor: torch.Tensor | None = None
    """The home copy of a host- or device-homed shard (typed, ``numel`` elements)."""
    host_buf: torch.Tensor | None = None
    """The pool buffer holding the host copy of an NVMe-homed shard (uint8, whole buffer)."""
    slab: Slab | None = None
    """The device slab holding the cached device copy."""
    pending: Transfer | None = None
    pins: list[int] = field(default_factory=lambda: [0, 0, 0])
    """Outstanding fetches per tier (indexed by ``Tier``)."""
    dirty: bool = False
    """The top copy is newer than the home (set on a dirty release or a ``read=False`` fetch)."""
    last_used: int = 0
    """Logical clock of the last use/fetch (LRU before a trace exists)."""

    def __post_init__(self) -> None:
        self.state = base_state(self.home)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    # -- views -------------------------------------------------------------------------------
    def host_view(self) -> torch.Tensor:
        """The host copy as ``numel`` elements of ``dtype`` (caller checks it is valid)."""
        if self.home is Tier.HOST:
            assert self.home_tensor is not None
            return self.home_tensor
        assert self.host_buf is not None, self.key
        return self.host_buf[: self.nbytes].view(self.dtype)

    def host_io_view(self) -> torch.Tensor:
        """The host buffer bytes moved to and from NVMe (``io_nbytes``)."""
        assert self.host_buf is not None, self.key
        return self.host_buf[: self.io_nbytes]

    def device_view(self) -> torch.Tensor:
        """The device copy as ``numel`` elements of ``dtype`` (caller checks it is valid)."""
        if self.home is Tier.DEVICE:
            assert self.home_tensor is not None
            return self.home_tensor
        assert self.slab is not None, self.key
        return self.slab.memory[: self.nbytes].view(self.dtype)

    def pinned(self) -> bool:
        return any(self.pins)

    def ready_at(self, tier: Tier) -> bool:
        """Whether a valid copy at ``tier`` can be handed out now (nothing in flight)."""
        if self.state is ShardState.DEVICE:
            return True
        return self.state is ShardState.HOST and tier <= Tier.HOST

    def heading_to(self, tier: Tier) -> bool:
        """Whether the data is at ``tier`` or already moving there (a transfer in flight)."""
        if tier is Tier.DEVICE:
            return self.state in (ShardState.TO_DEVICE, ShardState.DEVICE, ShardState.FLUSHING) or (
                self.state is ShardState.WRITING_BACK and self.slab is not None
            )
        return self.state is not ShardState.NVME

    # -- transitions (see state.LEGAL_TRANSITIONS) ----------------------------------------------
    def _move(self, accepted: tuple[ShardState, ...], new: ShardState, what: str) -> None:
        if self.state not in accepted:
            names = ", ".join(s.name for s in accepted)
            raise RuntimeError(
                f"shard {self.key!r}: {what} needs state {names}, but it is {self.state.name}"
            )
        check_transition(self.key, self.state, new)
        logger.debug("offload::store %s %s: %s -> %s", what, self.key, self.state.name, new.name)
        self.state = new

    def load_host(self, buf: torch.Tensor, transfer: Transfer | None) -> None:
        """NVME -> TO_HOST (a read into ``buf`` is in flight) or -> HOST (no read: read=False)."""
        self._move((ShardState.NVME,), ShardState.HOST if transfer is None else ShardState.TO_HOST,
                   "load_host")  # fmt: skip
        self.host_buf = buf
        self.pending = transfer

    def load_device(self, slab: Slab | None, transfer: Transfer | None) -> None:
        """HOST -> TO_DEVICE (a copy into ``slab`` is in flight) or -> DEVICE (read=False)."""
        new = ShardState.DEVICE if transfer is None else ShardState.TO_DEVICE
        self._move((ShardState.HOST,), new, "load_device")
        self.slab = slab
        self.pending = transfer

    def flush(self, transfer: Transfer) -> None:
        """DEVICE -> FLUSHING: a dirty device copy is being copied into the host copy."""
        self._move((ShardState.DEVICE,), ShardState.FLUSHING, "flush")
        self.pending = transfer
        self.dirty = False

    def write_back(self, transfer: Transfer) -> None:
        """HOST or FLUSHING -> WRITING_BACK: the host copy is being written to NVMe."""
        if self.state is ShardState.FLUSHING:
            assert self.pending is None, "finish the device -> host copy first"
        self._move((ShardState.HOST, ShardState.FLUSHING), ShardState.WRITING_BACK, "write_back")
        self.pending = transfer
        self.dirty = False

    def finish_pending(self) -> Transfer:
        """Mark the (already waited) pending transfer complete; returns it.

        TO_HOST -> HOST, TO_DEVICE -> DEVICE, WRITING_BACK -> DEVICE or HOST (whichever copy is
        on top). FLUSHING stays FLUSHING for NVMe-homed shards (the store chains the disk write)
        and becomes DEVICE for host-homed ones.
        """
        transfer = self.pending
        if transfer is None or self.state not in IN_FLIGHT:
            raise RuntimeError(f"shard {self.key!r}: nothing in flight (state {self.state.name})")
        self.pending = None
        if self.state is ShardState.TO_HOST:
            self._move((ShardState.TO_HOST,), ShardState.HOST, "loaded_host")
        elif self.state is ShardState.TO_DEVICE:
            self._move((ShardState.TO_DEVICE,), ShardState.DEVICE, "loaded_device")
        elif self.state is ShardState.FLUSHING:
            if self.home is Tier.HOST:
                self._move((ShardState.FLUSHING,), ShardState.DEVICE, "flushed")
        else:
            top = ShardState.DEVICE if self.slab is not None else ShardState.HOST
            self._move((ShardState.WRITING_BACK,), top, "written_back")
        return transfer

    def abort_pending(self) -> torch.Tensor | None:
        """Undo a transfer that failed (or was refused at submission).

        TO_HOST -> NVME (returns the host buffer to give back); WRITING_BACK or FLUSHING ->
        the copy on top, dirty again (nothing was lost: the source copy is intact).
        """
        self.pending = None
        if self.state is ShardState.TO_HOST:
            self._move((ShardState.TO_HOST,), ShardState.NVME, "abort_load")
            buf, self.host_buf = self.host_buf, None
            return buf
        top = ShardState.DEVICE if self.slab is not None else ShardState.HOST
        if self.home is Tier.DEVICE:
            top = ShardState.DEVICE
        self._move((ShardState.WRITING_BACK, ShardState.FLUSHING), top, "abort_write_back")
        self.dirty = True
        return None

    def drop_device(self) -> Slab | None:
        """DEVICE -> HOST: forget the device copy; returns its slab (to the budget)."""
        if self.home is Tier.DEVICE:
            raise RuntimeError(f"shard {self.key!r}: the device copy is its home; cannot drop it")
        self._move((ShardState.DEVICE,), ShardState.HOST, "drop_device")
        slab, self.slab = self.slab, None
        return slab

    def drop_host(self) -> torch.Tensor:
        """HOST -> NVME: forget the host copy of an NVMe-homed shard; returns its pool buffer."""
        if self.home is not Tier.NVME:
            raise RuntimeError(f"shard {self.key!r}: the host copy is its home; cannot drop it")
        self._move((ShardState.HOST,), ShardState.NVME, "drop_host")
        buf, self.host_buf = self.host_buf, None
        assert buf is not None
        return buf
