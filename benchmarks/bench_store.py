"""bench_store: stream NVMe shards through a host budget of 1/8 of their size while computing.

What it measures, all in one run, interleaved (A B C D A B C D ...), medians of ``--reps``:

- ``io_alone``: read every shard from the NvmeStore into aligned buffers, ``--inflight`` reads
  in flight, nothing else running: the disk's bandwidth for this access pattern.
- ``compute_alone``: one matmul per shard on data already in memory, one distinct buffer per
  shard so no cache reuse flatters it (``x @ shard_as_matrix``,
  ``x`` sized so that compute per shard ~ IO per shard, the case where overlap matters most).
- ``store``: the real thing: ``TieredStore`` with a pool of 1/8 of the total bytes and
  ``prefetch_depth = buffers - 1``; per shard ``use`` -> ``fetch(HOST).wait()`` -> matmul ->
  ``release``; steady-state iterations (the first one records the trace).
- ``store_serial``: the same with ``prefetch_depth=0`` (fetch, then compute: the serial sum).

The bar: ``store <= 1.15 x max(io_alone, compute_alone)``. The serial sum
``io_alone + compute_alone`` is printed beside it. fio's O_DIRECT sequential read bandwidth on the
same directory is printed for reference when fio is installed ("unavailable" otherwise).

Threads: the machine has 2 cores. The matmul runs with ``torch.set_num_threads(--compute-threads)``
(default 1) so that the other core is left for the IO engine's threads and the store's
bookkeeping; compute_alone is measured with the same thread count, so the bar compares like
with like.
"""

from __future__ import annotations

import argparse
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
from offload.io import AsyncIO, BufferPool, NvmeStore, aligned_empty
from offload.store import Tier, TieredStore


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fio_read_gbps(directory: str, size_mb: int, block: int) -> str:
    fio = shutil.which("fio")
    if fio is None:
        return "unavailable"
    path = os.path.join(directory, "fio.dat")
    cmd = [fio, "--name=r", f"--filename={path}", f"--size={size_mb}M", f"--bs={block}",
           "--rw=read", "--direct=1", "--ioengine=libaio", "--iodepth=8", "--numjobs=1",
           "--output-format=json"]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        bw = json.loads(out.stdout)["jobs"][0]["read"]["bw_bytes"]
        return f"{bw / 1e9:.2f}"
    except (subprocess.SubprocessError, KeyError, ValueError, IndexError) as exc:
        return f"unavailable ({type(exc).__name__})"
    finally:
        if os.path.exists(path):
            os.remove(path)


