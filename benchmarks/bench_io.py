"""Sequential NVMe bandwidth: offload.io.AsyncIO vs fio vs DeepSpeed's async IO op vs aiofiles.

One run writes and then reads a ``--size`` file (default 2 GiB) with every variant, several
interleaved rounds (the order rotates each round), and prints medians and ratios. All variants
overwrite the same scratch file, which is preallocated and written once before the first round
so nobody pays for fresh extents. The scratch directory is removed at the end.

offload's variants use the engine as training configures it (``AioConfig``'s block size, queue
depth and threads unless given): ``offload`` reads/writes the whole file as one request into
one buffer from ``aligned_empty`` (populated 2 MiB huge pages); ``offload-pool`` moves it in
``--shard-size`` requests through a ``BufferPool`` of 4 buffers with 3 requests in flight, which
is what ``TieredStore`` does with shards; ``offload-4k`` is ``offload`` into torch's own memory
(``aligned_empty(huge_pages=False)``, first touched by torch's threads: what every buffer was
before the huge-page change, kept as the in-run reference); ``offload-ring`` streams the file
through ``queue_depth`` buffers of ``block_size`` bytes reused in a ring (fio's memory pattern);
``offload-threads`` is the pure-Python fallback backend. fio runs at several settings
(``--fio``: engine, depth, block size) and the bar compares against the best median of them.
The average disk request (bytes / requests completed on the file's block device during the
read, from ``/proc/diskstats``; other processes' IO counts too) shows how the kernel merged
and split the pieces.

Page cache: offload, fio and DeepSpeed use O_DIRECT (no page cache). aiofiles is buffered, so
its write is timed up to and including ``fsync`` (the data is on disk, as with O_DIRECT), and
before its read the file's pages are dropped with ``posix_fadvise(DONTNEED)`` (clean after the
fsync, so the kernel really drops them) plus ``echo 1 > /proc/sys/vm/drop_caches`` when
permitted. Reads therefore come from the disk for every variant.

Run:
    TORCH_EXTENSIONS_DIR=/work/peers-venv/torch_extensions /work/peers-venv/bin/python \
        benchmarks/bench_io.py --path /work --size 2GiB --rounds 7
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's offload, not another one installed in the venv

from offload import _native  # noqa: E402
from offload.config import AioConfig, parse_size  # noqa: E402
from offload.io import AsyncIO, BufferPool, aligned_empty  # noqa: E402

POOL_BUFFERS, POOL_IN_FLIGHT = 4, 3


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


def _device_of(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return os.major(st.st_dev), os.minor(st.st_dev)


def _disk_reads(dev: tuple[int, int]) -> tuple[int, int] | None:
    """(read requests completed, sectors read) of the block device ``dev``, or None."""
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                if (int(p[0]), int(p[1])) == dev:
                    return int(p[3]), int(p[5])
    except (OSError, ValueError, IndexError):
        pass
    return None


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


class OffloadPool:
    """AsyncIO into BufferPool buffers, one ``shard_size`` request each, a few in flight: the
    tiered store's pattern (a shard is read whole into a pool buffer, prefetch keeps several
    reads queued)."""

    name = "offload-pool"

    def __init__(self, args):
        self.args = args
        self.aio = AsyncIO(args.block_size, args.queue_depth, args.threads)
        self.pool = BufferPool(POOL_BUFFERS, args.shard_size)
        self.bufs = [self.pool.acquire() for _ in range(POOL_BUFFERS)]
        for b in self.bufs:
            b.fill_(0x5A)

    def _stream(self, path, op):
        inflight = []
        for i, off in enumerate(range(0, self.args.size, self.args.shard_size)):
            if len(inflight) >= POOL_IN_FLIGHT:
                inflight.pop(0).wait()
            n = min(self.args.shard_size, self.args.size - off)
            inflight.append(op(self.bufs[i % POOL_BUFFERS][:n], path, off))
        for h in inflight:
            h.wait()

    def write(self, path):
        self._stream(path, self.aio.write)

    def read(self, path):
        self._stream(path, self.aio.read)


class Fio:
    def __init__(self, args, engine, depth, block):
        self.exe = shutil.which("fio")
        if self.exe is None:
            raise RuntimeError("fio not installed")
        self.args, self.engine, self.depth, self.block = args, engine, depth, block
        self.name = f"fio {engine} qd{depth} {block >> 10}KiB"

    def _run(self, path, rw):
        a = self.args
        cmd = [
            self.exe, "--name=bench", f"--filename={path}", f"--ioengine={self.engine}",
            "--direct=1", f"--rw={rw}", f"--bs={self.block}", f"--iodepth={self.depth}",
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
    cfg = AioConfig()
    p.add_argument("--block-size", default=str(cfg.block_size), help="offload/DeepSpeed block")
    p.add_argument("--queue-depth", type=int, default=cfg.queue_depth, help="offload/DeepSpeed")
    p.add_argument("--threads", type=int, default=cfg.thread_count, help="offload/DeepSpeed")
    p.add_argument("--shard-size", default="32MiB", help="request size of offload-pool (32MiB)")
    p.add_argument(
        "--fio",
        default="libaio:8:1MiB,libaio:32:1MiB,io_uring:32:1MiB,libaio:8:4MiB",
        help="fio settings engine:depth:block, comma-separated; the bar takes the best",
    )
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (7)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    args.size = parse_size(args.size, key="size")
    args.block_size = parse_size(args.block_size, key="block_size")
    args.shard_size = parse_size(args.shard_size, key="shard_size")
    if args.size > 4 << 30:
        p.error("--size is capped at 4GiB (scratch disk budget)")
    fio_settings = []
    for item in args.fio.split(","):
        engine, depth, block = item.split(":")
        fio_settings.append((engine, int(depth), parse_size(block, key="fio block")))

    scratch = tempfile.mkdtemp(prefix="offload-bench-io-", dir=args.path)
    path = os.path.join(scratch, "scratch.bin")
    results: dict[str, dict[str, list[float]]] = {}
    unavailable: dict[str, str] = {}
    load = [os.getloadavg()[0]]
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    try:
        buf = aligned_empty(args.size, pin=False)
        buf.copy_(torch.randint(0, 256, (args.size,), dtype=torch.uint8))
        buf_4k = aligned_empty(args.size, pin=False, huge_pages=False)
        buf_4k.copy_(buf)  # first touched by torch's threads, like any torch buffer
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, args.size)
        os.close(fd)
        dev = _device_of(path)
        variants = [Offload("offload", buf, args), OffloadPool(args)]
        variants += [Offload("offload-4k", buf_4k, args), OffloadRing(args)]
        if _native.available():
            variants.append(Offload("offload-threads", buf, args, fallback=True))
        makers = [(f"fio {e} qd{d} {b >> 10}KiB", lambda e=e, d=d, b=b: Fio(args, e, d, b))
                  for e, d, b in fio_settings]  # fmt: skip
        makers += [
            ("deepspeed", lambda: DeepSpeed(args)),
            ("aiofiles", lambda: Aiofiles(buf, args)),
        ]
        for name, make in makers:
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
                before = _disk_reads(dev)
                rd = _timed(v.read, path, args.size)
                after = _disk_reads(dev)
                d = results.setdefault(v.name, {"write": [], "read": [], "req_kib": []})
                d["write"].append(w)
                d["read"].append(rd)
                req = ""
                if before and after and after[0] > before[0]:
                    d["req_kib"].append(
                        (after[1] - before[1]) * 512 / 1024 / (after[0] - before[0])
                    )
                    req = f"  avg disk request {d['req_kib'][-1]:6.0f} KiB"
                print(
                    f"round {r} {v.name:24s} write {w:6.2f} GB/s  read {rd:6.2f} GB/s{req}",
                    flush=True,
                )
            load.append(os.getloadavg()[0])
        # the data read back by offload is what was written (one check, untimed)
        check = aligned_empty(args.size, pin=False)
        variants[0].write(path)
        variants[0].aio.read(check, path).wait()
        assert torch.equal(check, buf), "offload read back different bytes"
        cache_note = next((v.cache_note for v in variants if isinstance(v, Aiofiles)), "")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    med = {k: {op: statistics.median(v) if v else 0.0 for op, v in d.items()}
           for k, d in results.items()}  # fmt: skip
    ours = med["offload"]
    fios = [k for k in med if k.startswith("fio ")]
    best_fio = {op: max(fios, key=lambda k: med[k][op]) for op in ("write", "read")} if fios else {}
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    print()
    print(
        f"{started}; size {args.size / 2**30:.2f} GiB; offload and DeepSpeed: block "
        f"{args.block_size >> 10} KiB, queue depth {args.queue_depth}, threads {args.threads}; "
        f"offload-pool: {args.shard_size >> 20} MiB requests, {POOL_IN_FLIGHT} in flight; "
        f"rounds {args.rounds}; median GB/s (1e9 B/s); aiofiles cache drop: {cache_note or 'n/a'}"
    )
    print(f"machine: {cpu}, {os.cpu_count()} cores, SIMD {_native.simd_level()}, {sys.platform}")
    print(
        f"load average (1 min) at start and after each round: {' '.join(f'{x:.1f}' for x in load)}"
    )
    print()
    print("| variant | write GB/s | read GB/s | avg disk request (read) | offload/variant write "
          "| offload/variant read |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    names = ["offload", "offload-pool", "offload-4k", "offload-ring", "offload-threads"]
    names += [k for k in med if k.startswith("fio ")] + ["deepspeed", "aiofiles"]
    for name in names:
        if name in med:
            m = med[name]
            req = f"{m['req_kib']:.0f} KiB" if m["req_kib"] else "-"
            print(
                f"| {name} | {m['write']:.2f} | {m['read']:.2f} | {req} | "
                f"{ours['write'] / m['write']:.2f}x | {ours['read'] / m['read']:.2f}x |"
            )
    for name, why in unavailable.items():
        print(f"| {name} | unavailable | unavailable | | | |")
        print(f"  {name}: {why}")
    bars = []
    for op, best in best_fio.items():
        for name in ("offload", "offload-pool"):
            r = med[name][op] / med[best][op]
            bars.append(
                f"{name} {op} vs the best fio ({best}) {r:.0%} "
                f"({'PASS' if r >= 0.9 else 'FAIL'} >= 90%)"
            )
    for op in ("write", "read"):
        bars.append(f"offload {op} vs offload-4k {ours[op] / med['offload-4k'][op]:.2f}x")
    if "aiofiles" in med:
        for op in ("write", "read"):
            r = ours[op] / med["aiofiles"][op]
            bars.append(f"{op} vs aiofiles {r:.2f}x ({'PASS' if r >= 3 else 'FAIL'} >= 3x)")
    if "aiofiles" in med and best_fio:  # how much room the disk leaves over aiofiles
        for op, best in best_fio.items():
            bars.append(f"(best fio/aiofiles {op} {med[best][op] / med['aiofiles'][op]:.2f}x)")
    print("bars:\n  " + "\n  ".join(bars))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), runs=results, median=med, unavailable=unavailable), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
