"""Where an NVMe iteration's time and disk work go, phase by phase (a diagnostic, not a bar).

    python benchmarks/nvme_phases.py [--size 50M] [--iters 8] [--path /work] [--device vda]
                                     [--step-in-backward]

Trains the demo GPT with params and optimizer state on NVMe, with bench_e2e's configuration, and
prints for each steady-state iteration: the wall time of forward, backward and ``step()``; how
long the disk had IO in flight during forward and backward (``io_ticks`` of
``/proc/diskstats``, so other processes' IO on that disk counts too); and the bytes the disk
read and wrote in each phase. The background update of the previous step runs inside the
forward, so a disk busy for most of the forward and idle for most of the backward is the
signature of an update that cannot start before ``step()``. With ``--step-in-backward``
(``offload_optimizer.step_in_backward``) the update runs inside the backward instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e  # noqa: E402

import offload  # noqa: E402
from offload.config import parse_size  # noqa: E402


def default_device(path: str) -> str:
    """The block device holding ``path`` (its whole disk, as /proc/diskstats names it)."""
    dev = os.stat(path).st_dev
    name = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
    parent = name.parent.name  # a partition's parent is its disk
    return parent if (name.parent / "dev").exists() else name.name


def disk(device: str) -> tuple[float, int, int]:
    """(seconds with IO in flight, bytes read, bytes written) of ``device`` so far."""
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if f[2] == device:
            return int(f[12]) / 1e3, int(f[5]) * 512, int(f[9]) * 512
    raise SystemExit(f"--device {device!r}: not in /proc/diskstats")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="50M")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=8, help="timed iterations (after 2 warm-up)")
    ap.add_argument("--path", default="/work", help="directory on the disk under test")
    ap.add_argument("--device", default=None, help="block device name (default: the --path disk)")
    ap.add_argument("--buffer-size", default="8MiB")
    ap.add_argument("--step-in-backward", action="store_true")
    args = ap.parse_args()
    device = args.device or default_device(args.path)
    disk(device)  # fails early, naming the device, when it is not there

    torch.manual_seed(0)
    model = bench_e2e.GPT(bench_e2e.config_for_size(args.size, seq_len=args.seq))
    x = torch.randint(0, 256, (args.batch, args.seq + 1))
    work = Path(tempfile.mkdtemp(prefix="nvme_phases-", dir=args.path))
    aio = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2}
    cfg = bench_e2e.nvme_config(
        work, parse_size(args.buffer_size), aio, step_in_backward=args.step_in_backward
    )
    model, opt = offload.wrap(model, cfg)
    rows = []
    try:
        for it in range(args.iters + 2):
            d0, t0 = disk(device), time.perf_counter()
            loss = bench_e2e.lm_loss(model(x[:, :-1]), x[:, 1:])
            d1, t1 = disk(device), time.perf_counter()
            loss.backward()
            d2, t2 = disk(device), time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            if it >= 2:
                rows.append(
                    (
                        t1 - t0,
                        t2 - t1,
                        t3 - t2,
                        d1[0] - d0[0],
                        d2[0] - d1[0],
                        (d1[1] - d0[1]) / 1e6,
                        (d1[2] - d0[2]) / 1e6,
                        (d2[1] - d1[1]) / 1e6,
                        (d2[2] - d1[2]) / 1e6,
                    )
                )
    finally:
        opt.close()
        shutil.rmtree(work, ignore_errors=True)
    head = (
        "forward_s backward_s step_s | disk_busy_fwd_s disk_busy_bwd_s | "
        "fwd_read_MB fwd_write_MB | bwd_read_MB bwd_write_MB"
    )
    mode = "step in backward" if args.step_in_backward else "default step"
    print(f"# nvme_phases  {time.strftime('%Y-%m-%d %H:%M')}  device {device}  {mode}")
    print(head)
    for r in rows:
        print(" ".join(f"{v:8.3f}" for v in r))
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    print("median " + " ".join(f"{v:8.3f}" for v in med))
    return 0


if __name__ == "__main__":
    sys.exit(main())
