"""Sequential NVMe bandwidth: offload.io.AsyncIO vs fio vs DeepSpeed's async IO op vs aiofiles.

One run writes and then reads a ``--size`` file (default 2 GiB) with every variant, at the same
block size and queue depth, several interleaved rounds (A B C D E, A B C D E, ...), and prints
medians and ratios. All variants overwrite the same scratch file, which is preallocated and
written once before the first round so nobody pays for fresh extents. The scratch directory is
removed at the end.

Variants: ``offload`` reads/writes the whole file as one request from one buffer (the swap
path's pattern); ``offload-ring`` streams it through ``queue_depth`` buffers of ``block_size``
bytes reused in a ring, which is fio's memory pattern; ``offload-threads`` is the pure-Python
fallback backend.

Page cache: offload, fio and DeepSpeed use O_DIRECT (no page cache). aiofiles is buffered, so
its write is timed up to and including ``fsync`` (the data is on disk, as with O_DIRECT), and
before its read the file's pages are dropped with ``posix_fadvise(DONTNEED)`` (clean after the
fsync, so the kernel really drops them) plus ``echo 1 > /proc/sys/vm/drop_caches`` when
permitted. Reads therefore come from the disk for every variant.

Run:
    TORCH_EXTENSIONS_DIR=/work/peers-venv/torch_extensions /work/peers-venv/bin/python \
        benchmarks/bench_io.py --path /work --size 2GiB --rounds 5
Without fio, DeepSpeed or aiofiles the column says "unavailable".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from offload import _native
from offload.config import parse_size
from offload.io import AsyncIO, aligned_empty


def _drop_cache(path: str) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "fadvise+drop_caches"
    except OSError:
        return "fadvise"


class Offload:
    def __init__(self, name, buf, args, fallback=False):
        self.name, self.buf = name, buf
        if fallback:
            with _native.force_fallback():
                self.aio = AsyncIO(args.block_size, args.queue_depth, args.threads)
        else:
            self.aio = AsyncIO(args.block_size, args.queue_depth, args.threads)

    def write(self, path):
        self.aio.write(self.buf, path).wait()

    def read(self, path):
        self.aio.read(self.buf, path).wait()


class OffloadRing:
    """AsyncIO with fio's memory pattern: queue_depth buffers of block_size, reused in a ring.

    fio streams the file through ``iodepth x bs`` bytes of memory; the swap path reads into a
    whole shard-sized buffer. On virtual disks the host's copy into guest memory is faster
    when the destination stays cache-resident, so both patterns are reported.
    """

    name = "offload-ring"

    def __init__(self, args):
        self.args = args
        self.aio = AsyncIO(args.block_size, args.queue_depth, args.threads)
        self.ring = [aligned_empty(args.block_size, pin=False) for _ in range(args.queue_depth)]
        for b in self.ring:
            b.fill_(0x5A)

    def _stream(self, path, op):
        handles = [None] * len(self.ring)
        for i, off in enumerate(range(0, self.args.size, self.args.block_size)):
            slot = i % len(self.ring)
            if handles[slot] is not None:
                handles[slot].wait()
            n = min(self.args.block_size, self.args.size - off)
            handles[slot] = op(self.ring[slot][:n], path, off)
        for h in handles:
            if h is not None:
                h.wait()

    def write(self, path):
        self._stream(path, self.aio.write)

    def read(self, path):
        self._stream(path, self.aio.read)


class Fio:
    name = "fio"

    def __init__(self, args):
        self.exe = shutil.which("fio")
        if self.exe is None:
            raise RuntimeError("fio not installed")
        self.args = args

    def _run(self, path, rw):
        a = self.args
        cmd = [
            self.exe, "--name=bench", f"--filename={path}", "--ioengine=libaio", "--direct=1",
            f"--rw={rw}", f"--bs={a.block_size}", f"--iodepth={a.queue_depth}",
            f"--size={a.size}", "--numjobs=1", "--output-format=json",
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        job = json.loads(out[out.index("{") :])["jobs"][0]
        return job[rw]["bw_bytes"] / 1e9  # fio's own clock (excludes its process start)

    def write(self, path):
        return self._run(path, "write")

    def read(self, path):
        return self._run(path, "read")


class DeepSpeed:
    name = "deepspeed"

    def __init__(self, args):
        from deepspeed.ops.op_builder import AsyncIOBuilder

        mod = AsyncIOBuilder().load(verbose=False)
        self.h = mod.aio_handle(args.block_size, args.queue_depth, False, False, args.threads)
        self.buf = self.h.new_cpu_locked_tensor(args.size, torch.empty(0, dtype=torch.uint8))
        self.buf.fill_(0x5A)

    def write(self, path):
        self.h.sync_pwrite(self.buf, path)

    def read(self, path):
        self.h.sync_pread(self.buf, path)


class Aiofiles:
    name = "aiofiles"

    def __init__(self, buf, args):
        import aiofiles

        self.aiofiles, self.args = aiofiles, args
        self.view = memoryview(buf.numpy())
        self.cache_note = ""

    async def _write(self, path):
        bs = self.args.block_size
        async with self.aiofiles.open(path, "r+b") as f:  # overwrite in place, no truncation
            for pos in range(0, len(self.view), bs):
                await f.write(self.view[pos : pos + bs])
            await f.flush()
            os.fsync(f.fileno())  # timed: the data must reach the disk, as with O_DIRECT

    async def _read(self, path):
        bs = self.args.block_size
        async with self.aiofiles.open(path, "rb", buffering=0) as f:
            for pos in range(0, len(self.view), bs):
                await f.readinto(self.view[pos : pos + bs])

    def write(self, path):
        asyncio.run(self._write(path))

    def read(self, path):
        self.cache_note = _drop_cache(path)  # untimed: reads must come from the disk
        asyncio.run(self._read(path))


def _timed(fn, path, size):
    t0 = time.perf_counter()
    got = fn(path)
    dt = time.perf_counter() - t0
    return got if isinstance(got, float) else size / dt / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default="/work", help="directory on the disk to measure (/work)")
    p.add_argument("--size", default="2GiB", help="file size, 1-4 GiB (2GiB)")
    p.add_argument("--block-size", default="1MiB", help="block size for every variant (1MiB)")
    p.add_argument("--queue-depth", type=int, default=8, help="iodepth for every variant (8)")
    p.add_argument("--threads", type=int, default=1, help="IO threads (offload, DeepSpeed) (1)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    args.size = parse_size(args.size, key="size")
    args.block_size = parse_size(args.block_size, key="block_size")
    if args.size > 4 << 30:
        p.error("--size is capped at 4GiB (scratch disk budget)")

    scratch = tempfile.mkdtemp(prefix="offload-bench-io-", dir=args.path)
    path = os.path.join(scratch, "scratch.bin")
    results: dict[str, dict[str, list[float]]] = {}
    unavailable: dict[str, str] = {}
    try:
        buf = aligned_empty(args.size, pin=False)
        buf.copy_(torch.randint(0, 256, (args.size,), dtype=torch.uint8))
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, args.size)
        os.close(fd)
        variants = [Offload("offload", buf, args), OffloadRing(args)]
        if _native.available():
            variants.append(Offload("offload-threads", buf, args, fallback=True))
        for name, make in (
            ("fio", lambda: Fio(args)),
            ("deepspeed", lambda: DeepSpeed(args)),
            ("aiofiles", lambda: Aiofiles(buf, args)),
        ):
            try:
                variants.append(make())
            except Exception as exc:  # missing tool or import: report, keep going
                unavailable[name] = f"{type(exc).__name__}: {exc}"[:120]
        assert variants[0].aio.direct_io_active(path), "O_DIRECT not available on --path"
        variants[0].write(path)  # lay out the extents once (untimed)
        for r in range(args.rounds):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                w = _timed(v.write, path, args.size)
                rd = _timed(v.read, path, args.size)
                d = results.setdefault(v.name, {"write": [], "read": []})
                d["write"].append(w)
                d["read"].append(rd)
                print(
                    f"round {r} {v.name:16s} write {w:6.2f} GB/s  read {rd:6.2f} GB/s", flush=True
                )
        # the data read back by offload is what was written (one check, untimed)
        check = aligned_empty(args.size, pin=False)
        variants[0].write(path)
        variants[0].aio.read(check, path).wait()
        assert torch.equal(check, buf), "offload read back different bytes"
        cache_note = next((v.cache_note for v in variants if isinstance(v, Aiofiles)), "")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    med = {k: {op: statistics.median(v[op]) for op in v} for k, v in results.items()}
    ours = med["offload"]
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    print()
    print(
        f"size {args.size / 2**30:.2f} GiB, block {args.block_size >> 10} KiB, "
        f"queue depth {args.queue_depth}, threads {args.threads}, rounds {args.rounds}; "
        f"median GB/s (1e9 B/s); aiofiles cache drop: {cache_note or 'n/a'}"
    )
    print(f"machine: {cpu}, {os.cpu_count()} cores, SIMD {_native.simd_level()}, {sys.platform}")
    print()
    print("| variant | write GB/s | read GB/s | offload/variant write | offload/variant read |")
    print("|---|---|---|---|---|")
    names = ["offload", "offload-ring", "offload-threads", "fio", "deepspeed", "aiofiles"]
    for name in names:
        if name in med:
            m = med[name]
            print(
                f"| {name} | {m['write']:.2f} | {m['read']:.2f} | "
                f"{ours['write'] / m['write']:.2f}x | {ours['read'] / m['read']:.2f}x |"
            )
        elif name in unavailable:
            print(f"| {name} | unavailable | unavailable | | |")
    for name, why in unavailable.items():
        print(f"  {name}: {why}")
    bars = []
    if "fio" in med:
        for name in ("offload", "offload-ring"):
            for op in ("write", "read"):
                r = med[name][op] / med["fio"][op]
                bars.append(f"{name} {op} vs fio {r:.0%} ({'PASS' if r >= 0.9 else 'FAIL'} >= 90%)")
    if "aiofiles" in med:
        for op in ("write", "read"):
            r = ours[op] / med["aiofiles"][op]
            bars.append(f"{op} vs aiofiles {r:.2f}x ({'PASS' if r >= 3 else 'FAIL'} >= 3x)")
    if "aiofiles" in med and "fio" in med:  # how much room the disk leaves over aiofiles
        for op in ("write", "read"):
            bars.append(f"(fio/aiofiles {op} {med['fio'][op] / med['aiofiles'][op]:.2f}x)")
    print("bars: " + "; ".join(bars))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), runs=results, median=med, unavailable=unavailable), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
