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
        """A free buffer, or ``None`` when the pool has none free right now (never blocks)."""
        if self.in_use >= self.capacity or self.pool.free_count <= 0:
            return None
        return self._took(self.pool.acquire(timeout=1.0))

    def take_blocking(self, timeout: float | None) -> Any:
        """A buffer, waiting up to ``timeout`` seconds (the pool raises when none comes free)."""
        return self._took(self.pool.acquire(timeout=timeout))

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
