"""``offload demo``: train a built-in byte-level GPT on local text with its state on NVMe.

Defaults: a ~50M-parameter GPT (``--size``), params and optimizer state on NVMe under the
system's temporary directory (``offload-demo-UID``; ``--nvme-path`` to choose the disk), host swap buffers of 2 pools x 4 x
20 MiB = 168 MB, under a quarter of the model's 0.8 GB of fp32 state (params, grads, Adam m and
v). It shows a
progress bar with loss, tokens/s, IO GB/s and the step-time split, prints a summary table, and
writes ``metrics.jsonl`` and ``report.png`` to ``--report DIR``.

Note: compute dtype
    The default is fp32. On CPUs the bf16 matmul path is often slower than fp32 (measured on
    the 2-core development machine: 0.29 TFLOP/s fp32 vs 0.11 TFLOP/s bf16 for the demo's
    640-wide layers, despite AVX512-BF16), and with fp32 compute the master weights are the
    params themselves. bf16 halves the parameter bytes moved to and from NVMe and is the right
    choice on a GPU; ``--dtype bf16`` selects it.

Note: several ranks
    ``--nproc N`` runs the demo as N data-parallel ranks on this machine: it starts itself
    under ``torchrun --standalone --nproc-per-node N`` (gloo on the CPU, NCCL on CUDA), each
    rank training on its own batches (``--batch-size`` per rank, the stream seeded with
    ``--seed`` + rank) with the state sharded by ``distributed.stage`` (``--stage``). Rank 0
    shows the progress, prints the summary and writes the report: a step's loss is the mean of
    the ranks' and its tokens (tokens/s) every rank's (``offload.demo.loop``); every rank's swap
    files go in its own directory.

Note: clean stop
    Ctrl-C ends the training loop after the current operation; the report is written for the
    steps that finished, the engine is closed (its NVMe store removes its files) and the
    temporary directory is deleted in a ``finally`` block, with further Ctrl-C ignored while
    cleaning up. The exit status is then 130, as for any interrupted command.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offload.cli import ranks

if TYPE_CHECKING:  # pragma: no cover
    from offload.config import OffloadConfig

# Steps of the default run (50M model): 5.4 s of process CPU time per step (both cores), so about
# 2 minutes on 2 idle cores; measured on the shared 2-core dev machine under load 4-9: 4.6 min wall,
# 3.0 min CPU, loss 5.5 -> 2.6 (validation 5.48 -> 2.65).
DEFAULT_STEPS = 30
DEFAULT_SIZE = "50M"
DEFAULT_BATCH = 4
DEFAULT_LR = 1e-3
BUFFER_COUNT = 4  # per pool (params, optimizer)
BUFFER_SIZE = 20 * 2**20  # bytes per buffer (a 50M block's fp32 params, 19.7 MB, fit one)
ENGINE_MISSING = (
    "offload demo: the training engine is not built yet (offload.api.wrap is missing in "
    "this version); run `offload demo --baseline` to train the same model with plain PyTorch"
)


def engine_status() -> tuple[bool, str]:
    """(whether ``offload.wrap`` can be used, why not)."""
    spec = importlib.util.find_spec("offload.api")
    if spec is None or spec.origin is None:  # no package, or a bare directory (namespace)
        return False, "offload.api is not a package yet"
    try:
        mod = importlib.import_module("offload.api")
    except Exception as exc:  # noqa: BLE001 - report any import failure as the reason
        return False, f"offload.api failed to import: {type(exc).__name__}: {exc}"
    if not callable(getattr(mod, "wrap", None)):
        return False, "offload.api has no wrap()"
    return True, ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size", default=DEFAULT_SIZE, help=f"model size: tiny, 5M, 50M, 125M ... ({DEFAULT_SIZE})"
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"training steps ({DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH,
        help=f"sequences per step ({DEFAULT_BATCH})",
    )
    parser.add_argument("--seq-len", type=int, help="bytes per sequence (256; tiny: 64)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"peak LR ({DEFAULT_LR})")
    parser.add_argument("--warmup", type=int, default=5, help="linear LR warm-up steps (5)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="compute dtype (fp32)")
    parser.add_argument("--device", help="compute device: cpu, cuda, cuda:N (auto)")
    parser.add_argument("--config", metavar="FILE", help="an offload (or DeepSpeed) config file")
    parser.add_argument(
        "--nvme-path", metavar="DIR", help="where swap files go (TMPDIR/offload-demo-UID)"
    )
    parser.add_argument(
        "--report",
        metavar="DIR",
        default="offload-demo-report",
        help="write metrics.jsonl and report.png here (offload-demo-report)",
    )
    parser.add_argument("--no-report", action="store_true", help="write no report files")
    parser.add_argument("--seed", type=int, default=0, help="model init and batch order (0)")
    parser.add_argument(
        "--eval-batches", type=int, default=2, help="validation batches before/after (2; 0 = off)"
    )
    parser.add_argument("--tie-embeddings", action="store_true", help="share input/output table")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="plain PyTorch AdamW, everything in memory (for comparison; no offload)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--nproc", type=int, default=1, help="data-parallel ranks on this machine, via torchrun (1)"
    )
    parser.add_argument(
        "--stage", choices=("1", "2", "3", "auto"), help="ZeRO stage across ranks (auto)"
    )


def _read_config_file(path: str) -> dict[str, Any]:
    """The file read as `offload config` and `offload finetune` read it (offload's YAML reader:
    ``1e-4`` is a float, a key given twice is an error, an empty file is all defaults); plain
    ``yaml.safe_load`` made ``lr: 1e-4`` the string '1e-4', refused, and kept the last of two
    keys."""
    from offload.config import ConfigError  # noqa: PLC0415
    from offload.config.loader import read_config_file  # noqa: PLC0415

    try:
        data = read_config_file(path)
    except ConfigError as exc:  # it names the file already: not a value to place in it
        raise ValueError(str(exc)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path!r} must hold a mapping at the top level")
    return data


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def demo_config(nvme_dir: str, *, device: str, dtype: str, lr: float) -> dict[str, Any]:
    """The demo's defaults: params and optimizer on NVMe, a small host buffer pool."""
    pool = {"buffer_count": BUFFER_COUNT, "buffer_size": BUFFER_SIZE, "nvme_path": nvme_dir}
    return {
        "device": device,
        "dtype": dtype,
        "optimizer": {"type": "adamw", "lr": lr, "betas": [0.9, 0.95], "weight_decay": 0.01},
        "offload_optimizer": {"device": "nvme", **pool},
        "offload_param": {"device": "nvme", "persistence_threshold": 0, **pool},
    }


