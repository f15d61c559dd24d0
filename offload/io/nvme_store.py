"""``NvmeStore``: named shards in preallocated files on a fast local disk.

Note: layout. Each key owns one extent (file, byte offset, capacity rounded up to 4096) in a
data file of a private directory (``mkdtemp``: mode 0700) that the store makes under the
configured path; data files are created 0600 and grown with ``posix_fallocate`` at
:meth:`NvmeStore.allocate` time, so running out of disk shows up there (ENOSPC naming the file
and the key) rather than half way through a training step. A new data file starts when the
current one would pass ``file_bytes``. Extents freed with :meth:`NvmeStore.free` are reused
first-fit. The directory and its files are removed by :meth:`NvmeStore.close` unless ``keep``.

Note: the configured path and crashes. A missing ``nvme_path`` is created (each missing level
0700, like DeepSpeed does it but private); only a path that cannot be created is an error,
naming the path, the level that failed and the errno. The private directory records its owner
(``owner.json``, see ``offload.io._owner``), and a new store on the same path first removes the
directories of owners that are provably gone (a process killed by SIGKILL cannot clean up), so
crashed runs do not fill the disk. Every other way a process ends removes the directory itself
(``offload.io.lifecycle``), renaming it to the reclaiming name first, so a kill half way through
the deletion leaves a directory the next store removes, not files without their owner record.

Note: validity. The store tracks, per shard, which byte ranges hold data of a *completed*
write. A write first marks its range invalid, then marks it valid in its handle's completion
(run by the first ``wait()`` on it, or by a later read that waits for it). A read of a range
that is not entirely valid raises :class:`OffloadIOError` (ENODATA) at once, naming the key,
the range and the last write error if there was one. So a crashed, failed or still-running
write can never be read back as if it were good data.

Note: checksums. With ``checksum=True`` every write records the CRC-32 of its bytes (``zlib``,
computed in the calling thread before the write is submitted; zlib releases the GIL). A read
verifies every recorded range it covers completely, in its handle's ``wait()``, and raises
``EBADMSG`` on mismatch. Writing the whole shard and reading the whole shard - what the tiered
store does - is therefore always verified; a range that a later partial write cut in two loses
its checksum (its bytes stay valid, just unverified).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import tempfile
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from offload._interrupts import interrupts_deferred
from offload.io import _owner, lifecycle
from offload.io.aligned import ALIGN, round_up
from offload.io.async_io import AsyncIO, IOHandle
from offload.io.errors import OffloadIOError

logger = logging.getLogger("offload.io")


@dataclass(slots=True)
class _Shard:
    """Where a key lives and which of its bytes hold completed writes."""

    file: int  # index into NvmeStore._files
    offset: int  # bytes from the start of that file (multiple of 4096)
    capacity: int  # bytes reserved (multiple of 4096)
    nbytes: int  # bytes the caller asked for
    ranges: list[list] = field(default_factory=list)  # sorted [start, end, crc32 | None]
    pending: list[tuple[IOHandle, int, int]] = field(default_factory=list)  # writes in flight
    last_error: str = ""


def _bytes_of(t: torch.Tensor) -> memoryview:
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _cut(ranges: list[list], s: int, e: int) -> list[list]:
    """``ranges`` without ``[s, e)``; pieces of a cut range lose their checksum."""
    out: list[list] = []
    for a, b, crc in ranges:
        if b <= s or a >= e:
            out.append([a, b, crc])
            continue
        if a < s:
            out.append([a, s, None])
        if b > e:
            out.append([e, b, None])
    return out


def _covered(ranges: list[list], s: int, e: int) -> bool:
    pos = s
    for a, b, _ in sorted(ranges):
        if a > pos:
            break
        pos = max(pos, b)
        if pos >= e:
            return True
    return pos >= e


class NvmeStore:
    """Named shards on disk, written and read asynchronously through :class:`AsyncIO`.

    Args:
        path: a writable directory (``nvme_path``), created if missing; the store makes a
            private ``offload-*`` directory inside it.
        aio: the engine to use; ``None`` makes (and later closes) a default ``AsyncIO()``.
        checksum: record a CRC-32 per write and verify it on read.
        keep: leave the directory and files in place on :meth:`close`.
        file_bytes: bytes per data file before a new one is started.
        urgent_reads: its reads go ahead of the queued requests of other stores sharing ``aio``
            (``AsyncIO.read``'s ``urgent``): the store whose reads the compute waits on.
        reclaim: more directories whose dead owners' swap directories are reclaimed before
            this store makes its own (``path`` always is): where runs at another rank count
            put theirs (``offload.api.wrap.swap_dirs``).
        own_path: ``path`` is offload's own (a rank's ``rank-NNNNN`` under ``nvme_path``):
            :meth:`close` removes it too once it is empty (the last store in it; left behind,
            empty, by every close across ranks before).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        aio: AsyncIO | None = None,
        checksum: bool = False,
        keep: bool = False,
        file_bytes: int = 64 << 30,
        urgent_reads: bool = False,
        reclaim: Sequence[str | os.PathLike] = (),
        own_path: bool = False,
    ) -> None:
        path = os.fspath(path)
        self._path, self._own_path = path, own_path
        _make_path(path)
        if not os.path.isdir(path):
            raise NotADirectoryError(
                errno.ENOTDIR, "nvme_path is not a directory; allowed: a directory path", path
            )
        for where in dict.fromkeys([path, *map(os.fspath, reclaim)]):
            _owner.reclaim(where)
        self._dir = ""
        try:  # until the store is tracked (closed at exit), its directory is removed here
            # made and recorded whole or not at all: a Ctrl-C in the record's write left the
            # directory with an owner.json.tmp, which no later run reclaims (an owner it
            # cannot read is never judged gone; tests/_ctrl_c_points.py, PHASE wrap)
            with interrupts_deferred():
                try:
                    self._dir = tempfile.mkdtemp(prefix=_owner.PREFIX, dir=path)  # mode 0700
                    _owner.write_record(self._dir, keep)
                except OSError as exc:
                    raise OSError(
                        exc.errno,
                        "cannot create the private swap directory under nvme_path "
                        f"({exc.strerror}); nvme_path must be a writable directory on a local "
                        "disk",
                        path,
                    ) from exc
            self._pid = os.getpid()  # a forked child never removes its parent's files
            self._own_aio = aio is None
            self._aio = aio if aio is not None else AsyncIO()
            self.checksum = bool(checksum)
            self.keep = bool(keep)
            self.urgent_reads = bool(urgent_reads)
            self.file_bytes = max(round_up(int(file_bytes)), ALIGN)
            self._files: list[str] = []
            self._file_end: list[int] = []
            self._free: list[tuple[int, int, int]] = []  # (file, offset, capacity)
            self._shards: dict[str, _Shard] = {}
            self._lock = threading.Lock()
            self._closed = False
            self._closed_whole = False  # (close: files removed, untracked)
            self._counters = dict(checksum_failures=0, bytes_written=0, bytes_read=0)
            lifecycle.track_store(self)
        except BaseException:
            if self._dir:
                shutil.rmtree(self._dir, ignore_errors=True)
            raise

    # ---- layout -----------------------------------------------------------------------
    @property
    def directory(self) -> str:
        """The private directory holding this store's files."""
        return self._dir

    def allocate(self, key: str, nbytes: int) -> None:
        """Reserve an extent of ``nbytes`` (rounded up to 4096) for ``key`` on disk.

        Re-allocating a key with a size that fits its extent only updates its size.

        Raises:
            OSError: ENOSPC (or another errno) from ``posix_fallocate``, naming the data file.
        """
        self._check_open()
        if not isinstance(key, str) or not key:
            raise ValueError(f"NvmeStore.allocate: key={key!r}; allowed: a non-empty str")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"NvmeStore.allocate {key!r}: nbytes={nbytes!r}; allowed: int >= 0")
        cap = round_up(nbytes)
        with self._lock:
            old = self._shards.get(key)
            if old is not None:
                if cap > old.capacity:
                    raise ValueError(
                        f"NvmeStore.allocate {key!r}: nbytes={nbytes} exceeds its extent of "
                        f"{old.capacity} bytes; free({key!r}) it first"
                    )
                old.nbytes = nbytes
                return
            file, offset = self._place(cap)
            if cap:
                self._reserve(key, file, offset, cap)
            self._shards[key] = _Shard(file, offset, cap, nbytes)

    def _place(self, cap: int) -> tuple[int, int]:
        for i, (f, off, c) in enumerate(self._free):
            if c >= cap:
                if c > cap:
                    self._free[i] = (f, off + cap, c - cap)
                else:
                    del self._free[i]
                return f, off
        if not self._files or (self._file_end[-1] + cap > self.file_bytes and self._file_end[-1]):
            self._files.append(os.path.join(self._dir, f"shards-{len(self._files):03d}.bin"))
            self._file_end.append(0)
        f = len(self._files) - 1
        off = self._file_end[-1]
        self._file_end[-1] += cap
        return f, off

    def _reserve(self, key: str, file: int, offset: int, cap: int) -> None:
        name = self._files[file]
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, offset, cap)
            finally:
                os.close(fd)
        except OSError as exc:
            self._free.append((file, offset, cap))
            raise OSError(
                exc.errno,
                f"cannot reserve {cap} bytes at offset {offset} for shard {key!r} "
                f"({exc.strerror}); free space on the disk or point nvme_path elsewhere",
                name,
            ) from exc

    def free(self, key: str) -> None:
        """Forget ``key`` (waiting for its writes) and make its extent reusable."""
        shard = self._get(key, "free")
        self._drain(shard)
        with self._lock:
            self._shards.pop(key, None)
            if shard.capacity:
                self._free.append((shard.file, shard.offset, shard.capacity))

    # ---- IO ---------------------------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        """Write ``tensor``'s bytes into shard ``key`` at ``offset`` (bytes, multiple of 4096)."""
        shard, n = self._span(key, tensor, offset, "write")
        crc = zlib.crc32(_bytes_of(tensor)) if self.checksum else None
        name = self._files[shard.file]
        handle = None

        def completed() -> None:
            with self._lock:
                shard.pending = [p for p in shard.pending if p[0] is not handle]
                newer = any(s < offset + n and e > offset for _, s, e in shard.pending)
                if not newer:  # an overlapping later write owns these bytes
                    shard.ranges = _cut(shard.ranges, offset, offset + n)
                    shard.ranges.append([offset, offset + n, crc])
                    shard.ranges.sort()
                self._counters["bytes_written"] += n

        def failed(exc: BaseException) -> None:
            # the range stays invalid; a later write of it must not see this one as "newer"
            with self._lock:
                shard.pending = [p for p in shard.pending if p[0] is not handle]
                shard.last_error = str(exc)

        # submitted, recorded and its bookkeeping attached as one block for a Ctrl-C (a
        # write not in ``pending`` is never waited for; without its callback, its range
        # stays invalid: offload.store.store's Note on Ctrl-C and IO in flight)
        with interrupts_deferred():
            with self._lock:
                shard.ranges = _cut(shard.ranges, offset, offset + n)  # invalid until completed
                handle = self._aio.write(
                    tensor, name, shard.offset + offset, label=f"shard {key!r}"
                )
                shard.pending.append((handle, offset, offset + n))
            handle.add_done_callback(completed, on_error=failed)
        return handle

    def read(self, key: str, tensor: torch.Tensor, offset: int = 0) -> IOHandle:
        """Read shard ``key``'s bytes at ``offset`` into ``tensor``.

        Raises:
            OffloadIOError: at once (ENODATA) when part of the range was never completely
                written; from ``wait()`` (EBADMSG) when a checksum does not match.
        """
        shard, n = self._span(key, tensor, offset, "read")
        self._drain(shard, offset, offset + n)
        with self._lock:
            if n and not _covered(shard.ranges, offset, offset + n):
                cause = f"; last write failed: {shard.last_error}" if shard.last_error else ""
                raise OffloadIOError(
                    errno.ENODATA,
                    f"shard {key!r} bytes [{offset}, {offset + n}) were never completely "
                    f"written{cause}",
                    self._files[shard.file],
                )
            checks = [
                (a, b, crc)
                for a, b, crc in shard.ranges
                if crc is not None and a >= offset and b <= offset + n
            ]
        name = self._files[shard.file]

        def completed() -> None:
            if self.checksum and checks:
                data = _bytes_of(tensor)
                for a, b, crc in checks:
                    got = zlib.crc32(data[a - offset : b - offset])
                    if got != crc:
                        with self._lock:
                            self._counters["checksum_failures"] += 1
                        raise OffloadIOError(
                            errno.EBADMSG,
                            f"checksum mismatch in shard {key!r} bytes [{a}, {b}): "
                            f"wrote crc32 {crc:08x}, read back {got:08x}",
                            name,
                        )
            with self._lock:
                self._counters["bytes_read"] += n

        with interrupts_deferred():  # (as write's)
            handle = self._aio.read(
                tensor,
                name,
                shard.offset + offset,
                label=f"shard {key!r}",
                urgent=self.urgent_reads,
            )
            handle.add_done_callback(completed)
        return handle

    def _span(self, key: str, tensor: torch.Tensor, offset: int, what: str) -> tuple[_Shard, int]:
        self._check_open()
        shard = self._get(key, what)
        if not isinstance(offset, int) or offset < 0 or offset % ALIGN:
            raise ValueError(
                f"NvmeStore.{what} {key!r}: offset={offset!r}; allowed: a multiple of {ALIGN} >= 0"
            )
        n = tensor.numel() * tensor.element_size()
        if offset + n > shard.capacity:
            raise ValueError(
                f"NvmeStore.{what} {key!r}: {n} bytes at offset {offset} pass the end of its "
                f"extent ({shard.capacity} bytes for nbytes={shard.nbytes})"
            )
        return shard, n

    def _drain(self, shard: _Shard, s: int = 0, e: int = 1 << 62) -> None:
        """Wait for the shard's writes overlapping ``[s, e)``, recording (not raising) errors."""
        with self._lock:
            pending = [h for h, a, b in shard.pending if a < e and b > s]
        for h in pending:
            try:
                h.wait()
            except Exception as exc:
                with self._lock:
                    shard.pending = [p for p in shard.pending if p[0] is not h]
                    shard.last_error = str(exc)

    def _get(self, key: str, what: str) -> _Shard:
        with self._lock:
            shard = self._shards.get(key)
        if shard is None:
            raise KeyError(f"NvmeStore.{what}: unknown key {key!r} (allocate it first)")
        return shard

    # ---- queries ----------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        """Whether ``key`` has an extent (allocated; written or not)."""
        with self._lock:
            return key in self._shards

    def __contains__(self, key: str) -> bool:
        return self.contains(key)

    def written(self, key: str) -> bool:
        """Whether all ``nbytes`` of ``key`` hold completed writes (waits for writes in flight)."""
        shard = self._get(key, "written")
        self._drain(shard)
        with self._lock:
            return _covered(shard.ranges, 0, shard.nbytes)

    def nbytes(self, key: str) -> int:
        """The size ``key`` was allocated with (bytes)."""
        return self._get(key, "nbytes").nbytes

    def keys(self) -> list[str]:
        """All allocated keys, in allocation order."""
        with self._lock:
            return list(self._shards)

    def stats(self) -> dict:
        """Shards (count), allocated/reserved bytes, data files (count), bytes written/read,
        checksum failures (count), and the engine's counters under ``aio``."""
        with self._lock:
            out = dict(
                shards=len(self._shards),
                allocated_bytes=sum(s.capacity for s in self._shards.values()),
                reserved_bytes=sum(self._file_end),
                files=len(self._files),
                **self._counters,
            )
        out["aio"] = self._aio.stats()
        return out

    # ---- lifetime ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NvmeStore at {self._dir!r} is closed")

    def close(self) -> None:
        """Wait for writes in flight, close an engine the store made, remove the files unless
        ``keep``. Idempotent; in a forked child it only forgets the store. Stopped part way (a
        Ctrl-C while it waits for a write), the next call finishes it: the store stays
        tracked (closed at exit) until its files are gone."""
        if self._closed_whole:
            return
        self._closed = True  # no new request from here on
        if os.getpid() == self._pid:
            for shard in list(self._shards.values()):
                self._drain(shard)
            if self._own_aio:
                self._aio.close()
            if not self.keep:
                _remove_tree(self._dir)
                self._remove_own_path()
        with interrupts_deferred():  # done, and no longer tracked, together
            self._closed_whole = True
            lifecycle.untrack(self)

    def abandon(self) -> None:
        """:meth:`close` for a process that is being terminated (see ``offload.io.lifecycle``):
        stops the store's own engine after the requests in flight and removes the files, taking
        no lock and not waiting for the writes' completion callbacks."""
        self._closed = True
        if os.getpid() != self._pid:
            return
        if self._own_aio:
            self._aio.abandon()
        if not self.keep:
            _remove_tree(self._dir)
            self._remove_own_path()

    def _remove_own_path(self) -> None:
        """``own_path``: the path goes once no store's directory is left in it."""
        if self._own_path:
            with contextlib.suppress(OSError):  # not empty: another store's, or a file
                os.rmdir(self._path)

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed_whole", True):  # (also a close stopped part way)
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"NvmeStore({self._dir!r}, shards={len(self._shards)}, checksum={self.checksum})"


