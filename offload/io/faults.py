"""Test-only fault injection at the syscall boundary of both IO backends.

``inject(errno.EIO, count=2, op="write")`` makes the next two write syscalls of any engine
(native or thread fallback) fail with EIO, as if the kernel had returned it; ``op="open_direct"``
makes O_DIRECT opens fail instead (EINVAL simulates a filesystem without O_DIRECT); ``clear()``
undoes it. Used by the tests to exercise error paths that a healthy disk never takes.
"""

from __future__ import annotations

import threading

from offload import _native

_OPS = {"any": 0, "read": 1, "write": 2, "open_direct": 3}
_lock = threading.Lock()
_state = {"op": 0, "errno": 0, "count": 0}


def inject(err: int, count: int = 1, op: str = "any") -> None:
    """Make the next ``count`` read/write syscalls matching ``op`` fail with errno ``err``."""
    if op not in _OPS:
        raise ValueError(f"faults.inject: op={op!r}; allowed: {', '.join(_OPS)}")
    if count < 0 or err < 0:
        raise ValueError(f"faults.inject: count and errno must be >= 0, got {count}, {err}")
    with _lock:
        _state.update(op=_OPS[op], errno=err, count=count)
    mod = _native.get() if _native.available() else None
    if mod is not None and hasattr(mod, "aio_inject_fault"):
        mod.aio_inject_fault(_OPS[op], err, count)


def clear() -> None:
    """Remove any pending injected fault."""
    inject(0, 0, "any")


def take(kind: str) -> int:
    """For the thread backend: the errno to fail this ``kind`` ("read", "write",
    "open_direct") of syscall with, or 0 to run it."""
    with _lock:
        if _state["count"] <= 0 or _state["errno"] == 0:
            return 0
        op = _state["op"]
        if not (op == _OPS[kind] or (op == 0 and kind != "open_direct")):
            return 0
        _state["count"] -= 1
        return _state["errno"]