def build_config(args: argparse.Namespace, nvme_dir: str, device: str) -> dict[str, Any]:
    """Defaults, then ``--config FILE``, then the explicit flags (``--device``, ``--dtype``,
    ``--stage``, ``--nvme-path``). A DeepSpeed file replaces the defaults (mapped as the loader
    maps it: its absent keys take offload's defaults, not the demo's); the flags apply to it
    as to an offload config, and so does the swap directory for an NVMe section without
    ``nvme_path``."""
    from offload.config.deepspeed import is_deepspeed_config  # noqa: PLC0415

    cfg = demo_config(nvme_dir, device=device, dtype=args.dtype or "fp32", lr=args.lr)
    if args.config:
        user = _read_config_file(args.config)
        if is_deepspeed_config(user):
            cfg = _from_deepspeed(user, nvme_dir, args.config)
        else:
            cfg = _merge(cfg, user)
        if args.dtype:
            cfg["dtype"] = args.dtype
        if args.device:
            cfg["device"] = device
    if getattr(args, "stage", None):
        stage = args.stage if args.stage == "auto" else int(args.stage)
        dist = cfg.get("distributed")
        if isinstance(dist, dict) or dist is None:  # (another type: the loader names it)
            cfg["distributed"] = {**(dist or {}), "stage": stage}
    for section in ("offload_optimizer", "offload_param"):
        sec = cfg.get(section)
        if isinstance(sec, dict) and (args.nvme_path or not sec.get("nvme_path")):
            sec["nvme_path"] = nvme_dir
    return cfg


