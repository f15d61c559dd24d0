"""Where an NVMe iteration's time and disk work go, phase by phase (a diagnostic, not a bar).

    python benchmarks/nvme_phases.py [--size 50M] [--iters 8] [--path /work] [--device vda]
                                     [--step-in-backward] [--recipe clip|under] [--host]
                                     [--copy-gathers]

Trains the demo GPT with params and optimizer state on NVMe, with bench_e2e's configuration, and
prints for each steady-state iteration: the wall time of forward, backward and ``step()``; how
long the disk had IO in flight during forward and backward (``io_ticks`` of
``/proc/diskstats``, so other processes' IO on that disk counts too); the bytes the disk
read and wrote in each phase; and how long the training thread spent in the phase's gathers,
split as telemetry splits it: waiting for reads (``io_wait_seconds``) and copying to the
device (``gather_copy_seconds``), waiting for the update (``step_wait_seconds``: a forward
for each unit's update, a backward for the update to end), and in all of offload's hooks,
those three included (``hook_seconds``: gathers, releases, taking the gradients). The background update of the
previous step runs inside the forward, so a disk busy for most of the forward and idle for
most of the backward is the signature of an update that cannot start before ``step()``. With
``--step-in-backward`` (``offload_optimizer.step_in_backward``) the update runs inside the
backward instead.

``--recipe clip`` / ``--recipe under`` run bench_e2e's recipe instead (the step in backward,
accumulation 2 on fresh batches, ``gradient_clipping`` 1.0; ``clip``: loss x3, clipping in every
step, the update after the last backward; ``under``: loss x0.5, the update speculative in the
last backward, kept): the columns are then each micro-step's forward and backward, and the
step. Each run also prints a plain model's forward and backward (same data, no offload) as the
compute reference.

``--host`` keeps params and optimizer state in host memory instead (the same units gathered and
released, gradients taken by their owner, the update inside ``step()``; no disk): what the
hooks and gathers cost without the NVMe moves and an update running beside the compute.

``--copy-gathers`` makes the CPU gathers copy each piece out of its swap buffer, as they did
before they lent the buffers' pages to the unit (``offload/device/pages.py``, Note on lent
pages), with the param pool as large as lending makes it: what the copies alone cost.

``--hook-functions`` also prints, per timed iteration, the training thread's milliseconds and
calls in each of ``HOOK_FUNCTIONS`` (offload's functions the hooks run, wrapped by this script
for the run; inclusive times, so they nest: a gather's time holds its page moves and its waits
for reads). What ``hook_seconds`` is made of, function by function; the wrappers add ~0.4 us a
call (measured; <1 ms an iteration of the recipe). Other threads' calls are not counted.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_e2e  # noqa: E402

import offload  # noqa: E402
from offload.api.wrap import engine_of  # noqa: E402
from offload.config import parse_size  # noqa: E402
from offload.device import pages  # noqa: E402

# telemetry's timers shown per pass: the gathers' waits for reads and their copies, the waits
# for the update (a forward's for each unit's, a backward's for its end), and all the time in
# offload's hooks (those three included): what offload does on the training thread
SPENT = ("io_wait_seconds", "gather_copy_seconds", "step_wait_seconds", "hook_seconds")
PER_PASS = 4 + len(SPENT)  # figures per pass: seconds, disk busy, MB read, MB written, SPENT

# what --hook-functions times on the training thread, (module, class, method): the hooks' entry
# points first, then what they call
HOOK_FUNCTIONS = (
    ("offload.runtime.units", "UnitRun", "gather"),
    ("offload.runtime.units", "UnitRun", "release"),
    ("offload.homes.grads", "GradParts", "accumulate"),
    # the last backward's gradients: less `take` (the wait for the earlier micro-steps' sum:
    # `block_on`, a read in flight) and `accumulate`, what is left is the wait for the update to
    # consume what the backward handed it
    ("offload.homes.grads", "HeldNvmeGrads", "absorb"),
    ("offload.store.store", "TieredStore", "take"),
    ("offload.store.reclaim", "Reclaimer", "block_on"),
    ("offload.homes.optim", "NvmeOptim", "read_head"),
    ("offload.store.store", "TieredStore", "fetch"),
    ("offload.store.store", "TieredStore", "release"),
    ("offload.store.store", "TieredStore", "_want"),
    ("offload.store.store", "TieredStore", "_poll"),
    ("offload.device.pages", "PageBlocks", "lend"),
    ("offload.device.pages", "PageBlocks", "take_back"),
    ("offload.device.pages", "PageBlocks", "make_room"),
    ("offload.device.pages", "PageBlocks", "drop"),
    ("offload.io.async_io", "AsyncIO", "read"),
    ("offload.io.async_io", "AsyncIO", "write"),
    ("offload.io.async_io", "IOHandle", "wait"),
)


class HookFunctions:
    """Seconds and calls of the training thread in each of ``HOOK_FUNCTIONS`` (wrapped on
    creation, unwrapped by :meth:`restore`); :meth:`clear` starts the count over."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._saved = []
        main = threading.main_thread()
        for module, cls, name in HOOK_FUNCTIONS:
            owner = getattr(importlib.import_module(module), cls)
            key, fn = f"{cls}.{name}", owner.__dict__[name]  # KeyError: not defined there
            self._saved.append((owner, name, fn))

            def timed(*a, _fn=fn, _key=key, **k):
                if threading.current_thread() is not main:
                    return _fn(*a, **k)
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    self.seconds[_key] = self.seconds.get(_key, 0.0) + time.perf_counter() - t0
                    self.calls[_key] = self.calls.get(_key, 0) + 1

            setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def restore(self) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)

    def print(self, iters: int) -> None:
        print(f"training thread's time in offload's functions per timed iteration (of {iters}):")
        for key, sec in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            print(f"  {key:26s} {1000 * sec / iters:7.1f} ms  {self.calls[key] / iters:6.0f} calls")


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
    bench_e2e.add_buffers(ap)
    ap.add_argument("--step-in-backward", action="store_true")
    ap.add_argument("--recipe", choices=("clip", "under"), default=None)
    ap.add_argument("--host", action="store_true", help="params and optimizer in host memory")
    ap.add_argument(
        "--copy-gathers",
        action="store_true",
        help="gathers copy each piece instead of lending its pages (the pool keeps its size)",
    )
    ap.add_argument(
        "--hook-functions",
        action="store_true",
        help="also print the training thread's time in each of offload's hook functions",
    )
    args = ap.parse_args()
    device = args.device or default_device(args.path)
    disk(device)  # fails early, naming the device, when it is not there

    torch.manual_seed(0)
    base = bench_e2e.GPT(bench_e2e.config_for_size(args.size, seq_len=args.seq))
    plain = copy.deepcopy(base)
    x = torch.randint(0, 256, (args.batch, args.seq + 1))
    work = Path(tempfile.mkdtemp(prefix="nvme_phases-", dir=args.path))
    aio = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2}
    in_backward = args.step_in_backward or args.recipe is not None
    cfg = bench_e2e.nvme_config(
        work, parse_size(args.buffer_size), aio, in_backward, counts=args.buffers
    )
    if args.host:  # the same units and hooks, no disk (the module docstring)
        cfg["offload_param"] = {"device": "cpu", "persistence_threshold": 0}
        cfg["offload_optimizer"] = {"device": "cpu"}
    if args.copy_gathers:  # what the copies cost (the module docstring)
        pages.PageBlocks.lends = property(lambda blocks: False)
    micro_steps, scale = 1, 1.0
    if args.recipe is not None:
        cfg["gradient_clipping"] = 1.0
        micro_steps, scale = 2, {"clip": 3.0, "under": 0.5}[args.recipe]
    model, opt = offload.wrap(base, cfg)
    timers = engine_of(model).timers  # this step's seconds so far (cleared by step())

    def mark():
        spent = tuple(timers.get(k, 0.0) for k in SPENT)
        return disk(device), time.perf_counter(), spent

    rows = []
    functions = HookFunctions() if args.hook_functions else None
    try:
        for it in range(args.iters + 2):
            if functions is not None and it == 2:
                functions.clear()  # the warm-up iterations are not counted
            marks = [mark()]
            for _ in range(micro_steps):
                batch = x
                if args.recipe is not None:  # bench_e2e.recipe_step's data
                    batch = torch.randint(0, 256, x.shape, generator=bench_e2e.RECIPE_DATA)
                loss = bench_e2e.lm_loss(model(batch[:, :-1]), batch[:, 1:]) * (scale / micro_steps)
                marks.append(mark())
                loss.backward()
                marks.append(mark())
            opt.step()
            opt.zero_grad()
            marks.append((*mark()[:2], marks[-1][2]))  # step() runs no hook; it clears them
            if it >= 2:
                rows.append(phase_row(marks))
    finally:
        opt.close()
        shutil.rmtree(work, ignore_errors=True)
        if functions is not None:
            functions.restore()
    reference = plain_passes(plain, x, args.iters)
    passes = [f"{k}{m}" for m in range(micro_steps) for k in ("fwd", "bwd")] + ["step"]
    if micro_steps == 1:
        passes = ["forward", "backward", "step"]
    mode = (
        f"recipe {args.recipe}"
        if args.recipe
        else "step in backward"
        if in_backward
        else "default step"
    )
    if args.host:
        mode += ", params and optimizer in host memory"
    if args.copy_gathers:
        mode += ", gathers copying"
    print(f"# nvme_phases  {time.strftime('%Y-%m-%d %H:%M')}  device {device}  {mode}")
    print(
        f"# plain model (no offload), median of {args.iters}: forward {reference[0]:.3f} s, backward {reference[1]:.3f} s"
    )
    print(
        "per pass: seconds, disk busy seconds, read MB, write MB, gathers' read waits and "
        "copies, waits for the update, all of offload's hooks (seconds)"
    )
    print(" | ".join(f"{p:>{8 * PER_PASS - 1}s}" for p in passes))
    for r in rows:
        print(row_line(r))
    print("median")
    print(row_line([statistics.median(col) for col in zip(*rows, strict=True)]))
    if functions is not None:
        functions.print(args.iters)
    return 0


def row_line(row: list[float]) -> str:
    """One iteration's (or the medians') figures, a column group per pass."""
    groups = (row[i : i + PER_PASS] for i in range(0, len(row), PER_PASS))
    return " | ".join(" ".join(f"{v:7.3f}" for v in group) for group in groups)


def phase_row(marks: list) -> list[float]:
    """Per pass between consecutive ``(disk, time, spent)`` marks: seconds, disk busy
    seconds, MB read, MB written, and the ``SPENT`` timers' seconds."""
    row = []
    for (d0, t0, s0), (d1, t1, s1) in itertools.pairwise(marks):
        row += [t1 - t0, d1[0] - d0[0], (d1[1] - d0[1]) / 1e6, (d1[2] - d0[2]) / 1e6]
        row += [b - a for a, b in zip(s0, s1, strict=True)]
    return row


def plain_passes(model, x, iters: int) -> tuple[float, float]:
    """Median seconds of a plain model's forward and backward (one untimed first)."""
    fwd, bwd = [], []
    for it in range(iters + 1):
        t0 = time.perf_counter()
        loss = bench_e2e.lm_loss(model(x[:, :-1]), x[:, 1:])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        if it:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


if __name__ == "__main__":
    sys.exit(main())
