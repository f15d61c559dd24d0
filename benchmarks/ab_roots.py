"""A/B of two checkouts of offload on the same NVMe iterations (a diagnostic for a change).

    git worktree add --detach /work/wt-before <commit>   # and give it the built extension:
    cp offload/_C*.so /work/wt-before/offload/           # (when csrc/ did not change)
    python benchmarks/ab_roots.py /work/wt-before . [--pairs 5] [--modes recipe,...] [--batch 2]

Alternates one process per checkout (before, after, before, ...), each training bench_e2e's
50M demo GPT with params and optimizer state on NVMe: the default step (the step in backward),
the recipe (accumulation 2, clipping 1.0, which triggers here: the update after the backward)
and the recipe with norms under the threshold (the update speculative in the last backward,
kept), 3 untimed iterations and then 6 timed; prints each process's median seconds per
iteration and, per mode, the medians over the pairs and the median of the per-pair ratios
(after / before, each pair's two processes run back to back). Alternating processes is what
makes the two comparable on a noisy machine; ``--modes`` times only some modes, so that more
pairs fit in the same time when a change concerns one of them.

``--after-aio BLOCK,DEPTH`` gives the after side that ``aio.block_size`` and
``aio.queue_depth`` (the before side keeps 1MiB,8, bench_e2e's); with the same checkout on both
sides it is an A/B of the IO settings alone:

    python benchmarks/ab_roots.py . . --after-aio 8MiB,4 --pairs 8 --modes recipe

``--after-buffers PARAM,OPT`` likewise gives the after side pools of those buffer counts
(bench_e2e's ``--buffers``; the before side keeps bench_e2e's 8,14): what more host memory
buys, on the same checkout.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("step_in_backward", "recipe", "recipe_under")


AIO = "1MiB,8"  # bench_e2e's block size and queue depth


def one(
    root: str,
    modes: tuple[str, ...] = MODES,
    aio_spec: str = AIO,
    counts: str | None = None,
    batch: int = 4,
) -> dict[str, float]:
    """In this process: median seconds per iteration of each mode with the code at ``root``,
    ``aio_spec`` (``"BLOCK,DEPTH"``) as its IO settings, ``counts`` (``"PARAM,OPT"``) as its
    pools' buffer counts (None: bench_e2e's) and micro-batches of ``batch`` sequences."""
    sys.path[:0] = [str(Path(root) / "benchmarks"), root]
    import bench_e2e  # noqa: PLC0415
    import torch  # noqa: PLC0415

    import offload  # noqa: PLC0415
    from offload.config import parse_size  # noqa: PLC0415

    if not offload.__file__.startswith(str(Path(root).resolve())):
        raise SystemExit(f"offload was imported from {offload.__file__}, not from {root}")
    torch.manual_seed(0)
    base = bench_e2e.GPT(bench_e2e.config_for_size("50M", seq_len=128))
    x = torch.randint(0, 256, (batch, 129))
    block, depth = aio_spec.split(",")
    aio = {"block_size": parse_size(block), "queue_depth": int(depth), "thread_count": 2}
    out = {}
    for mode in modes:
        work = Path(tempfile.mkdtemp(prefix="ab-", dir="/work"))
        cfg = bench_e2e.nvme_config(work, parse_size("8MiB"), aio, step_in_backward=True)
        if counts is not None:  # (set here: a checkout from before --buffers has 8,14)
            param, opt = map(int, counts.split(","))
            cfg["offload_param"]["buffer_count"] = param
            cfg["offload_optimizer"]["buffer_count"] = opt
        step = bench_e2e.train_step
        if mode.startswith("recipe"):
            cfg["gradient_clipping"] = 1.0
            step = bench_e2e.recipe_step if mode == "recipe" else bench_e2e.unclipped_step
        model, opt = offload.wrap(copy.deepcopy(base), cfg)
        try:
            for _ in range(3):
                step(model, opt, x)
            times = []
            for _ in range(6):
                t0 = time.perf_counter()
                step(model, opt, x)
                times.append(time.perf_counter() - t0)
        finally:
            opt.close()
            shutil.rmtree(work, ignore_errors=True)
        out[mode] = statistics.median(times)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES), help=f"some of {','.join(MODES)}")
    ap.add_argument(
        "--after-aio", default=AIO, help=f"the after side's aio BLOCK,DEPTH (default {AIO})"
    )
    ap.add_argument(
        "--after-buffers",
        default=None,
        help="the after side's buffer counts PARAM,OPT (default: bench_e2e's)",
    )
    ap.add_argument(
        "--batch",
        type=int,
        default=4,
        help="sequences per micro-batch, both sides (bench_e2e's --batch; 2 is the balanced "
        "case on a machine whose compute outweighs its disk at 4: benchmarks/README.md)",
    )
    ap.add_argument("--aio", default=AIO, help=argparse.SUPPRESS)
    ap.add_argument("--buffers", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    modes = tuple(args.modes.split(","))
    if not modes or not set(modes) <= set(MODES):
        ap.error(f"--modes {args.modes!r}: allowed, comma-separated: {', '.join(MODES)}")
    if args.batch < 1:
        ap.error(f"--batch {args.batch}: allowed: an int >= 1")
    if args.one is not None:
        times = one(args.one, modes, args.aio, args.buffers, args.batch)
        print(" ".join(f"{m}={s:.3f}" for m, s in times.items()))
        return 0
    # (here, not above: a --one process must import offload from its own checkout first)
    from offload.config import parse_size  # noqa: PLC0415

    block, _, depth = args.after_aio.partition(",")
    try:
        parse_size(block)  # each after process parses it again, with its checkout's
    except (ValueError, TypeError):
        block = ""
    if not block or not depth.isdigit() or int(depth) < 1:
        ap.error(f"--after-aio {args.after_aio!r}: allowed: BLOCK,DEPTH, e.g. 8MiB,4")
    if args.after_buffers is not None:
        import bench_e2e  # noqa: PLC0415 (this checkout's: only its parser)

        try:
            bench_e2e.buffer_counts(args.after_buffers)
        except argparse.ArgumentTypeError as exc:
            ap.error(f"--after-buffers {exc}")
    got: dict[str, dict[str, list[float]]] = {
        r: {m: [] for m in modes} for r in ("before", "after")
    }
    for pair in range(args.pairs):
        for name in ("before", "after"):
            root = str(Path(getattr(args, name)).resolve())
            aio = args.after_aio if name == "after" else AIO
            counts = args.after_buffers if name == "after" else None
            line = subprocess.run(
                [sys.executable, __file__, "x", "x", "--one", root, "--modes", ",".join(modes),
                 "--aio", aio, "--batch", str(args.batch),
                 *(["--buffers", counts] if counts else [])],
                check=True, capture_output=True, text=True,
            ).stdout.strip().splitlines()[-1]  # fmt: skip
            print(f"pair {pair + 1} {name}: {line}", flush=True)
            for item in line.split():
                mode, seconds = item.split("=")
                got[name][mode].append(float(seconds))
    for mode in modes:
        b, a = (statistics.median(got[n][mode]) for n in ("before", "after"))
        ratios = [y / x for x, y in zip(got["before"][mode], got["after"][mode], strict=True)]
        faster = sum(r < 1 for r in ratios)
        print(
            f"{mode}: before {b:.3f} s, after {a:.3f} s (median of {args.pairs}; {a / b:.2f}x); "
            f"per pair {statistics.median(ratios):.2f}x, after faster in {faster} of {len(ratios)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