def _from_deepspeed(user: dict[str, Any], nvme_dir: str, path: str) -> dict[str, Any]:
    """A DeepSpeed config in offload's format, an NVMe section without ``nvme_path`` given the
    demo's swap directory (as ``offload finetune`` gives it ``OUT/swap``)."""
    from offload.config import ConfigError, load_config  # noqa: PLC0415
    from offload.config.loader import nvme_sections_without_path  # noqa: PLC0415

    user = copy.deepcopy(user)
    for sec in nvme_sections_without_path(user):
        sec["nvme_path"] = nvme_dir
    try:
        return load_config(user, deepspeed=True).to_dict()
    except ConfigError as exc:
        raise exc.with_source(path) from None


def _resolve_device(name: str | None) -> str:
    import torch  # noqa: PLC0415

    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def host_buffer_bytes(cfg: OffloadConfig, largest_unit_params: int) -> int:
    """Bytes of the host swap pools of the sections that live on NVMe, "auto" sizes resolved
    for the model's largest unit as wrap resolves them (fp32 for the optimizer pool, the compute
    dtype for the param pool)."""
    from offload.config import resolve_auto_buffer_size  # noqa: PLC0415

    itemsize = {"offload_optimizer": 4, "offload_param": _ITEMSIZE[cfg.dtype]}
    total = 0
    for section, size in itemsize.items():
        sec = getattr(cfg, section)
        if sec.device == "nvme":
            nbytes = resolve_auto_buffer_size(section, cfg, largest_unit_params * size)
            total += sec.buffer_count * nbytes
    return total


def rss_before_model() -> int:
    """RSS of this process before the model exists, after paying once what any training loop
    pays (the autograd engine, the first ``torch.optim.Optimizer``, which imports
    ``torch._dynamo``): the baseline the documented host budget is counted from, measured the
    way ``tests/test_memory.py`` measures it."""
    import torch  # noqa: PLC0415

    from offload.demo.loop import current_rss  # noqa: PLC0415

    warm = torch.nn.Linear(4, 1)
    warm(torch.zeros(2, 4)).sum().backward()
    torch.optim.SGD(warm.parameters(), lr=0.1).step()
    return current_rss()


