"""One shard's record: its copies, its state and the transfer in flight, moved by checked methods.

Note: the record is bookkeeping only
    A ``Shard`` never starts IO; the store does that and then calls the matching transition
    here, which checks that the shard is in a state that accepts it (and that the move is in
    ``state.LEGAL_TRANSITIONS``) before changing anything. Every in-flight move is a
    ``Transfer`` record holding what completes it (an ``IOHandle``); a shard has at most one, in
    ``pending``, and its destination is not readable until the transfer has been waited on and
    ``finish_pending`` has run.

    ``pins`` counts fetches not yet released. A pinned copy is never evicted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from offload.store.state import IN_FLIGHT, ShardState, Tier, base_state, check_transition

logger = logging.getLogger("offload.store")


@dataclass(eq=False, slots=True)
class Transfer:
    """One asynchronous move of a shard's bytes from ``src`` to ``dst``."""

    src: Tier
    dst: Tier
    nbytes: int
    handle: Any
    """What completes it: an ``IOHandle`` (``wait``/``done``)."""
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
    """The home copy of a host-homed shard (typed, ``numel`` elements)."""
    host_buf: torch.Tensor | None = None
    """The pool buffer holding the host copy of an NVMe-homed shard (uint8, whole buffer)."""
    pending: Transfer | None = None
    pins: int = 0
    """Outstanding fetches (count)."""
    dirty: bool = False
    """The host copy is newer than the home (set on a dirty release or a ``read=False`` fetch)."""
    last_used: int = 0
    """Logical clock of the last use/fetch (LRU before a trace exists)."""
    extent: str = ""
    """The NVMe extent (``NvmeStore`` key) holding the shard's committed value."""
    shadow: str | None = None
    """A versioned shard's second extent: where a version's writes go (see store.py)."""
    failed_read: Exception | None = None
    """A read of it that failed where no caller of its own was waiting (a prefetch): kept for
    its next fetch, dropped once its value is replaced (store.py, the Note on whose error)."""

    def __post_init__(self) -> None:
        self.state = base_state(self.home)
        self.extent = self.extent or self.key

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

    def pinned(self) -> bool:
        return self.pins > 0

    def ready(self) -> bool:
        """Whether a valid host copy can be handed out now (nothing in flight)."""
        return self.state is ShardState.HOST

    def heading_home(self) -> bool:
        """Whether the data is in host memory or already moving there."""
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

    def write_back(self, transfer: Transfer) -> None:
        """HOST -> WRITING_BACK: the host copy is being written to NVMe."""
        self._move((ShardState.HOST,), ShardState.WRITING_BACK, "write_back")
        self.pending = transfer
        self.dirty = False

    def finish_pending(self) -> Transfer:
        """Mark the (already waited) pending transfer complete; returns it.
        TO_HOST -> HOST, WRITING_BACK -> HOST."""
        transfer = self.pending
        if transfer is None or self.state not in IN_FLIGHT:
            raise RuntimeError(f"shard {self.key!r}: nothing in flight (state {self.state.name})")
        self.pending = None
        what = "loaded_host" if self.state is ShardState.TO_HOST else "written_back"
        self._move((ShardState.TO_HOST, ShardState.WRITING_BACK), ShardState.HOST, what)
        return transfer

    def abort_pending(self) -> torch.Tensor | None:
        """Undo a transfer that failed (or was refused at submission).

        TO_HOST -> NVME (returns the host buffer to give back); WRITING_BACK -> HOST, dirty
        again (nothing was lost: the host copy is intact).
        """
        self.pending = None
        if self.state is ShardState.TO_HOST:
            self._move((ShardState.TO_HOST,), ShardState.NVME, "abort_load")
            buf, self.host_buf = self.host_buf, None
            return buf
        self._move((ShardState.WRITING_BACK,), ShardState.HOST, "abort_write_back")
        self.dirty = True
        return None

    def drop_host(self) -> torch.Tensor:
        """HOST -> NVME: forget the host copy of an NVMe-homed shard; returns its pool buffer."""
        if self.home is not Tier.NVME:
            raise RuntimeError(f"shard {self.key!r}: the host copy is its home; cannot drop it")
        self._move((ShardState.HOST,), ShardState.NVME, "drop_host")
        buf, self.host_buf = self.host_buf, None
        assert buf is not None
        return buf
