"""``offload estimate``: bytes per device, per host and on NVMe for ZeRO stages 0-3.

Pure arithmetic (``offload.estimate``); imports no torch, so it answers in milliseconds.

Examples::

    offload estimate --params 7.5e9 --gpus 8 --nodes 8          # the ZeRO paper's figure
    offload estimate --hf-config config.json --gpus 8 --gpu-mem 80GB --host-mem 1TB \\
        --nvme 7.68TB --seq-len 4096 --activation-checkpointing
    offload estimate --params 70B --gpus 1 --json
"""

from __future__ import annotations

import argparse
import json
import sys

from offload import estimate as est


def _count(text: str) -> int:
    try:
        return est.parse_count(text)
    except est.EstimateError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None


def _size(text: str) -> int:
    try:
        return est.parse_bytes(text)
    except est.EstimateError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_count, help="parameter count: 7e9, 7B, 350M, 1.5T")
    src.add_argument(
        "--hf-config",
        metavar="FILE",
        help="a Hugging Face config.json (LLaMA/Mistral/Qwen2/Mixtral/GPT-2/GPT-NeoX style)",
    )
    parser.add_argument("--gpus", type=_positive_int, default=1, help="devices per node (1)")
    parser.add_argument("--nodes", type=_positive_int, default=1, help="nodes (1)")
    parser.add_argument(
        "--gpu-mem", type=_size, default=est.parse_bytes("80GB"), help="memory per device (80GB)"
    )
    parser.add_argument("--host-mem", type=_size, help="host memory per node, e.g. 512GB")
    parser.add_argument("--nvme", type=_size, help="NVMe capacity per node, e.g. 3.84TB")
    parser.add_argument(
        "--dtype",
        choices=sorted(est.PRECISIONS),
        default="bf16",
        help="compute dtype (bf16: 2+2+12 bytes per parameter; fp32: 4+4+8)",
    )
    parser.add_argument(
        "--buffer-count", type=_positive_int, default=4, help="pinned buffers per NVMe pool (4)"
    )
    parser.add_argument(
        "--buffer-size", type=_size, default=est.parse_bytes("64MB"), help="bytes each (64MB)"
    )
    parser.add_argument(
        "--unit-params", type=_count, help="params of the largest unit gathered at once"
    )
    parser.add_argument(
        "--live-units", type=_positive_int, default=2, help="units on the device at once (2)"
    )
    parser.add_argument(
        "--seq-len", type=_positive_int, help="sequence length for the activation estimate"
    )
    parser.add_argument(
        "--micro-batch", type=_positive_int, default=1, help="micro-batch per device (1)"
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="count activations with checkpointing in 'dev total'",
    )
    parser.add_argument(
        "--flash-attention",
        action="store_true",
        help="no s^2 attention-score term in the activation estimate",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def build(args: argparse.Namespace) -> est.Estimate:
    """The estimate the parsed arguments ask for (raises EstimateError on bad input)."""
    shape = None
    if args.hf_config is not None:
        cfg = est.load_hf_config(args.hf_config)
        shape = est.shape_from_hf_config(cfg, source=args.hf_config)
        params, source = est.count_params(shape), f"counted from {args.hf_config}"
    else:
        params, source = args.params, "--params"
    if args.seq_len is not None and shape is None:
        raise est.EstimateError(
            "--seq-len: the activation estimate needs the model shape; pass --hf-config"
        )
    machine = est.Machine(
        gpus_per_node=args.gpus,
        nodes=args.nodes,
        gpu_mem=args.gpu_mem,
        host_mem=args.host_mem,
        nvme=args.nvme,
        buffer_count=args.buffer_count,
        buffer_size=args.buffer_size,
    )
    return est.estimate(
        params,
        machine,
        precision=args.dtype,
        shape=shape,
        params_source=source,
        unit_params=args.unit_params,
        live_units=args.live_units,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        activation_checkpointing=args.activation_checkpointing,
        flash_attention=args.flash_attention,
    )


def run(args: argparse.Namespace) -> int:
    try:
        result = build(args)
    except est.EstimateError as exc:
        print(f"offload estimate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(est.format_estimate(result))
    return 0
