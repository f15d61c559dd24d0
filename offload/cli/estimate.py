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
from offload.config.sections import (
    DEFAULT_BUFFER_SIZE,
    OffloadOptimizerConfig,
    OffloadParamConfig,
)
from offload.config.sizes import format_size


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
        help="a Hugging Face config.json, or a model directory holding one "
        "(LLaMA/Mistral/Qwen2/Mixtral/GPT-2/GPT-NeoX style)",
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
        "--buffer-count",
        type=_positive_int,
        help="pinned buffers per NVMe staging pool (wrap's defaults: "
        f"{OffloadParamConfig().buffer_count} params, "
        f"{OffloadOptimizerConfig().buffer_count} optimizer)",
    )
    parser.add_argument(
        "--buffer-size",
        type=_size,
        help="bytes per staging buffer (wrap's default 'auto': the largest unit, at most "
        f"{format_size(DEFAULT_BUFFER_SIZE)})",
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
    parser.add_argument(
        "--reduce-dtype",
        choices=est.REDUCE_DTYPES,
        default="fp32",
        help="dtype the ranks sum gradients in, as distributed.reduce_dtype (fp32; auto: the "
        "compute dtype)",
    )
    parser.add_argument(
        "--accum",
        type=_positive_int,
        default=1,
        help="micro-steps per optimizer step, as gradient_accumulation_steps (1): stages 2 "
        "and 3 reduce each; stage 1 keeps their sum on the device (see --grad-accum-dtype)",
    )
    parser.add_argument(
        "--grad-accum-dtype",
        choices=est.REDUCE_DTYPES,
        default="fp32",
        help="dtype stage 1 adds micro-steps in, as distributed.grad_accum_dtype (fp32: 4 "
        "bytes per parameter on the device with --accum above 1; auto: the compute dtype)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def build(args: argparse.Namespace) -> est.Estimate:
    """The estimate the parsed arguments ask for (raises EstimateError on bad input)."""
    shape = None
    if args.hf_config is not None:
        cfg = est.load_hf_config(args.hf_config)
        shape = est.shape_from_hf_config(cfg, source=args.hf_config)
        params, source = est.count_params(shape), f"counted from {args.hf_config}"
        note = est.unknown_layout(cfg)
        if note is not None:  # said in the table's header and in --json's params_source
            source += f"; {note}"
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
        reduce_dtype=args.reduce_dtype,
        accumulation=args.accum,
        grad_accum_dtype=args.grad_accum_dtype,
    )


def fmt_bytes(n: int | None) -> str:
    """Decimal GB with one or two decimals (the ZeRO paper's units)."""
    if n is None:
        return "-"
    if n == 0:
        return "0"
    gb = n / est.GB
    if gb >= 1000:
        return f"{gb / 1000:.2f} TB"
    if gb >= 10:
        return f"{gb:.1f} GB"
    if gb >= 1:
        return f"{gb:.2f} GB"
    if n >= 10**7:
        return f"{n / 10**6:.0f} MB"
    return f"{n / 10**6:.1f} MB"


def format_estimate(result: est.Estimate) -> str:
    """A human-readable table (GB = 1e9)."""
    m = result.machine
    prec = est.PRECISIONS[result.precision]
    lines = [
        f"model: {result.params / 1e9:.3f} B parameters ({result.params_source}); "
        f"dtype {result.precision}: "
        f"{prec.params} B params + {prec.grads} B grads + {prec.optimizer} B optimizer per "
        f"parameter on the device (K = {prec.optimizer}); "
        f"{est.OFFLOADED_OPTIMIZER_BYTES} B (fp32 master, m, v, grad) when offloaded, "
        f"+{est.VERSIONED_OPTIMIZER_BYTES} B on NVMe for the step in backward's second extent",
        f"machine: {m.ranks} rank{'s' if m.ranks > 1 else ''} ({m.gpus_per_node} per node x "
        f"{m.nodes} node{'s' if m.nodes > 1 else ''}); "
        f"device {fmt_bytes(m.gpu_mem) if m.gpu_mem else 'not given'}, "
        f"host {fmt_bytes(m.host_mem) + '/node' if m.host_mem else 'not given'}, "
        f"NVMe {fmt_bytes(m.nvme) + '/node' if m.nvme else 'not given'}",
        f"working set: {result.live_units} live units of {result.unit_params / 1e6:.1f} M params "
        f"({result.unit_source})",
        _staging_line(result.staging),
    ]
    if result.activations is None:
        lines.append("activations: not included (need --hf-config and --seq-len); they come on top")
    else:
        a = result.activations
        used = "with" if result.activation_checkpointing else "without"
        lines.append(
            f"activations (approximate, seq {a.seq_len} x micro-batch {a.micro_batch}"
            f"{', flash attention' if a.flash_attention else ''}): "
            f"{fmt_bytes(a.without_checkpointing)} without checkpointing, "
            f"{fmt_bytes(a.with_checkpointing)} with (incl. {fmt_bytes(a.logits)} logits); "
            f"'total' uses {used}"
        )
    header = (
        "stage",
        "placement",
        "dev states",
        "dev working",
        "dev total",
        "host/node",
        "NVMe/node",
        "comm/step",
        "fits",
    )
    table = [header]
    for stages, r in est.collapse_rows(result.rows):
        why = []
        if r.fits_device is False:
            why.append("device")
        if r.fits_host is False:
            why.append("host")
        if r.fits_nvme is False:
            why.append("nvme")
        unknown = [
            n
            for n, f, need in (
                ("device", r.fits_device, True),
                ("host", r.fits_host, r.host_per_rank > 0),
                ("nvme", r.fits_nvme, r.nvme_per_rank > 0),
            )
            if f is None and need
        ]
        if why:
            fit = "NO (" + ", ".join(why) + ")"
        elif unknown:
            fit = "yes?" + " (" + ", ".join(unknown) + " not given)"
        else:
            fit = "yes"
        table.append(
            (
                stages,
                est.PLACEMENT_TITLES[r.placement],
                fmt_bytes(r.device_states),
                fmt_bytes(r.device_working),
                fmt_bytes(r.device_total),
                fmt_bytes(r.host_per_node),
                fmt_bytes(r.nvme_per_node),
                fmt_bytes(r.comm_per_rank),
                fit,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines.append("")
    for i, row in enumerate(table):
        cells = [
            c.ljust(widths[j]) if j in (1, 8) else c.rjust(widths[j]) for j, c in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(
        "dev states: persistent model state per device (ZeRO paper figure); dev working: "
        "gathered units + streaming grads; dev total adds activations when estimated; "
        "comm/step: collective bytes per rank and optimizer step (2 Psi, stage 3: 3 Psi; each "
        "extra micro-step adds Psi at stage 2 and 3 Psi at stage 3; the gradients' Psi in "
        "--reduce-dtype's bytes). Host, NVMe and comm are "
        "what `offload.wrap` holds and moves per rank (benchmarks/bench_dist.py measures them)."
    )
    if len(table) - 1 < len(result.rows):
        lines.append(
            "stages with identical figures share a row (with one rank ZeRO partitions nothing)."
        )
    return "\n".join(lines)


def _staging_line(pools: list[est.Pool]) -> str:
    """The NVMe placement's host buffers, pool by pool, as wrap sizes them."""
    parts = [f"{p.section} {p.count} x {fmt_bytes(p.size)}" for p in pools]
    total = fmt_bytes(sum(p.nbytes for p in pools))
    auto = [p.section for p in pools if p.auto]
    cap = f"{fmt_bytes(DEFAULT_BUFFER_SIZE)} ({format_size(DEFAULT_BUFFER_SIZE)})"
    why = (
        f"; 'auto' size = the largest unit (params in the compute dtype, optimizer in fp32), "
        f"at most {cap}"
        if auto
        else ""
    )
    return f"NVMe staging per rank (wrap's pools): {' + '.join(parts)} = {total}{why}"


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
        print(format_estimate(result))
    return 0
