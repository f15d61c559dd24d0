"""Measure AsyncIO bandwidth on a disk for a grid of settings (``offload tune-io``).

Note: method. One scratch file of ``size`` bytes in a private directory under the target path,
preallocated with ``posix_fallocate`` and written once before the sweep so that every setting
writes over the same, already-written extents (the first write into fresh extents is slower on
ext4 and would punish whichever setting ran first). For each (block size, queue depth, threads)
point the whole file is written, then read, ``repeats`` times, as requests of at most
``MAX_BUFFER`` bytes all in flight together from one 4096-aligned buffer of that size (one
request of the whole file from a buffer as big: ``--size 64GiB``, larger than a drive's
cache as a disk benchmark wants it, took 64 GiB of RAM and got the process killed); the median
of each is kept. O_DIRECT keeps the page cache out of the numbers; where the
filesystem refuses it the sweep runs buffered and says so. The scratch directory is always removed.
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

from offload.io.aligned import aligned_empty, round_up
from offload.io.async_io import AsyncIO, probe_direct_io

MAX_BUFFER = 256 << 20  # host bytes the sweep holds at most (see Note)


@dataclass(frozen=True, slots=True)
class TunePoint:
    """One measured setting: bytes per piece, pieces in flight, IO threads, GB/s (1e9 B/s)."""

    block_size: int
    queue_depth: int
    thread_count: int
    write_gbps: float
    read_gbps: float

    @property
    def score(self) -> float:
        """Harmonic mean of read and write GB/s: the rate of a write-then-read round trip."""
        if self.write_gbps <= 0 or self.read_gbps <= 0:
            return 0.0
        return 2 / (1 / self.write_gbps + 1 / self.read_gbps)


def sweep(
    path: str,
    size: int,
    block_sizes: list[int],
    queue_depths: list[int],
    thread_counts: list[int],
    *,
    repeats: int = 1,
    direct_io: bool = True,
    progress=None,
) -> tuple[list[TunePoint], bool]:
    """Measure every point of the grid; returns (points, whether O_DIRECT was used)."""
    size = round_up(max(size, 4096))
    direct = direct_io and probe_direct_io(path)
    scratch = tempfile.mkdtemp(prefix="offload-tune-io-", dir=path)
    try:
        name = os.path.join(scratch, "scratch.bin")
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        buf = aligned_empty(min(size, MAX_BUFFER), pin=False)
        buf.fill_(0x5A)

        def whole_file(submit) -> None:
            step = buf.numel()
            handles = [submit(buf[: min(step, size - at)], name, at) for at in range(0, size, step)]
            for handle in handles:
                handle.wait()

        with AsyncIO(block_size=max(block_sizes), direct_io=direct) as aio:
            whole_file(aio.write)  # lay the extents out once (see Note)
        points = []
        for bs, qd, th in itertools.product(block_sizes, queue_depths, thread_counts):
            w, r = [], []
            with AsyncIO(block_size=bs, queue_depth=qd, thread_count=th, direct_io=direct) as aio:
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    whole_file(aio.write)
                    if not direct:
                        os.sync()
                    w.append(size / (time.perf_counter() - t0) / 1e9)
                    t0 = time.perf_counter()
                    whole_file(aio.read)
                    r.append(size / (time.perf_counter() - t0) / 1e9)
            p = TunePoint(bs, qd, th, statistics.median(w), statistics.median(r))
            points.append(p)
            if progress is not None:
                progress(p)
        return points, direct
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
