"""``offload`` command-line entry point.

Each subcommand lives in its own module ``offload.cli.<name>`` exposing ``add_arguments(parser)``
and ``run(args) -> int``; modules are imported only when their command runs, so ``offload
--help`` stays fast and one broken command cannot take the others down.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("offload.cli.demo", "train a built-in GPT on local text with state on NVMe"),
    "finetune": ("offload.cli.finetune", "fine-tune a Hugging Face model directory on a data file"),
    "report": ("offload.cli.report", "print what this machine offers (native, SIMD, CUDA, disk)"),
    "config": ("offload.cli.config_cmd", "validate a config file and print it normalized"),
    "estimate": ("offload.cli.estimate", "memory per device/host/NVMe for ZeRO stages 0-3"),
    "tune-io": ("offload.cli.tune_io", "sweep async IO settings on a disk, print the best"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="offload",
        description="offload: train PyTorch models beyond accelerator memory "
        "(device / pinned host / NVMe tiers).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (modname, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=modname)
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            p.set_defaults(_missing=True)
            continue
        mod.add_arguments(p)
    return parser


def _rank_beyond_zero() -> bool:
    """Whether this is a rank other than 0 under torchrun. A ``RANK`` that is no number is not
    this check's to refuse (``offload config`` uses no rank): a command that joins a group
    names it (``offload.dist.env_int``; not imported here: it imports torch)."""
    rank = os.environ.get("RANK", "").strip()
    return rank.isdigit() and int(rank) > 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # as given (demo --nproc reruns it)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if _rank_beyond_zero():
        # a rank other than 0 of a command under torchrun (--nproc, or the user's own): what
        # the config and the plan say is the same on every rank, and rank 0 says it (N copies
        # of each note, interleaved, before); a rank's own errors still reach its stderr
        for name in ("offload.config", "offload.plan"):
            logging.getLogger(name).setLevel(logging.ERROR)
    if not args.command:
        parser.print_help()
        return 0
    if getattr(args, "_missing", False):
        print(f"offload {args.command}: not built yet in this version", file=sys.stderr)
        return 2
    mod = importlib.import_module(args._module)
    try:
        return int(mod.run(args) or 0)
    except KeyboardInterrupt:
        # Ctrl-C in a command that does not handle it itself (a tune-io sweep runs minutes):
        # its cleanup (`finally` blocks) has run; one line, not a traceback, and the status
        # of an interrupted command (demo and finetune return 130 themselves).
        print(f"offload {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout's reader went away (`offload estimate ... | head -3`): stop as other tools do,
        # not with a traceback; stdout goes to /dev/null so the interpreter's last flush at
        # exit cannot raise again. 141 = 128 + SIGPIPE, a shell's status for such a writer.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
