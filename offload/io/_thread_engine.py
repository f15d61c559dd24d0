"""The thread-pool IO backend used when the native extension is not available.

Note: this mirrors ``csrc/aio.cpp`` piece for piece so both backends give the same results and
the same errors. A request (path, buffer address, bytes, file offset) is planned into pieces by
:func:`plan`: the 4096-aligned part of the file range (the body) goes through an O_DIRECT
descriptor in ``block_size`` pieces, the unaligned head/tail through a buffered one. When the
buffer address is congruent with the file offset modulo 4096 the body moves straight from/to
the tensor (DIRECT); otherwise each body piece is staged through an aligned per-thread bounce
buffer (BOUNCE). ``thread_count`` Python threads run the
pieces with ``os.preadv``/``os.pwritev`` into a memoryview over the tensor's memory (the syscalls
release the GIL, so threads overlap). With blocking syscalls at most ``thread_count`` pieces are
in flight, so ``queue_depth`` is only an upper bound here.

When the filesystem refuses O_DIRECT (EINVAL at open, e.g. tmpfs) the request is served
buffered and each piece is followed by ``posix_fadvise(DONTNEED)`` so the page cache does not
fill with swap traffic; :class:`offload.io.AsyncIO` logs that once per directory.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import itertools
import os
import queue
import threading
import time

from offload._interrupts import interrupts_deferred, wait
from offload.io import faults

ALIGN = 4096


BUFFERED, DIRECT, BOUNCE = 0, 1, 2  # how a piece moves (see the Note)


def plan(
    addr: int, nbytes: int, offset: int, block: int, direct: bool
) -> list[tuple[int, int, int, int]]:
    """Pieces ``(buffer offset, file offset, length, mode)`` covering a request (bytes)."""
    pieces: list[tuple[int, int, int, int]] = []

    def add(start: int, length: int, mode: int) -> None:
        pos = start
        end = start + length
        while pos < end:
            n = min(block, end - pos)
            pieces.append((pos, offset + pos, n, mode))
            pos += n

    head = min((-offset) % ALIGN, nbytes)
    body = (nbytes - head) // ALIGN * ALIGN if direct else 0
    if body == 0:
        add(0, nbytes, BUFFERED)
    else:
        add(0, head, BUFFERED)
        add(head, body, DIRECT if (addr - offset) % ALIGN == 0 else BOUNCE)
        add(head + body, nbytes - head - body, BUFFERED)
    return pieces


def _view(addr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of memory at ``addr`` (a tensor's data)."""
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def _aligned_view(nbytes: int) -> memoryview:
    """A private, 4096-aligned byte buffer (kept alive by the view)."""
    raw = bytearray(nbytes + ALIGN)
    addr = ctypes.addressof((ctypes.c_char * len(raw)).from_buffer(raw))
    skip = (-addr) % ALIGN
    return memoryview(raw)[skip : skip + nbytes]


class _Request:
    """One read or write: its descriptors, pieces left, first error, completion event."""

    def __init__(self, engine: ThreadEngine, is_write: bool, path: str, addr: int, nbytes: int):
        self.engine = engine
        self.is_write = is_write
        self.path = path
        self.addr = addr
        self.nbytes = nbytes
        self.fd_direct = -1
        self.fd_buffered = -1
        self.direct_refused = False
        self.err = 0
        self.msg = ""
        self.remaining = 0
        self.t0 = time.perf_counter()
        self.lock = threading.Lock()
        self.event = threading.Event()

    # the native request object offers the same four calls
    def wait(self, timeout_s: float) -> bool:
        # as the native request's wait, a Ctrl-C does not end it (_interrupts: waits, for the
        # slices): raised between slices, the store took the read for failed and gave its
        # buffer back with this engine still reading into it (the next fetch's values
        # overwritten: tests/test_store.py)
        with interrupts_deferred():
            return wait(self.event, None if timeout_s < 0 else timeout_s)

    def done(self) -> bool:
        return self.event.is_set()

    def error(self) -> int:
        return self.err

    def message(self) -> str:
        return self.msg

    def fail(self, err: int, msg: str) -> None:
        with self.lock:
            if not self.err:
                self.err, self.msg = err, msg

    def piece_done(self) -> None:
        with self.lock:
            self.remaining -= 1
            last = self.remaining == 0
        if last:
            self.finish()

    def finish(self) -> None:
        for fd in (self.fd_direct, self.fd_buffered):
            if fd >= 0:
                os.close(fd)
        self.fd_direct = self.fd_buffered = -1
        # counters first, then the event, then the engine's outstanding count (close() returns
        # only after every handle reports done)
        self.engine._count(self)
        self.event.set()
        self.engine._release()