def _make_path(path: str) -> None:
    """Creates ``path`` and each missing parent with mode 0700 (``mkdir -p``)."""
    missing = []
    level = os.path.abspath(path)
    while not os.path.lexists(level):
        missing.append(level)
        level = os.path.dirname(level)
    for level in reversed(missing):
        try:
            os.mkdir(level, 0o700)
            os.chmod(level, 0o700)  # whatever the umask
        except FileExistsError:
            continue  # made by someone else meanwhile
        except OSError as exc:
            name = errno.errorcode.get(exc.errno, str(exc.errno))
            raise OSError(
                exc.errno,
                f"nvme_path does not exist and cannot be created: mkdir {level!r} failed with "
                f"{name} ({exc.strerror}); allowed: an existing directory, or one that can be "
                "created",
                path,
            ) from exc
        logger.info("offload.io: created %s (mode 0700) for nvme_path", level)


def _remove_tree(directory: str) -> None:
    """Removes ``directory``, renamed first to the name that marks it garbage (``_owner``'s
    reclaiming prefix): a process killed while deleting it (SIGTERM's cleanup cut short by
    SIGKILL) leaves a directory the next store on the path removes, never data files whose
    ``owner.json`` is gone, which no store would reclaim. Once more if a file appeared in it
    meanwhile. Either name is removed: a removal stopped after its rename (a Ctrl-C in a
    close) left the renamed one for the next call."""
    head, name = os.path.split(directory)
    doomed = os.path.join(head, _owner.RECLAIMING + name)
    try:
        os.rename(directory, doomed)
    except OSError:  # gone already (renamed), or not renamable: deleted where it is
        pass
    for _ in range(2):  # once more if a file appeared meanwhile
        for tree in (doomed, directory):
            if os.path.lexists(tree):
                shutil.rmtree(tree, ignore_errors=True)
