"""Hard budgets: host buffers from the ``BufferPool``, device bytes in reusable slabs.

Note: budgets are allocated, not estimated
    The host budget *is* the ``BufferPool``: ``buffer_count`` buffers of ``buffer_size`` bytes,
    allocated once by the pool. A cached host copy of an NVMe-homed shard occupies one buffer, so
    "within budget" is checked twice: by our own count (``in_use <= capacity``) and by the pool,
    which cannot hand out more than it has.

    The device budget is a byte count backed by slabs. A slab is one device allocation sized to a
    shard rounded up to 4096 bytes (its *size class*); when a shard leaves the device its slab goes
    back to a free list of its class and the next shard of that class reuses it, so a steady-state
    step allocates nothing. Only when the mix of shard sizes changes are idle slabs of another
    class freed to make room. A budget of 0 means "no cap": slabs are still reused, but the store
    then keeps no released copies on the device (see ``store.py``).

    This module never blocks and never evicts: it says yes or no, and the store decides whom to
    evict (``planner.py``) and when to wait.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SLAB_ALIGN = 4096
"""Device slab sizes are multiples of this many bytes."""


def round_up(nbytes: int, align: int = SLAB_ALIGN) -> int:
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


@dataclass(eq=False, slots=True)
class Slab:
    """One reusable device allocation; ``memory`` is whatever the allocator returned."""

    nbytes: int
    memory: Any
    fence: Any = None
    """The compute-stream event recorded at the last release of the copy it holds (CUDA)."""


class DeviceBudget:
    """A byte budget of device memory handed out as reusable, size-classed slabs.

    Args:
        budget: bytes; 0 = no cap.
        allocate: ``nbytes -> memory`` (a device tensor in the store; plain objects in tests).
    """

    def __init__(self, budget: int, allocate: Callable[[int], Any]) -> None:
        if not isinstance(budget, int) or budget < 0:
            raise ValueError(
                f"device_budget must be an integer number of bytes >= 0, got {budget!r}"
            )
        self.budget = budget
        self._allocate = allocate
        self._free: dict[int, list[Slab]] = {}
        self.allocated = 0
        """Bytes of slabs that exist (in use or idle)."""
        self.in_use = 0
        """Bytes of slabs holding a shard now."""
        self.peak_allocated = 0
        self.peak_in_use = 0
        self.allocations = 0
        """Slab allocations ever made (steady state: constant)."""

    def fits(self, nbytes: int) -> bool:
        """Whether a shard of ``nbytes`` can ever fit (one slab within the budget)."""
        return self.budget == 0 or round_up(nbytes) <= self.budget

    def idle_bytes(self) -> int:
        """Bytes of allocated slabs not holding a shard."""
        return self.allocated - self.in_use

    def try_take(self, nbytes: int) -> Slab | None:
        """A slab of at least ``nbytes``, or ``None`` if the budget is full of slabs in use."""
        size = round_up(nbytes)
        free = self._free.get(size)
        if free:
            slab = free.pop()
        else:
            if self.budget and self.allocated + size > self.budget:
                self._trim(self.allocated + size - self.budget)
                if self.allocated + size > self.budget:
                    return None
            slab = Slab(size, self._allocate(size))
            self.allocated += size
            self.allocations += 1
            self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.in_use += size
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return slab

    def give(self, slab: Slab) -> None:
        """Return a slab to its class's free list (it stays allocated for reuse)."""
        self.in_use -= slab.nbytes
        self._free.setdefault(slab.nbytes, []).append(slab)

    def release_all(self) -> None:
        """Drop every idle slab (on close)."""
        self._trim(self.allocated)

    def _trim(self, want: int) -> None:
        # Free idle slabs (largest classes first) until ``want`` bytes are released or none is left.
        freed = 0
        for size in sorted(self._free, reverse=True):
            free = self._free[size]
            while free and freed < want:
                free.pop()
                self.allocated -= size
                freed += size
            if freed >= want:
                break
