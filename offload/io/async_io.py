"""``AsyncIO``: asynchronous reads and writes between CPU tensors and files.

Note: backends. The engine is native (``offload._C.AioEngine``, ``csrc/aio.cpp``: its own IO
threads, each keeping up to its share of ``queue_depth`` O_DIRECT requests in flight through
Linux AIO, or blocking ``pread``/``pwrite`` where that is unavailable) or, without the
extension, :class:`offload.io._thread_engine.ThreadEngine` on Python threads. Both split a
request the same way (see ``_thread_engine.plan``): the 4096-aligned part of the file range
goes through O_DIRECT in ``block_size`` pieces (straight from/to the tensor when its address is
congruent with the file offset modulo 4096, else staged through an aligned bounce buffer), the
unaligned head and tail through a buffered descriptor. Any size, any offset and any buffer
address round-trip.

Note: lifetimes. An :class:`IOHandle` holds a reference to its tensor until the request has
completed, so the memory the kernel writes into cannot be freed underneath it. ``close()`` (and
leaving the ``with`` block) waits for every request in flight before stopping the threads. An
engine nobody closed is closed at exit, or abandoned on SIGTERM, by ``offload.io.lifecycle``;
in a process forked from the one that made it, it is only forgotten (its threads live in the
parent).

Note: errors. A failure (open, read, write, short file) is recorded on the request and raised by
``IOHandle.wait()`` as ``OSError(errno, message, path)``; submission itself never raises for IO
errors, so a caller has one place to handle them. The message names what was asked (the
caller's label, e.g. a shard key, the bytes and the file offset) and the piece that failed;
ENOSPC adds the bytes the request needed and the bytes free on that filesystem.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch

from offload import _native
from offload._interrupts import interrupts_deferred
from offload.io import lifecycle
from offload.io._thread_engine import ALIGN, ThreadEngine

logger = logging.getLogger("offload.io")

_STAT_KEYS = ("bytes_read", "bytes_written", "reads", "writes", "read_seconds", "write_seconds")


class IOHandle:
    """The completion record of one :meth:`AsyncIO.read` / :meth:`AsyncIO.write`.

    ``wait()`` is the only way to learn that the data is in place; it raises the request's
    error. Callbacks registered with :meth:`add_done_callback` run once, in the first ``wait()``
    that sees the request complete (they may raise, which then becomes the handle's error).
    """

    __slots__ = (
        "_req",
        "_tensor",
        "_path",
        "_what",
        "_nbytes",
        "_callbacks",
        "_errbacks",
        "_error",
        "_finished",
        "_lock",
        "_pid",
    )

    def __init__(
        self, req: Any, tensor: torch.Tensor | None, path: str, what: str, nbytes: int = 0
    ) -> None:
        self._req = req
        self._tensor = tensor  # keeps the buffer alive while the kernel may touch it
        self._path = path
        self._what = what
        self._nbytes = nbytes
        self._callbacks: list[Callable[[], None]] = []
        self._errbacks: list[Callable[[BaseException], None]] = []
        self._error: BaseException | None = None
        self._finished = False
        self._lock = threading.Lock()
        self._pid = os.getpid()  # the process whose engine runs it (see the Note on lifetimes)

    @property
    def path(self) -> str:
        """The file this request reads or writes."""
        return self._path

    def done(self) -> bool:
        """Whether the request has completed (successfully or not); never blocks."""
        return self._finished or self._req is None or bool(self._req.done())

    def add_done_callback(
        self, fn: Callable[[], None], on_error: Callable[[BaseException], None] | None = None
    ) -> None:
        """Run ``fn()`` after a successful completion, or ``on_error(exc)`` after a failed one,
        inside the first ``wait()`` that sees it."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(fn)
                if on_error is not None:
                    self._errbacks.append(on_error)
                return
        if self._error is None:
            fn()
        elif on_error is not None:
            on_error(self._error)

    def wait(self, timeout: float | None = None) -> None:
        """Block (GIL released) until the request completes; raise its error.

        Args:
            timeout: seconds; ``None`` waits forever. On expiry raises ``TimeoutError`` and the
                request stays in flight (wait again later).
        """
        if not self._finished:
            if os.getpid() != self._pid:  # its engine's threads stayed in the parent
                raise RuntimeError(
                    lifecycle.forked(f"a wait for the {self._what} of {self._path!r}", "IO engine")
                )
            if self._req is not None and not self._req.wait(-1.0 if timeout is None else timeout):
                raise TimeoutError(
                    f"{self._what} of {self._path!r} still in flight after {timeout} s"
                )
            with self._lock:
                if not self._finished:
                    self._finish_locked()
        if self._error is not None:
            raise self._error

    def _finish_locked(self) -> None:
        # A Ctrl-C on the main thread waits for the completion's bookkeeping: caught below,
        # it became this handle's error, raised again to every later waiter (the update's
        # thread, whose pins then leaked), and the callbacks after it never ran. Landing
        # before the block (with the handle already marked finished), it lost the callbacks:
        # the handle is marked inside it, so a Ctrl-C before leaves it for the next wait
        with interrupts_deferred():
            req = self._req
            if req is not None and req.error():
                self._error = OSError(req.error(), self._describe(req), self._path)
            self._tensor = None
            self._finished = True
            callbacks, errbacks = self._callbacks, self._errbacks
            self._callbacks, self._errbacks = [], []
            if self._error is None:
                for fn in callbacks:
                    try:
                        fn()
                    except BaseException as exc:  # becomes this handle's error, raised on wait
                        self._error = exc
                        break
            else:
                for on_error in errbacks:
                    on_error(self._error)

    def _describe(self, req: Any) -> str:
        """What failed, for the OSError: the request, then the engine's account of the piece."""
        err = req.error()
        text = f"{self._what} failed: {req.message() or os.strerror(err)}"
        if err == errno.ENOSPC:
            text += (
                f"; the {self._nbytes} bytes of this request did not fit, {_free_bytes(self._path)}"
            )
        return text


def _free_bytes(path: str) -> str:
    try:
        st = os.statvfs(os.path.dirname(path) or ".")
    except OSError as exc:
        return f"free space unknown ({exc.strerror})"
    return f"{st.f_bavail * st.f_frsize} bytes are free on that filesystem"


class AsyncIO:
    """Asynchronous file IO for contiguous CPU tensors, O_DIRECT where the filesystem allows.

    Args:
        block_size: bytes per piece a request is split into; a multiple of 4096.
        queue_depth: O_DIRECT pieces in flight at most, shared over the threads (count; each
            thread gets at least one slot).
        thread_count: IO threads owned by this engine (count; not the compute pool).
        direct_io: use O_DIRECT for the aligned part of each request (bypasses the page cache).
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 8,
        thread_count: int = 2,
        direct_io: bool = True,
    ) -> None:
        for name, value, low in (
            ("block_size", block_size, ALIGN),
            ("queue_depth", queue_depth, 1),
            ("thread_count", thread_count, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"aio.{name}={value!r}; allowed: an integer >= {low}")
        if block_size % ALIGN:
            raise ValueError(f"aio.block_size={block_size}; allowed: a multiple of {ALIGN} bytes")
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.thread_count = thread_count
        self.direct_io = bool(direct_io)
        mod = _native.get()
        if mod is not None and hasattr(mod, "AioEngine"):
            self._engine = mod.AioEngine(block_size, queue_depth, thread_count, self.direct_io)
            self.backend = "native"
        else:
            self._engine = ThreadEngine(block_size, queue_depth, thread_count, self.direct_io)
            self.backend = "threads"
        self._closed = False
        self._pid = os.getpid()
        self._refused_dirs: set[str] = set()
        self._direct_cache: dict[str, bool] = {}
        lifecycle.track_engine(self)

    # ---- requests ---------------------------------------------------------------------
    def read(
        self,
        tensor: torch.Tensor,
        path: str | os.PathLike,
        offset: int = 0,
        label: str = "",
        urgent: bool = False,
    ) -> IOHandle:
        """Fill ``tensor``'s bytes from ``path[offset : offset + tensor.nbytes]``; ``label``
        (e.g. a shard key) names the data in error messages. An ``urgent`` read goes ahead of
        every queued request that is not (first in, first out within each class; pieces the
        threads already took are not overtaken): a read the compute will wait on should not
        queue behind background writes."""
        return self._submit(False, tensor, path, offset, label, urgent)

    def write(
        self, tensor: torch.Tensor, path: str | os.PathLike, offset: int = 0, label: str = ""
    ) -> IOHandle:
        """Write ``tensor``'s bytes to ``path`` at ``offset`` (file created 0600 if missing)."""
        return self._submit(True, tensor, path, offset, label)

    def _submit(
        self,
        is_write: bool,
        tensor: torch.Tensor,
        path: Any,
        offset: int,
        label: str,
        urgent: bool = False,
    ) -> IOHandle:
        if self._closed:
            raise RuntimeError("AsyncIO is closed")
        what = "write" if is_write else "read"
        path = os.fspath(path)
        if os.getpid() != self._pid:
            raise RuntimeError(lifecycle.forked(f"a {what} of {label or repr(path)}", "IO engine"))
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"AsyncIO.{what}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"AsyncIO.{what} {path!r}: the tensor must be a contiguous CPU tensor "
                f"(got device={tensor.device}, contiguous={tensor.is_contiguous()})"
            )
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"AsyncIO.{what} {path!r}: offset={offset!r}; allowed: an int >= 0")
        nbytes = tensor.numel() * tensor.element_size()
        req = self._engine.submit(is_write, path, tensor.data_ptr(), nbytes, offset, urgent)
        if req.direct_refused:
            self._note_refused(path)
        of = f" of {label}" if label else ""
        desc = f"{what}{of} ({nbytes} bytes at file offset {offset})"
        return IOHandle(req, tensor, path, desc, nbytes)

    def _note_refused(self, path: str) -> None:
        d = os.path.dirname(os.path.abspath(path))
        if d not in self._refused_dirs:
            self._refused_dirs.add(d)
            logger.warning(
                "offload.io: O_DIRECT refused by the filesystem of %s; using buffered IO with "
                "posix_fadvise(DONTNEED) there (page cache is bypassed only approximately)",
                d,
            )

    # ---- introspection ----------------------------------------------------------------
    def direct_io_active(self, path: str | os.PathLike) -> bool:
        """Whether requests on ``path`` (a file, or a directory for new files) use O_DIRECT."""
        if not self.direct_io:
            return False
        path = os.path.abspath(os.fspath(path))
        if path in self._direct_cache:
            return self._direct_cache[path]
        ok = probe_direct_io(path)
        self._direct_cache[path] = ok
        return ok

    def stats(self) -> dict:
        """Completed-request counters: bytes_read/written (bytes), reads/writes (count),
        read_seconds/write_seconds (sum of submit-to-completion times, seconds)."""
        s = self._engine.stats()
        return {k: s[k] for k in _STAT_KEYS}

    # ---- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        """Wait for every request in flight, then stop the IO threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        lifecycle.untrack(self)
        if os.getpid() == self._pid:  # see the Note on lifetimes
            self._engine.close()

    def forked(self) -> None:
        """Called in a child just forked from this engine's process (``offload.io.lifecycle``):
        the native engine is never freed there. Its condition variables may count the parent's
        threads as waiters, which the child does not have, and destroying one with waiters
        blocks for good (a forked child that used a model on NVMe, and exited, hung until
        2026-12-07): one small object leaked, in a process whose memory goes with it."""
        if self.backend == "native":
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._engine))

    def abandon(self) -> None:
        """:meth:`close` from a signal handler (``offload.io.lifecycle``): takes no Python lock.
        The native engine stops after the requests in flight; the thread fallback's workers
        are daemon threads that end with the process, so nothing waits for them."""
        self._closed = True
        if os.getpid() == self._pid and self.backend == "native":
            self._engine.close()

    def __enter__(self) -> AsyncIO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"AsyncIO(block_size={self.block_size}, queue_depth={self.queue_depth}, "
            f"thread_count={self.thread_count}, direct_io={self.direct_io}, "
            f"backend={self.backend!r})"
        )


def probe_direct_io(path: str) -> bool:
    """Whether the filesystem holding ``path`` (file, directory, or a new file's name) accepts
    O_DIRECT opens."""
    if not os.path.exists(path):
        path = os.path.dirname(path) or "."
    try:
        if os.path.isdir(path):
            fd, name = tempfile.mkstemp(prefix=".odirect-probe-", dir=path)
            os.close(fd)
            try:
                fd = os.open(name, os.O_RDWR | os.O_DIRECT)
                os.close(fd)
            finally:
                os.unlink(name)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            os.close(fd)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