class Bench:
    def __init__(self, args: argparse.Namespace, directory: str) -> None:
        self.args = args
        self.shard_bytes = args.shard_mib << 20
        self.numel = self.shard_bytes // 4
        self.side = int(self.numel**0.5)  # the shard viewed as a side x side matrix
        self.keys = [f"w{i}" for i in range(args.shards)]
        self.buffers = max(2, args.shards // 8)  # host budget: 1/8 of the total bytes
        self.aio = AsyncIO(block_size=1 << 20, queue_depth=args.queue_depth, thread_count=2)
        self.nvme = NvmeStore(directory, aio=self.aio)
        # one pool per store: a store owns its pool (cached copies stay in it until evicted)
        self.pools = {depth: BufferPool(self.buffers, self.shard_bytes, timeout=60.0)
                      for depth in (self.buffers - 1, 0)}  # fmt: skip
        self.x = torch.randn(8, self.side)  # rows resized by calibrate()
        # The shards, written once through a store that only registers them.
        self.stores = {
            depth: TieredStore(
                pool=self.pools[depth],
                nvme=self.nvme,
                prefetch_depth=depth,
                name="bench_store",
            )  # fmt: skip
            for depth in (self.buffers - 1, 0)
        }
        self.keyed = {}
        g = torch.Generator().manual_seed(0)
        init = torch.randn(self.numel, generator=g)
        for i, key in enumerate(self.keys):
            for depth, store in self.stores.items():
                name = f"{key}_{depth}"
                store.register(name, self.numel, torch.float32, Tier.NVME, init=init + i)
                self.keyed.setdefault(depth, []).append(name)

    def compute(self, shard: torch.Tensor) -> float:
        w = shard[: self.side * self.side].view(self.side, self.side)
        return float((self.x @ w)[0, 0])

    def io_alone(self) -> float:
        bufs = [aligned_empty(self.shard_bytes) for _ in range(self.args.inflight)]
        names = self.keyed[0]
        start = time.perf_counter()
        handles = []
        for i, name in enumerate(names):
            if len(handles) == len(bufs):
                handles.pop(0).wait()
            handles.append(self.nvme.read(name, bufs[i % len(bufs)]))
        for h in handles:
            h.wait()
        return time.perf_counter() - start

    def compute_alone(self) -> float:
        # distinct buffers, like the shards streamed in: no unfair cache reuse
        if not hasattr(self, "_resident"):
            self._resident = [torch.randn(self.numel) for _ in self.keys]
        start = time.perf_counter()
        for data in self._resident:
            self.compute(data)
        return time.perf_counter() - start

    def through_store(self, depth: int, iterations: int = 1) -> float:
        store = self.stores[depth]
        names = self.keyed[depth]
        elapsed = 0.0
        for _ in range(iterations):
            store.begin_iteration()
            start = time.perf_counter()
            for name in names:
                store.use(name, Tier.HOST)
                self.compute(store.fetch(name, Tier.HOST).wait())
                store.release(name, Tier.HOST)
            elapsed = time.perf_counter() - start
            store.end_iteration()
        return elapsed

    def calibrate(self, io_per_shard: float) -> None:
        """Pick the matmul's row count so one shard's compute ~ one shard's read."""
        data = torch.randn(self.side, self.side)
        rows = 8
        while True:
            self.x = torch.randn(rows, self.side)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                self.x @ data
                times.append(time.perf_counter() - start)
            per = statistics.median(times)
            if per >= io_per_shard * self.args.balance or rows >= 1 << 14:
                break
            rows = max(rows + 1, int(rows * min(4.0, io_per_shard * self.args.balance / per)))
        self.x = torch.randn(rows, self.side)

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.nvme.close()
        for pool in self.pools.values():
            pool.close()
        self.aio.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", default=None, help="directory on the disk to test (default: tmp)")
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--shard-mib", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--inflight", type=int, default=4, help="reads in flight for io_alone")
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--compute-threads", type=int, default=1)
    ap.add_argument("--balance", type=float, default=1.0, help="compute/IO per shard target")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.compute_threads)
    directory = tempfile.mkdtemp(prefix="bench_store-", dir=args.path)
    try:
        bench = Bench(args, directory)
        total = bench.shard_bytes * args.shards
        load0 = os.getloadavg()[0]
        print(f"machine: {cpu_model()}, {os.cpu_count()} cores, SIMD {_native.simd_level()}; "
              f"torch {torch.__version__}, compute threads {args.compute_threads}, IO backend "
              f"{bench.aio.backend}")  # fmt: skip
        print(f"{args.shards} shards x {args.shard_mib} MiB = {total >> 20} MiB on NVMe; host "
              f"pool {bench.buffers} x {args.shard_mib} MiB = {bench.buffers * bench.shard_bytes >> 20} "
              f"MiB (1/{total // (bench.buffers * bench.shard_bytes)}); prefetch_depth "
              f"{bench.buffers - 1}")  # fmt: skip
        fio = fio_read_gbps(directory, min(total >> 20, 1024), 1 << 20)
        bench.io_alone()  # warm the files' metadata
        io0 = statistics.median(bench.io_alone() for _ in range(5))
        bench.calibrate(io0 / args.shards)
        print(f"matmul per shard: ({bench.x.shape[0]} x {bench.side}) @ ({bench.side} x "
              f"{bench.side}) fp32")  # fmt: skip
        for depth in bench.stores:  # record the traces (first iteration of each store)
            bench.through_store(depth, iterations=2)
        rows: dict[str, list[float]] = {"io": [], "compute": [], "store": [], "serial": []}
        for _ in range(args.reps):  # interleaved: A B C D A B C D ...
            rows["io"].append(bench.io_alone())
            rows["compute"].append(bench.compute_alone())
            rows["store"].append(bench.through_store(bench.buffers - 1))
            rows["serial"].append(bench.through_store(0))
        med = {k: statistics.median(v) for k, v in rows.items()}
        bound = max(med["io"], med["compute"])
        ratio = med["store"] / bound
        # each rep's variants ran back to back: the per-rep ratio cancels slow drift of the machine
        per_rep = statistics.median(
            s / max(i, c) for s, i, c in zip(rows["store"], rows["io"], rows["compute"])
        )
        hits = bench.stores[bench.buffers - 1].stats()
        print()
        print("| variant | median s | GB/s of shard data | vs max(io, compute) |")
        print("|---|---|---|---|")
        for name, label in (("io", "IO alone (disk, same run)"), ("compute", "compute alone"),
                            ("store", "TieredStore, prefetch"), ("serial", "TieredStore, depth 0")):  # fmt: skip
            print(f"| {label} | {med[name]:.3f} | {total / med[name] / 1e9:.2f} | "
                  f"{med[name] / bound:.2f}x |")  # fmt: skip
        print(f"| serial sum io + compute | {med['io'] + med['compute']:.3f} | | "
              f"{(med['io'] + med['compute']) / bound:.2f}x |")  # fmt: skip
        print()
        print(f"fio O_DIRECT seq read, 1 MiB blocks, depth 8: {fio} GB/s")
        print(f"prefetch hit rate {hits['prefetch_hit_rate']:.3f} ({hits['prefetch_hits']} hits, "
              f"{hits['prefetch_misses']} "
              f"misses); direct IO {bench.aio.direct_io_active(directory)}")  # fmt: skip
        print(f"load average (1 min) at start {load0:.1f}, at end {os.getloadavg()[0]:.1f} "
              f"(other processes on these {os.cpu_count()} cores slow compute and IO unevenly)")  # fmt: skip
        verdict = "PASS" if ratio <= 1.15 else "MISS"
        print(f"bar: store / max(io, compute) = {ratio:.3f} of medians, {per_rep:.3f} median of "
              f"per-rep ratios (<= 1.15: {verdict}); reps "
              f"{args.reps}, runs io={[round(v, 3) for v in rows['io']]} "
              f"store={[round(v, 3) for v in rows['store']]}")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"medians": med, "runs": rows, "ratio": ratio, "per_rep": per_rep, "fio": fio},
                    f,
                )
        bench.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
