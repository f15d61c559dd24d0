"""What the IO layer leaves behind when a process ends: nothing, however it ends.

Note: the registry. Every :class:`~offload.io.AsyncIO` and :class:`~offload.io.NvmeStore` is
tracked here from construction until its ``close()``; the registry holds weak references, so it
never keeps one alive. What is still open when the process ends is closed by this module:

- normal exit, an uncaught exception, SIGINT (a ``KeyboardInterrupt`` that nobody caught):
  the ``atexit`` handler closes every open engine first (waits for the requests in flight, then
  stops and joins its IO threads), then every open store (removes its swap directory). So no
  native IO thread outlives the interpreter and no swap file outlives the process.
- SIGTERM: while anything is open, a handler (installed only over the default disposition, and
  only from the main thread) abandons every open resource - engines stop after the requests in
  flight, swap directories are removed - then restores the default disposition and raises
  SIGTERM again, so the process still ends killed by SIGTERM (status 143 in a shell, -15 from
  ``subprocess``). The handler may run while the main thread holds any lock of this package, so
  its path takes none (``abandon()`` rather than ``close()``) and does not log. When the last
  resource closes, the default disposition comes back: a process stuck in native code can then
  be ended by SIGTERM as usual.
- SIGKILL, a power cut: nothing runs. Each swap directory records its owner, and the next store
  made on the same ``nvme_path`` removes directories whose owner is gone (``_owner``).

Note: forked children. A child made by ``fork`` (a DataLoader worker) inherits this registry and
the SIGTERM handler but owns none of the files: after a fork the registry is emptied and the
handler removed in the child, and every resource remembers the pid that made it, so a child can
never remove its parent's swap space. Nor can it use the engines, whose threads stayed in the
parent: a request or a wait there raises (``AsyncIO``), and an engine is never freed there
(``AsyncIO.forked``).

Note: order with the layers above. ``atexit`` runs handlers last-registered first. This module
registers its handler when ``offload.io`` is imported, so an upper layer that registers its own
exit work later (the engine joining its background optimizer step, at ``wrap`` time) runs before
the IO layer shuts down. A daemon thread still running torch code when the interpreter finalizes
can abort the process (CPython ends such a thread with ``pthread_exit`` and a C++ destructor on
its stack turns that into ``std::terminate``); the IO layer makes its own native calls safe
(``csrc/gil.h``), and whoever owns such a thread must join it before finalization.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import weakref
from typing import Protocol

logger = logging.getLogger("offload.io")


class Resource(Protocol):
    """What the registry asks of a tracked object."""

    def close(self) -> None:
        """Finish the work in flight and release everything (may take locks, may log)."""

    def abandon(self) -> None:
        """The same, from a signal handler: takes no Python lock and does not log."""


# engines are closed before stores: once no IO runs, a swap directory can go
_engines: weakref.WeakSet = weakref.WeakSet()
_stores: weakref.WeakSet = weakref.WeakSet()
_lock = threading.RLock()  # reentrant: a store's __del__ may run (GC) while it is held
_sigterm_installed = False


def track_engine(engine: Resource) -> None:
    """Close ``engine`` at exit unless it is closed first (:func:`untrack`)."""
    _track(_engines, engine)


def track_store(store: Resource) -> None:
    """Close ``store`` (removing its files) at exit unless it is closed first."""
    _track(_stores, store)


def untrack(resource: Resource) -> None:
    """``resource`` was closed; when nothing is left open, SIGTERM gets its default back."""
    global _sigterm_installed
    with _lock:
        _engines.discard(resource)
        _stores.discard(resource)
        empty = not _engines and not _stores
        if not (empty and _sigterm_installed) or not _on_main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _sigterm_installed = False


def open_resources() -> list:
    """The engines and stores not closed yet (engines first); for tests and diagnostics."""
    with _lock:
        return [*_engines, *_stores]


def _track(into: weakref.WeakSet, resource: Resource) -> None:
    global _sigterm_installed
    with _lock:
        into.add(resource)
        if _sigterm_installed or not _on_main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
            _sigterm_installed = True


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _at_exit() -> None:
    for resource in [*_engines, *_stores]:
        try:
            resource.close()
        except Exception as exc:  # noqa: BLE001 - one failure must not keep the rest open
            logger.warning("offload.io: closing %r at exit failed: %s", resource, exc)


def _on_sigterm(signum: int, frame: object) -> None:
    for resource in [*_engines, *_stores]:
        try:
            resource.abandon()
        except Exception:  # noqa: BLE001 - the process is ending; the rest still goes
            pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)


def forked(what: str, whose: str) -> str:
    """The error for ``what`` in a process forked from the one whose ``whose`` (the IO engine,
    the background update) would run it (the Note on forked children): its threads are not in
    the child, which waited for them for good (a DataLoader worker or a fork pool using a model
    on NVMe: until 2026-12-07 a hang)."""
    return (
        f"offload: {what} in process {os.getpid()}, forked from the process that made its "
        f"{whose}: its threads live there, not in a forked child (a DataLoader worker, a "
        "multiprocessing pool with the 'fork' start method), so a model wrapped with parameters "
        "or optimizer state on NVMe, or whose update runs in the background, cannot be used in "
        "one. Use it in the process that wrapped it, or wrap a model in the child (the 'spawn' "
        "start method)"
    )


def _after_fork_in_child() -> None:
    global _sigterm_installed, _lock
    _lock = threading.RLock()  # the parent's may have been held by another thread at fork
    for engine in list(_engines):
        engine.forked()
    _engines.clear()
    _stores.clear()
    if _sigterm_installed and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # not the main thread of the main interpreter: nothing to undo
            pass
    _sigterm_installed = False


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
