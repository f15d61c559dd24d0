"""``offload finetune``: fine-tune a Hugging Face model directory on a JSONL or text file.

    offload finetune --model DIR --data FILE --out DIR [--config cfg.yaml]
        [--steps N | --epochs E] [--seq-len L] [--batch B] [--accum A] [--lr LR] [--warmup W]
        [--max-grad-norm G] [--save-every K] [--resume] [--gradient-checkpointing] [--nproc N]

The recipe is ``offload.finetune.recipe`` (its docstring says what it does and writes).
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model dir")
    parser.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help="JSONL with 'text' or 'prompt' + 'completion', or plain text",
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="checkpoints, metrics, report, hf/ export"
    )
    parser.add_argument("--config", metavar="FILE", help="offload (or DeepSpeed) config file")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps")
    length.add_argument("--epochs", type=float, help="passes over the data (1)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (512)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per micro-batch (1)")
    parser.add_argument(
        "--accum",
        type=int,
        help="micro-batches per step (the config's gradient_accumulation_steps, else 1)",
    )
    parser.add_argument(
        "--lr", type=float, help="peak learning rate (the config's optimizer.lr, else 2e-5)"
    )
    parser.add_argument("--warmup", type=int, default=0, help="linear warm-up steps (0)")
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        help="clip the global norm (the config's gradient_clipping, else 1.0; 0 = off)",
    )
    parser.add_argument(
        "--save-every", type=int, default=0, metavar="K", help="checkpoint every K steps (0)"
    )
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints")
    parser.add_argument(
        "--seed", type=int, default=0, help="data order and torch's generator: dropout (0)"
    )
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-report", action="store_true", help="no metrics.jsonl / report.png")
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="data-parallel ranks on this machine, via torchrun; --batch is per rank (1)",
    )


def run(args: argparse.Namespace) -> int:
    bounds = {"steps": 1, "seq_len": 1, "batch": 1, "accum": 1, "warmup": 0, "save_every": 0}
    bounds["nproc"] = 1
    bounds["max_grad_norm"] = 0  # 0 = no clipping; a negative one turned it off unsaid
    for name, least in bounds.items():
        value = getattr(args, name)
        if value is not None and not value >= least:  # (not >=: NaN is refused too)
            print(
                f"offload finetune: error: --{name.replace('_', '-')} must be >= {least}, "
                f"got {value}",
                file=sys.stderr,
            )
            return 2
    for name in ("epochs", "lr"):  # --epochs 0 or -1 ran one step
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            print(
                f"offload finetune: error: --{name} must be a finite number > 0, got {value}",
                file=sys.stderr,
            )
            return 2
    try:
        import transformers  # noqa: F401, PLC0415
    except ImportError:
        print(
            "offload finetune: needs Hugging Face transformers: pip install 'offload[hf]'",
            file=sys.stderr,
        )
        return 2
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:  # (Note: several ranks)
        from offload.cli import ranks  # noqa: PLC0415

        argv = getattr(args, "_argv", None) or sys.argv[1:]
        return ranks.launch("finetune", args.nproc, argv[argv.index("finetune") + 1 :])
    from offload.finetune import Options, finetune  # noqa: PLC0415

    opts = Options(
        model=args.model,
        data=args.data,
        out=args.out,
        config=args.config,
        steps=args.steps,
        epochs=args.epochs,
        seq_len=args.seq_len,
        batch=args.batch,
        accum=args.accum,
        lr=args.lr,
        warmup=args.warmup,
        max_grad_norm=args.max_grad_norm,
        save_every=args.save_every,
        resume=args.resume,
        seed=args.seed,
        gradient_checkpointing=args.gradient_checkpointing,
        progress=not args.no_progress,
        report=not args.no_report,
    )
    try:
        return finetune(opts)
    except (ValueError, OSError) as exc:  # ConfigError and WeightsError are ValueErrors
        print(f"offload finetune: error: {exc}", file=sys.stderr)
        return 2
    except FloatingPointError as exc:  # the training diverged: no export, checkpoints kept
        print(f"offload finetune: error: {exc}", file=sys.stderr)
        return 1
