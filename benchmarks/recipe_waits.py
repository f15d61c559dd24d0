"""Where the training thread's time goes in bench_e2e's recipe (a diagnostic, no peer).

    python benchmarks/recipe_waits.py [--steps 10] [--batch 2] [--clipping]
    python benchmarks/recipe_waits.py --plain-hooks 3 [--steps 6]
    python benchmarks/recipe_waits.py --switch-interval 0.0005   # the GIL handed over sooner

Trains bench_e2e's 50M demo GPT with params and optimizer state on NVMe (bench_e2e's config:
1 MiB blocks at depth 8, its buffers) through the recipe (accumulation 2, clipping 1.0; with
norms under the threshold unless ``--clipping``), and prints, per iteration after two untimed
ones, the medians of the step's telemetry timers (``offload.runtime.telemetry.TIMERS``): the
step, its forwards and backwards, offload's hooks on the training thread
(``hook_seconds``) and, inside them, the waits for reads (``forward_io_wait_seconds``,
``backward_io_wait_seconds``) and for the update (``step_wait_seconds``). What the hooks take
beyond those waits is offload's own work on the training thread.

It also prints the CPU time the iterations took (the process's, and torch's threads' from
``/proc/self/task``, the training thread among them; the rest is offload's threads': its pool,
its IO and the update's), against plain PyTorch's compute of the same recipe (bench_e2e's
``recipe_compute_step``) timed the same way after it: where the cores are all busy, no schedule
on them beats the CPU time divided by the cores (``os.sched_getaffinity``), whatever overlaps.

``--switch-interval S`` sets ``sys.setswitchinterval(S)`` for the whole run (CPython's default is
0.005 s): whether the training thread waits for the GIL that offload's update thread holds between
its native calls (a shorter interval hands it over sooner).

``--plain-hooks MS`` runs plain PyTorch's recipe compute alone, with a busy-wait of MS
milliseconds before each block's forward and backward (what a hook on the training thread is to
torch), alternated with none: torch's other threads' CPU beside the training thread's.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import tempfile
import threading
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


TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of each live thread of this process, by native id."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # (a thread that ended meanwhile)
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    return out


def cpu_now() -> tuple[float, dict[int, float]]:
    """The process's CPU seconds (every thread, those that ended too) and ``thread_cpu``."""
    return time.process_time(), thread_cpu()


def cpu_between(before, after, torch_threads: set[int]) -> tuple[float, float]:
    """CPU seconds between two ``cpu_now`` reads: (the threads torch had before offload
    existed, the training thread among them; the rest of the process, offload's threads: its
    pool, its IO threads and the update's thread, one per step, which ends)."""
    total = after[0] - before[0]
    torch_cpu = sum(v - before[1].get(t, 0.0) for t, v in after[1].items() if t in torch_threads)
    return torch_cpu, total - torch_cpu


