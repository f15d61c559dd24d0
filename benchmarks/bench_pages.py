"""What a gather's copy into a released unit costs, with and without recycled pages (a
diagnostic for ``offload/device/pages.py``'s Note on recycled pages).

    python benchmarks/bench_pages.py [--mib 20] [--reps 30]

One unit of ``--mib`` MiB of fp32 parameters in a ``PageBlocks`` block; each repetition
releases it (``drop``), makes room for the next gather (``make_room``) and times the gather's
copy into it from a resident source (``copy_``, as the CPU copier does), and the release and
make-room calls on their own. Two modes: pages released to the OS (no spares: each gather
faults fresh zeroed huge pages in) and recycled (the released pages are moved back under the
block). Each mode runs with the second core idle and with one busy process spinning on it
(what the IO and update threads are during a training step). Medians of ``--reps``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn

from offload.device import pages
from offload.plan import FlatLayout, Unit


def run(mib: int, reps: int, recycle: bool) -> tuple[float, float]:
    """(median ms of drop + make_room, median ms of the copy) for one mode."""
    module = nn.Linear(mib * 2**18, 1, bias=False)  # mib MiB of fp32
    unit = Unit(0, "m", module, FlatLayout.build(list(module.named_parameters())))
    blocks = pages.PageBlocks(torch.float32)
    if not recycle:
        blocks.spares = None
    blocks.attach(unit)
    blocks.drop(unit)
    src = torch.randn(module.weight.numel())
    moves, copies = [], []
    try:
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            blocks.drop(unit)
            blocks.make_room(unit)
            t1 = time.perf_counter()
            module.weight.data.view(-1).copy_(src)
            t2 = time.perf_counter()
            moves.append(t1 - t0)
            copies.append(t2 - t1)
    finally:
        blocks.close()
    return statistics.median(moves[2:]) * 1e3, statistics.median(copies[2:]) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=20)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    if not pages.supported(torch.device("cpu")):
        print("page-released blocks need Linux: nothing to measure")
        return 0
    if pages.Spares.make() is None:
        print("recycled pages need the native extension (offload._C.move_pages): not built")
        return 1
    print(
        f"# bench_pages  {time.strftime('%Y-%m-%d %H:%M')}  {args.mib} MiB unit, {args.reps} reps"
    )
    print("| second core | pages | release + make room | gather's copy |")
    print("|---|---|---|---|")
    for busy in (0, 1):
        spinners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)
        ]
        try:
            time.sleep(0.3)
            for recycle in (False, True):
                move, copy = run(args.mib, args.reps, recycle)
                what = "recycled (spares)" if recycle else "released to the OS"
                print(f"| {'busy' if busy else 'idle'} | {what} | {move:.2f} ms | {copy:.2f} ms |")
        finally:
            for p in spinners:
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
