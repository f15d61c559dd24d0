"""Where the training thread's time goes in bench_e2e's recipe (a diagnostic, no peer).

    python benchmarks/recipe_waits.py [--steps 10] [--batch 2] [--clipping]

Trains bench_e2e's 50M demo GPT with params and optimizer state on NVMe (bench_e2e's config:
1 MiB blocks at depth 8, its buffers) through the recipe (accumulation 2, clipping 1.0; with
norms under the threshold unless ``--clipping``), and prints, per iteration after two untimed
ones, the medians of the step's telemetry timers (``offload.runtime.telemetry.TIMERS``): the
step, its forwards and backwards, offload's hooks on the training thread
(``hook_seconds``) and, inside them, the waits for reads (``forward_io_wait_seconds``,
``backward_io_wait_seconds``) and for the update (``step_wait_seconds``). What the hooks take
beyond those waits is offload's own work on the training thread.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import bench_e2e  # noqa: E402

import offload  # noqa: E402
from offload.config import parse_size  # noqa: E402

TIMERS = (
    "forward_seconds",
    "backward_seconds",
    "hook_seconds",
    "forward_io_wait_seconds",
    "backward_io_wait_seconds",
    "step_wait_seconds",
    "gather_copy_seconds",
    "optimizer_seconds",
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="iterations timed (after 2 untimed)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--clipping", action="store_true", help="norms over the threshold")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = bench_e2e.GPT(bench_e2e.config_for_size("50M", seq_len=128))
    x = torch.randint(0, 256, (args.batch, 129))
    aio = {"block_size": parse_size("1MiB"), "queue_depth": 8, "thread_count": 2}
    work = Path(
        tempfile.mkdtemp(prefix="recipe-waits-", dir="/work" if Path("/work").is_dir() else None)
    )
    cfg = bench_e2e.nvme_config(work, parse_size("8MiB"), aio, step_in_backward=True)
    cfg["gradient_clipping"] = 1.0
    step = bench_e2e.recipe_step if args.clipping else bench_e2e.unclipped_step
    model, opt = offload.wrap(model, cfg)
    rows = []
    try:
        for i in range(args.steps + 2):
            t0 = time.perf_counter()
            step(model, opt, x)
            wall = time.perf_counter() - t0
            if i >= 2:
                stats = opt.stats()
                rows.append({"iteration (wall)": wall} | {k: stats[k] for k in TIMERS})
    finally:
        opt.close()
        shutil.rmtree(work, ignore_errors=True)
    mode = "clipping triggers" if args.clipping else "norms under the threshold"
    print(f"# recipe_waits: {mode}, batch {args.batch}, medians of {args.steps} iterations")
    for key in rows[0]:
        print(f"{key:28s} {statistics.median(r[key] for r in rows):.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
