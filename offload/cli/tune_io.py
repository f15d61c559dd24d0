"""``offload tune-io``: sweep async IO settings on a disk and print the best ``aio`` section.

Examples::

    offload tune-io --path /mnt/nvme0                       # 2 GiB scratch file, full grid
    offload tune-io --path /mnt/nvme0 --size 4GiB --output aio.json
    offload tune-io --path /tmp --size 64MiB --block-sizes 1MiB --queue-depths 4,8 --threads 1

Prints a table of write and read GB/s (1e9 bytes/s) per (block size, queue depth, threads),
then the best setting (highest harmonic mean of read and write) as a JSON ``{"aio": {...}}``
section to paste into an offload config. The scratch file is removed afterwards. Every value of
the grid must be one the ``aio`` section accepts, so that the best one loads; ``--output`` is
checked before the sweep, and an existing file there is replaced only when it holds an ``aio``
section alone (this command's own output), never a config of the user's.
"""

from __future__ import annotations

import argparse
import json
import sys

from offload.config import AioConfig, ConfigError, parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text, key="size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size_list(text: str) -> list[int]:
    out = [_size(t.strip()) for t in text.split(",") if t.strip()]
    if not out or any(v < 4096 or v % 4096 for v in out):
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be multiples of 4096 bytes")
    return out


def _int_list(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers like 4,8,16") from None
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return out


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 1")
    return value


def _aio_list(key: str, parse):
    """A comma list whose values must each be one the ``aio`` section's ``key`` accepts: the
    best point is printed, and written, as a config section (a 2GiB block or a queue depth of
    5000 was measured and recommended, then refused by ``offload config`` and ``wrap``)."""

    def check(text: str) -> list[int]:
        out = parse(text)
        for value in out:
            try:
                AioConfig(**{key: value})
            except ConfigError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        return out

    return check


def _output_problem(path: str) -> str | None:
    """Why ``--output`` cannot be written, said before the sweep (minutes of IO) rather than in
    a traceback after it; None when it can. An existing file is replaced only when it holds an
    ``aio`` section alone (this command's output): a config file of the user's is not lost."""
    import os

    if os.path.isdir(path):
        return "is a directory; give a file name"
    parent = os.path.dirname(path) or "."
    if os.path.exists(parent) and not os.path.isdir(parent):
        return f"its directory {parent!r} is not a directory"
    if not os.path.isdir(parent):
        return f"its directory {parent!r} does not exist"
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            held = json.load(f)
    except (OSError, ValueError):
        held = None
    if isinstance(held, dict) and list(held) == ["aio"]:
        return None
    return (
        "already exists and holds more than an aio section written by tune-io (nothing was "
        "changed); give a new file name and copy its aio section into your config"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True, help="directory on the disk to tune (nvme_path)")
    parser.add_argument("--size", type=_size, default=2 << 30, help="scratch file size (2GiB)")
    parser.add_argument(
        "--block-sizes",
        type=_aio_list("block_size", _size_list),
        default=[256 << 10, 1 << 20, 4 << 20],
        help="comma list of block sizes (256KiB,1MiB,4MiB)",
    )
    parser.add_argument(
        "--queue-depths",
        type=_aio_list("queue_depth", _int_list),
        default=[4, 8, 16, 32],
        help="comma list (4,8,16,32)",
    )
    parser.add_argument(
        "--threads",
        type=_aio_list("thread_count", _int_list),
        default=[1, 2],
        help="comma list (1,2)",
    )
    parser.add_argument(
        "--repeats", type=_at_least_one, default=1, help="runs per point; median kept (1)"
    )
    parser.add_argument("--output", metavar="FILE", help="also write the JSON aio section here")


def run(args: argparse.Namespace) -> int:
    import os

    from offload.io._tune import sweep  # torch is imported only when the command runs

    if not os.path.isdir(args.path):
        print(f"offload tune-io: --path {args.path!r} is not a directory", file=sys.stderr)
        return 2
    largest = max(args.block_sizes)
    if args.size < largest:  # (the sweep measured on a 4 KiB file for --size 0)
        print(
            f"offload tune-io: --size {args.size} is smaller than the largest of --block-sizes "
            f"({largest}): a block beyond the file measures nothing; allowed: at least "
            f"{largest} bytes (GiBs for a figure that is the disk's, not its cache's)",
            file=sys.stderr,
        )
        return 2
    problem = _output_problem(args.output) if args.output else None
    if problem is not None:
        print(f"offload tune-io: --output {args.output!r} {problem}", file=sys.stderr)
        return 2
    points = len(args.block_sizes) * len(args.queue_depths) * len(args.threads)
    print(f"tune-io: {points} settings on {args.path} with a {args.size / 2**20:.0f} MiB file")
    header = (
        f"{'block_size':>10} {'queue_depth':>11} {'threads':>7} {'write GB/s':>10} {'read GB/s':>9}"
    )
    print(header)

    def show(p) -> None:
        print(
            f"{p.block_size:>10} {p.queue_depth:>11} {p.thread_count:>7} "
            f"{p.write_gbps:>10.2f} {p.read_gbps:>9.2f}",
            flush=True,
        )

    try:
        results, direct = sweep(
            args.path,
            args.size,
            args.block_sizes,
            args.queue_depths,
            args.threads,
            repeats=args.repeats,
            progress=show,
        )
    except OSError as exc:
        print(f"offload tune-io: {exc}", file=sys.stderr)
        return 1
    if not direct:
        print("note: O_DIRECT is refused on this filesystem; measured buffered IO")
    best = max(results, key=lambda p: p.score)
    section = {
        "aio": {
            "block_size": best.block_size,
            "queue_depth": best.queue_depth,
            "thread_count": best.thread_count,
            "direct_io": direct,
        }
    }
    print(
        f"best: write {best.write_gbps:.2f} GB/s, read {best.read_gbps:.2f} GB/s "
        f"(harmonic mean {best.score:.2f})"
    )
    text = json.dumps(section, indent=2)
    print(text)
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(text + "\n")
        except OSError as exc:
            print(
                f"offload tune-io: --output {args.output!r}: {exc.strerror or exc}", file=sys.stderr
            )
            return 1
    return 0