class ThreadEngine:
    """Same interface as the native ``offload._C.AioEngine``, on plain Python threads."""

    def __init__(self, block_size: int, queue_depth: int, thread_count: int, direct_io: bool):
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.thread_count = thread_count
        self.direct_io = direct_io
        # (class, order, piece): urgent requests' pieces first, each class first in, first out
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._outstanding = 0
        self._closed = False
        self._stats = dict(
            bytes_read=0, bytes_written=0, reads=0, writes=0, read_seconds=0.0, write_seconds=0.0
        )
        self._threads = [
            threading.Thread(target=self._worker, name=f"offload-aio-{i}", daemon=True)
            for i in range(thread_count)
        ]
        with interrupts_deferred():  # Thread.start waits on an Event (_interrupts: waits)
            for t in self._threads:
                t.start()

    # ---- submission -------------------------------------------------------------------
    def submit(
        self, is_write: bool, path: str, addr: int, nbytes: int, offset: int, urgent: bool = False
    ) -> _Request:
        # whole or not at all: a request counted outstanding but never queued whole never
        # finishes, and close() waits for it (Queue.put also enters a Condition:
        # offload._interrupts, Note: waits)
        with interrupts_deferred():
            with self._lock:
                if self._closed:
                    raise RuntimeError("AsyncIO engine is closed")
                self._outstanding += 1
            req = _Request(self, is_write, path, addr, nbytes)
            pieces = plan(addr, nbytes, offset, self.block_size, self.direct_io)
            try:
                self._open(req, pieces)
            except OSError as exc:
                req.fail(exc.errno or errno_mod.EIO, f"cannot open the file: {exc.strerror}")
                req.finish()
                return req
            if req.direct_refused:
                pieces = plan(addr, nbytes, offset, self.block_size, False)
            if not pieces:
                req.finish()
                return req
            req.remaining = len(pieces)
            for p in pieces:
                self._queue.put((0 if urgent else 1, next(self._order), (req, p)))
            return req

    def _open(self, req: _Request, pieces: list[tuple[int, int, int, int]]) -> None:
        flags = (os.O_WRONLY | os.O_CREAT) if req.is_write else os.O_RDONLY
        flags |= os.O_CLOEXEC
        need_direct = any(p[3] != BUFFERED for p in pieces)
        if need_direct:
            try:
                injected = faults.take("open_direct")
                if injected:
                    raise OSError(injected, os.strerror(injected))
                req.fd_direct = os.open(req.path, flags | os.O_DIRECT, 0o600)
            except OSError as exc:
                if exc.errno != errno_mod.EINVAL:
                    raise
                req.direct_refused = True  # filesystem without O_DIRECT (tmpfs, some NFS)
        if req.direct_refused or not all(p[3] != BUFFERED for p in pieces) or not pieces:
            req.fd_buffered = os.open(req.path, flags, 0o600)

    # ---- workers ----------------------------------------------------------------------
    def _worker(self) -> None:
        bounce: memoryview | None = None  # this thread's staging buffer, made on first use
        while True:
            *_, item = self._queue.get()
            if item is None:
                return
            req, (boff, foff, length, mode) = item
            if not req.err:  # after a failure the rest of the request is skipped
                if req.direct_refused:
                    mode = BUFFERED
                if mode == BOUNCE and bounce is None:
                    bounce = _aligned_view(self.block_size)
                try:
                    self._run_piece(req, boff, foff, length, mode, bounce)
                except OSError as exc:
                    what = "write" if req.is_write else "read"
                    req.fail(
                        exc.errno or errno_mod.EIO,
                        f"{exc.strerror} (in the {what} of {length} bytes at file offset {foff})",
                    )
                except Exception as exc:  # never lose a worker thread
                    req.fail(errno_mod.EIO, f"unexpected error: {exc}")
            req.piece_done()

    def _run_piece(
        self,
        req: _Request,
        boff: int,
        foff: int,
        length: int,
        mode: int,
        bounce: memoryview | None,
    ) -> None:
        direct = mode != BUFFERED
        user = _view(req.addr + boff, length)
        stage = bounce[:length] if mode == BOUNCE else None
        if stage is not None and req.is_write:
            stage[:] = user
        fd = req.fd_direct if direct else req.fd_buffered
        done = 0

        def leave_direct() -> int:  # finish the rest of this piece buffered
            nonlocal stage, direct
            if stage is not None and not req.is_write:
                user[:done] = stage[:done]
            stage, direct = None, False
            return req.fd_buffered if req.fd_buffered >= 0 else self._buffered(req)

        while done < length:
            injected = faults.take("write" if req.is_write else "read")
            chunk = (stage if stage is not None else user)[done:]
            try:
                if injected:
                    raise OSError(injected, os.strerror(injected))
                if req.is_write:
                    n = os.pwritev(fd, [chunk], foff + done)
                else:
                    n = os.preadv(fd, [chunk], foff + done)
            except OSError as exc:
                if exc.errno == errno_mod.EINVAL and direct and not injected:
                    fd = leave_direct()  # O_DIRECT accepted at open, refused at IO
                    continue
                raise
            if n == 0:
                if req.is_write:
                    raise OSError(errno_mod.EIO, "pwrite wrote 0 bytes")
                raise OSError(errno_mod.ENODATA, "file ends before the requested range")
            done += n
            if n % ALIGN and direct and done < length:
                fd = leave_direct()  # short O_DIRECT transfer: the unaligned rest goes buffered
        if stage is not None and not req.is_write:
            user[:] = stage
        if req.direct_refused:
            os.posix_fadvise(fd, foff, length, os.POSIX_FADV_DONTNEED)

    def _buffered(self, req: _Request) -> int:
        with req.lock:
            if req.fd_buffered < 0:
                flags = (os.O_WRONLY if req.is_write else os.O_RDONLY) | os.O_CLOEXEC
                req.fd_buffered = os.open(req.path, flags)
            return req.fd_buffered

    # ---- completion and lifetime ------------------------------------------------------
    def _count(self, req: _Request) -> None:
        dt = time.perf_counter() - req.t0
        with self._lock:
            if not req.err:
                if req.is_write:
                    self._stats["bytes_written"] += req.nbytes
                    self._stats["writes"] += 1
                    self._stats["write_seconds"] += dt
                else:
                    self._stats["bytes_read"] += req.nbytes
                    self._stats["reads"] += 1
                    self._stats["read_seconds"] += dt

    def _release(self) -> None:
        with self._lock:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle.notify_all()

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """Waits for every submitted request, then stops the threads."""
        with self._lock:
            if self._closed:
                return
            while self._outstanding:
                wait(self._idle)
            self._closed = True
        with interrupts_deferred():  # (Queue.put enters a Condition: _interrupts, waits)
            for _ in self._threads:
                self._queue.put((2, next(self._order), None))
        for t in self._threads:
            t.join()
