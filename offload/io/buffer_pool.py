"""``BufferPool``: a fixed set of aligned (pinned when possible) host buffers.

Note: one allocation. The pool makes a single :func:`aligned_empty` allocation of
``buffer_count`` slots, each ``buffer_size`` rounded up to 4096 bytes, and hands out views of
it. One allocation means one pinning call (pinning is slow and fragments the host), every
buffer is 4096-aligned for O_DIRECT, and the whole footprint is known in advance through
:meth:`BufferPool.required_bytes` so a caller can refuse a config that does not fit in RAM before
anything is allocated.

Note: exhaustion. ``acquire`` blocks on a condition variable until a buffer is released or its
timeout expires, then raises :class:`PoolExhaustedError` naming buffer_count and buffer_size;
it never waits forever unless the pool's timeout is set to ``math.inf`` explicitly.
"""

from __future__ import annotations

import threading
import time

import torch

from offload._interrupts import wait
from offload.io.aligned import ALIGN, aligned_empty, round_up
from offload.io.errors import PoolExhaustedError


class BufferPool:
    """``buffer_count`` host buffers of ``buffer_size`` bytes each, allocated once.

    Args:
        buffer_count: number of buffers (count, >= 1).
        buffer_size: bytes per buffer (>= 1); each slot is padded to a multiple of 4096.
        pin: page-lock the buffers (what the device's pinning policy says).
        timeout: default seconds ``acquire`` waits for a free buffer before raising.
    """

    def __init__(
        self, buffer_count: int, buffer_size: int, *, pin: bool = False, timeout: float = 60.0
    ) -> None:
        _check(buffer_count, buffer_size)
        if timeout is None or timeout < 0:
            raise ValueError(f"BufferPool timeout={timeout!r}; allowed: seconds >= 0")
        self._count = buffer_count
        self._size = buffer_size
        self._slot = round_up(buffer_size)
        self.timeout = float(timeout)
        self._storage: torch.Tensor | None = aligned_empty(self._slot * buffer_count, pin=pin)
        self.pinned = bool(self._storage.is_pinned()) if buffer_count else False
        self._buffers = [
            self._storage[i * self._slot : i * self._slot + buffer_size]
            for i in range(buffer_count)
        ]
        self._index = {b.data_ptr(): i for i, b in enumerate(self._buffers)}
        self._free = list(range(buffer_count - 1, -1, -1))  # stack: lowest index first
        # Entered as `with self._lock`: a C lock's __enter__ runs no Python line after it
        # acquires, where a Ctrl-C on the main thread would leave the lock held for good (as
        # Condition.__enter__ can: then every other thread's release hangs)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    @staticmethod
    def required_bytes(buffer_count: int, buffer_size: int) -> int:
        """Host bytes a pool of this shape allocates (slots padded to 4096, plus alignment slack)."""
        _check(buffer_count, buffer_size)
        return buffer_count * round_up(buffer_size) + ALIGN - 1

    @property
    def buffer_count(self) -> int:
        """Number of buffers (count)."""
        return self._count

    @property
    def buffer_size(self) -> int:
        """Bytes per buffer."""
        return self._size

    @property
    def free_count(self) -> int:
        """Buffers available to :meth:`acquire` right now (count)."""
        with self._lock:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> torch.Tensor:
        """A free buffer (uint8, ``buffer_size`` bytes, 4096-aligned); blocks while none is free.

        Args:
            timeout: seconds to wait; ``None`` uses the pool's timeout.

        Raises:
            PoolExhaustedError: still no free buffer after ``timeout`` seconds.
        """
        wait_s = self.timeout if timeout is None else timeout
        with self._lock:
            if self._storage is None:
                raise RuntimeError("BufferPool is closed")
            deadline = None if wait_s == float("inf") else time.monotonic() + wait_s
            while not self._free:  # (not Condition.wait_for: see offload._interrupts, waits)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise PoolExhaustedError(
                        110,
                        f"BufferPool exhausted: all buffer_count={self._count} buffers of "
                        f"buffer_size={self._size} bytes stayed in use for {wait_s:g} s; "
                        "release buffers sooner or raise buffer_count",
                    )
                wait(self._cond, left)
            return self._buffers[self._free.pop()]

    def try_acquire(self) -> torch.Tensor | None:
        """A free buffer, or None when none is free now (never blocks). Its caller records the
        buffer it got in the same block for a Ctrl-C (``offload._interrupts``): one raised as
        this returns would leave the buffer out of the pool with no owner."""
        with self._lock:
            if self._storage is None:
                raise RuntimeError("BufferPool is closed")
            return self._buffers[self._free.pop()] if self._free else None

    def wait_free(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for a buffer to be free, taking none (a Ctrl-C may
        end the wait: nothing changed hands); whether one is free now."""
        with self._lock:
            if not self._free and self._storage is not None:
                wait(self._cond, timeout)
            return bool(self._free)

    def release(self, buf: torch.Tensor) -> None:
        """Return a buffer obtained from :meth:`acquire` (the same tensor or a view at its start)."""
        i = self._index.get(buf.data_ptr())
        with self._lock:
            if i is None:
                raise ValueError(
                    f"BufferPool.release: tensor at 0x{buf.data_ptr():x} is not a buffer of this pool"
                )
            if i in self._free:
                raise ValueError(f"BufferPool.release: buffer {i} was released twice")
            self._free.append(i)
            self._cond.notify()

    def close(self) -> None:
        """Drop the pool's memory (buffers still held by callers stay valid until dropped)."""
        with self._lock:
            self._storage = None
            self._buffers = []
            self._free = []
            self._cond.notify_all()

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"BufferPool(buffer_count={self._count}, buffer_size={self._size}, "
            f"free={self.free_count}, pinned={self.pinned})"
        )


def _check(buffer_count: int, buffer_size: int) -> None:
    for name, v in (("buffer_count", buffer_count), ("buffer_size", buffer_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"BufferPool {name}={v!r}; allowed: an integer >= 1")
