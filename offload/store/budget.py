"""The hard host budget: buffers from the ``BufferPool``.

Note: budgets are allocated, not estimated
    The host budget *is* the ``BufferPool``: ``buffer_count`` buffers of ``buffer_size`` bytes,
    allocated once by the pool. A cached host copy of an NVMe-homed shard occupies one buffer, so
    "within budget" is checked twice: by our own count (``in_use <= capacity``) and by the pool,
    which cannot hand out more than it has.

    This module never blocks and never evicts: it says yes or no, and the store decides whom to
    evict (``planner.py``) and when to wait.
"""

from __future__ import annotations

from typing import Any

IO_ALIGN = 4096
"""NVMe transfers are multiples of this many bytes."""


def round_up(nbytes: int, align: int = IO_ALIGN) -> int:
    """``nbytes`` rounded up to a multiple of ``align``."""
    return -(-nbytes // align) * align


class HostBudget:
    """The store's view of a ``BufferPool``: non-blocking takes, counts and peaks."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.capacity: int = int(pool.buffer_count)
        """Buffers in the pool (count)."""
        self.buffer_size: int = int(pool.buffer_size)
        """Bytes per buffer."""
        self.in_use = 0
        """Buffers the store holds now (count)."""
        self.peak = 0
        """Most buffers held at once (count)."""

    def try_take(self) -> Any | None:
        """A free buffer, or ``None`` when the pool has none free right now (never blocks).
        Called with Ctrl-C held back by the caller, who gives the buffer an owner in the same
        block (the store's Note on Ctrl-C and IO in flight)."""
        if self.in_use >= self.capacity:
            return None
        buf = self.pool.try_acquire()
        return None if buf is None else self._took(buf)

    def wait_free(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for the pool to have a free buffer, taking none."""
        self.pool.wait_free(timeout)

    def give(self, buf: Any) -> None:
        """Return a buffer to the pool."""
        self.pool.release(buf)
        self.in_use -= 1

    def _took(self, buf: Any) -> Any:
        self.in_use += 1
        self.peak = max(self.peak, self.in_use)
        if self.in_use > self.capacity:  # the pool handed out more than it has: a bug there
            raise RuntimeError(
                f"host budget exceeded: {self.in_use} buffers in use, pool has {self.capacity}"
            )
        return buf