def plain_hooks(model, x, seconds: float, steps: int, rounds: int = 3) -> int:
    """Plain PyTorch's recipe compute with a busy-wait of ``seconds`` (Python, on the training
    thread, as offload's hooks run) before each block's forward and backward, alternated with
    none: the wall and the CPU of the training thread and of torch's other threads. Where the
    other threads' CPU grows with the training thread's, they spin through the hooks."""
    wait = [0.0]

    def busy(*_) -> None:
        end = time.perf_counter() + wait[0]
        while time.perf_counter() < end:
            pass

    blocks = [m for m in model.modules() if type(m).__name__ == "Block"]
    for block in blocks:
        block.register_forward_pre_hook(busy)
        block.register_full_backward_pre_hook(busy)
    for _ in range(2):
        bench_e2e.recipe_compute_step(model, x)
    main_tid = threading.get_native_id()
    hooked = seconds * len(blocks) * 2 * 2  # forward and backward, two micro-batches
    print(f"# plain compute, {len(blocks)} blocks, {steps} iterations a round (means)")
    print("| hooks an iteration | wall | training thread CPU | other threads' CPU |")
    print("|---|---|---|---|")
    for _ in range(rounds):
        for wait[0] in (0.0, seconds):
            before, t0 = thread_cpu(), time.perf_counter()
            for _ in range(steps):
                bench_e2e.recipe_compute_step(model, x)
            wall, after = (time.perf_counter() - t0) / steps, thread_cpu()
            spent = {t: v - before.get(t, 0.0) for t, v in after.items()}
            mine = spent.pop(main_tid) / steps
            others = sum(spent.values()) / steps
            hooks = hooked if wait[0] else 0.0
            print(f"| {hooks:.3f} s | {wall:.3f} s | {mine:.3f} s | {others:.3f} s |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="iterations timed (after 2 untimed)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--clipping", action="store_true", help="norms over the threshold")
    ap.add_argument(
        "--plain-hooks", type=float, metavar="MS", default=None,
        help="instead: plain compute with MS of busy hook per block pass, against none",
    )  # fmt: skip
    ap.add_argument(
        "--switch-interval", type=float, metavar="S", default=None,
        help="sys.setswitchinterval(S) for the run (the GIL's hand-over; default 0.005)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.switch_interval is not None:
        if not args.switch_interval > 0:
            ap.error(f"--switch-interval: got {args.switch_interval}; allowed: seconds > 0")
        sys.setswitchinterval(args.switch_interval)
    if args.plain_hooks is not None and not args.plain_hooks >= 0:
        ap.error(f"--plain-hooks: got {args.plain_hooks}; allowed: milliseconds >= 0")
    if args.steps < 1:
        ap.error(f"--steps: got {args.steps}; allowed: an integer >= 1")
    torch.manual_seed(0)
    model = bench_e2e.GPT(bench_e2e.config_for_size("50M", seq_len=128))
    x = torch.randint(0, 256, (args.batch, 129))
    if args.plain_hooks is not None:
        return plain_hooks(model, x, args.plain_hooks / 1e3, args.steps)
    aio = {"block_size": parse_size("1MiB"), "queue_depth": 8, "thread_count": 2}
    work = Path(
        tempfile.mkdtemp(prefix="recipe-waits-", dir="/work" if Path("/work").is_dir() else None)
    )
    cfg = bench_e2e.nvme_config(work, parse_size("8MiB"), aio, step_in_backward=True)
    cfg["gradient_clipping"] = 1.0
    step = bench_e2e.recipe_step if args.clipping else bench_e2e.unclipped_step
    plain = copy.deepcopy(model)
    for _ in range(2):  # (also starts torch's intra-op threads: the threads before offload's)
        bench_e2e.recipe_compute_step(plain, x)
    torch_threads = set(thread_cpu())
    model, opt = offload.wrap(model, cfg)
    rows = []
    try:
        for i in range(args.steps + 2):
            if i == 2:
                cpu0, t_all = cpu_now(), time.perf_counter()
            t0 = time.perf_counter()
            step(model, opt, x)
            wall = time.perf_counter() - t0
            if i >= 2:
                stats = opt.stats()
                rows.append({"iteration (wall)": wall} | {k: stats[k] for k in TIMERS})
        wall_all = time.perf_counter() - t_all  # (the last update still runs: not counted)
        mine, others = cpu_between(cpu0, cpu_now(), torch_threads)
    finally:
        opt.close()
        shutil.rmtree(work, ignore_errors=True)
    cpu0, t0 = cpu_now(), time.perf_counter()
    for _ in range(args.steps):
        bench_e2e.recipe_compute_step(plain, x)
    plain_wall = (time.perf_counter() - t0) / args.steps
    plain_mine, plain_others = cpu_between(cpu0, cpu_now(), torch_threads)
    n, cores = args.steps, len(os.sched_getaffinity(0))
    mode = "clipping triggers" if args.clipping else "norms under the threshold"
    print(f"# recipe_waits: {mode}, batch {args.batch}, medians of {args.steps} iterations")
    for key in rows[0]:
        print(f"{key:28s} {statistics.median(r[key] for r in rows):.3f} s")
    cpu, plain_cpu = (mine + others) / n, (plain_mine + plain_others) / n
    print(f"# CPU seconds per iteration (means over the {n}; {cores} cores)")
    print(f"{'iteration (wall, mean)':28s} {wall_all / n:.3f} s")
    print(f"{'cpu, torch threads':28s} {mine / n:.3f} s (the training thread and intra-op)")
    print(f"{'cpu, offload threads':28s} {others / n:.3f} s (pool, IO, the update's)")
    print(f"{'cpu, all':28s} {cpu:.3f} s ({cpu / (wall_all / n):.2f} of {cores} cores busy)")
    print(f"{'plain compute (wall)':28s} {plain_wall:.3f} s")
    print(f"{'plain compute (cpu, all)':28s} {plain_cpu:.3f} s")
    print(f"{'cpu / cores':28s} {cpu / cores:.3f} s ({cpu / cores / plain_wall:.2f}x plain wall)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