def _close(optimizer: Any, model: Any) -> None:
    for obj in (optimizer, model):
        close = getattr(obj, "close", None)
        if callable(close):
            close()
            return


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.batch_size < 1:
        print("offload demo: error: --steps and --batch-size must be >= 1", file=sys.stderr)
        return 2
    for flag, value, least in (
        ("--seq-len", args.seq_len, 1),
        ("--warmup", args.warmup, 0),
        ("--eval-batches", args.eval_batches, 0),
    ):
        if value is not None and value < least:
            print(f"offload demo: error: {flag} must be >= {least}, got {value}", file=sys.stderr)
            return 2
    if not (math.isfinite(args.lr) and args.lr > 0):
        print(
            f"offload demo: error: --lr must be a finite number > 0, got {args.lr}", file=sys.stderr
        )
        return 2
    if not args.no_report and os.path.exists(args.report) and not os.path.isdir(args.report):
        # (it was a FileExistsError traceback once the model was built and wrapped)
        print(
            f"offload demo: error: --report {args.report!r} is a file, not a directory "
            "(nothing was changed); give a directory or --no-report",
            file=sys.stderr,
        )
        return 2
    nproc = getattr(args, "nproc", 1)
    if nproc < 1:
        print("offload demo: error: --nproc must be >= 1", file=sys.stderr)
        return 2
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        if args.baseline:
            print("offload demo: error: --baseline runs one process (no --nproc)", file=sys.stderr)
            return 2
        argv = getattr(args, "_argv", None) or sys.argv[1:]
        return ranks.launch("demo", nproc, argv[argv.index("demo") + 1 :])
    if not args.baseline:
        ok, why = engine_status()
        if not ok:
            print(f"{ENGINE_MISSING} ({why})", file=sys.stderr)
            return 2

    import torch  # noqa: PLC0415

    from offload.demo import report as rep  # noqa: PLC0415
    from offload.demo.data import ByteCorpus  # noqa: PLC0415
    from offload.demo.loop import train  # noqa: PLC0415
    from offload.demo.model import (  # noqa: PLC0415
        GPT,
        config_for_size,
        describe,
        largest_unit_params,
        param_count,
    )
    from offload.estimate import host_memory_budget  # noqa: PLC0415

    try:
        gcfg = config_for_size(args.size, seq_len=args.seq_len, tie_embeddings=args.tie_embeddings)
    except ValueError as exc:
        print(f"offload demo: error: {exc}", file=sys.stderr)
        return 2
    device = _resolve_device(args.device)
    rank, world = 0, 1  # (several ranks: joined as the engine is made, below)
    n_params = param_count(gcfg)
    torch.manual_seed(args.seed)
    t_load = time.perf_counter()
    corpus = ByteCorpus.from_stdlib()
    load_s = time.perf_counter() - t_load
    rss_before = rss_before_model()
    model = GPT(gcfg)

    # One directory for every run (the user's own, or --nvme-path), not a new one per run:
    # each store makes its own swap directory in it, and reclaims those of owners that are
    # gone, so a demo killed outright (SIGKILL, the out-of-memory killer) leaves nothing for
    # good, where a new temporary directory per run was never looked in again
    swap_dir = args.nvme_path or os.path.join(tempfile.gettempdir(), f"offload-demo-{os.getuid()}")
    try:
        os.makedirs(swap_dir, mode=0o700, exist_ok=True)
    except OSError as exc:
        where = args.nvme_path or tempfile.gettempdir()
        print(
            f"offload demo: error: --nvme-path: cannot make a swap directory in {where!r}: "
            f"{exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    writer = None
    optimizer = None
    result = None
    header: list[tuple[str, str]] = [("model", describe(gcfg))]
    report_dir = None if args.no_report else Path(args.report)
    accumulation = 1  # micro-batches per step: the config's gradient_accumulation_steps
    try:
        if args.baseline:
            model = model.to(device)
            optimizer = torch.optim.AdamW(
                model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01
            )
            cfg: dict[str, Any] = {"baseline": "torch.optim.AdamW, all state in memory"}
            dtype_name = "fp32"
            budget = None
            header.append(("state", "plain PyTorch AdamW, everything in memory (baseline)"))
        else:
            # offload.wrap is this function; importing it from its home also works when an
            # editable install exposes `offload` as a namespace package (no top-level __init__).
            from offload.api import engine_of, wrap  # noqa: PLC0415
            from offload.config import load_config  # noqa: PLC0415

            try:
                cfg = build_config(args, swap_dir, device)
                norm = load_config(cfg)  # as the engine reads it (DeepSpeed mapped, sizes parsed)
                # the group's own timeout is distributed.timeout (ranks.join_group): with
                # torch's 30 minutes a rank whose peer was stuck said so, then did not end
                rank, world, _ = ranks.join_group(device, norm.distributed.timeout)
                model, optimizer = wrap(model, cfg)
            except (ValueError, OSError) as exc:  # ConfigError is a ValueError
                print(f"offload demo: error: {exc}", file=sys.stderr)
                return 2
            if rank != 0:  # rank 0 reports (Note: several ranks)
                args.no_progress, args.no_report, report_dir = True, True, None
            dtype_name = norm.dtype
            if isinstance(norm.gradient_accumulation_steps, int):  # (else "auto": one)
                accumulation = norm.gradient_accumulation_steps
            unit = largest_unit_params(gcfg)
            buffers = host_buffer_bytes(norm, unit)
            budget = host_memory_budget(buffers, unit) if buffers else None
            fp32_state = 16 * n_params
            where = ", ".join(
                f"{label} on {getattr(norm, name).device}"
                for name, label in (("offload_param", "params"), ("offload_optimizer", "optimizer"))
            )
            header.append(
                (
                    "state",
                    f"{where}; fp32 state (params, grads, m, v) {rep.fmt_size(fp32_state)} vs "
                    f"host buffers {rep.fmt_size(buffers)}"
                    + (f" ({fp32_state / buffers:.1f}x)" if 0 < buffers <= fp32_state else ""),
                )
            )
            if budget is not None:
                header.append(
                    (
                        "host budget",
                        f"{rep.fmt_size(budget.total)} of RSS growth (README 'Memory'): buffers "
                        f"{rep.fmt_size(budget.buffers)} + 4 x largest unit in fp32 "
                        f"{rep.fmt_size(budget.units)} + fixed {rep.fmt_size(budget.fixed)}",
                    )
                )
        header.append(
            ("data", f"{len(corpus.train) / 1e6:.1f} MB of stdlib source ({load_s:.1f} s)")
        )
        header.append(("device", f"{device}, dtype {dtype_name}"))
        if accumulation > 1:
            header.append(
                (
                    "accumulation",
                    f"{accumulation} micro-batches of {args.batch_size} per step "
                    "(gradient_accumulation_steps)",
                )
            )
        if report_dir is not None:
            try:
                writer = rep.MetricsWriter(report_dir / "metrics.jsonl")
            except OSError as exc:
                print(
                    f"offload demo: error: --report: cannot write in {str(report_dir)!r}: "
                    f"{exc.strerror or exc}",
                    file=sys.stderr,
                )
                return 2
            writer.write(
                {
                    "kind": "run",
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "model": {"params": n_params, "d_model": gcfg.d_model,
                              "n_layer": gcfg.n_layer, "n_head": gcfg.n_head,
                              "seq_len": gcfg.seq_len, "tie_embeddings": gcfg.tie_embeddings},
                    "config": cfg,
                    "host_budget_bytes": budget.total if budget else 0,
                    "host_budget": dataclasses.asdict(budget) if budget else None,
                    "rss_before_model_bytes": rss_before,
                    "steps": args.steps,
                    "batch_size": args.batch_size,
                    "gradient_accumulation_steps": accumulation,
                    "baseline": bool(args.baseline),
                }
            )  # fmt: skip
        if world > 1:
            header.append(
                (
                    "ranks",
                    f"{world} (ZeRO stage {norm.distributed.resolve_stage(norm.offload_param.device)}, batch {args.batch_size} per rank)",
                )
            )
        if rank == 0:
            print(f"offload demo: {describe(gcfg)}; {header[1][1]}", file=sys.stderr)
        result = train(
            model,
            optimizer,
            corpus,
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=gcfg.seq_len,
            lr=args.lr,
            warmup_steps=args.warmup,
            seed=args.seed + rank,
            eval_batches=args.eval_batches,
            device=device,
            writer=writer,
            progress=not args.no_progress,
            comm=engine_of(model).comm if world > 1 else None,  # the run's loss and tokens
            accumulation=accumulation,
        )
    except KeyboardInterrupt:  # Ctrl-C while setting up (wrap, first IO), before any step
        result = None
    finally:
        previous = None
        try:
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread
            pass
        try:
            if optimizer is not None and not args.baseline:
                _close(optimizer, model)
        finally:
            if not args.nvme_path:  # the stores removed their own: the run's directory, if
                with contextlib.suppress(OSError):  # no other run uses it
                    os.rmdir(swap_dir)
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    if world > 1:
        import torch.distributed as dist  # noqa: PLC0415

        dist.destroy_process_group()
    if rank != 0:
        return 130 if result is None or result.interrupted else 0
    if result is None:
        if writer is not None:
            writer.close()
        print(
            "offload demo: interrupted before training started; swap files removed", file=sys.stderr
        )
        return 130
    summary = rep.summarize(result.records)
    if result.interrupted:
        header.append(("stopped", f"Ctrl-C after {result.steps_done} of {args.steps} steps"))
    if writer is not None and report_dir is not None:
        writer.write({"kind": "summary", "interrupted": result.interrupted, **summary})
        writer.close()
        header.append(("report", str(report_dir / "metrics.jsonl")))
        try:
            png = rep.plot_report(
                result.records,
                report_dir / "report.png",
                title=f"offload demo: {describe(gcfg)}",
                host_budget=budget,
                rss_before_bytes=rss_before,
            )
            header.append(("plot", str(png)))
        except ImportError:
            header.append(("plot", "skipped: matplotlib missing (pip install 'offload[plot]')"))
    print("\noffload demo summary")
    print(rep.format_summary(summary, header))
    return 130 if result.interrupted else 0
