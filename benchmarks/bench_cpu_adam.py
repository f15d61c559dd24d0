"""bench_cpu_adam: the CPU Adam step against its memory roof and its peers, in one run.

Two tables, for 64M and 256M parameters at 1 and 2 threads:

1. Plain fp32 AdamW step (28 bytes per parameter must move: read p, g, m, v; write p, m, v):
   offload's ``adam_step``, the 4-read/3-write streaming kernel (``offload._C.stream_4r3w``, the
   roof, on the same threads), ``torch.optim.AdamW(fused=True)``, ``torch.optim.AdamW(
   foreach=True)`` and DeepSpeed's ``DeepSpeedCPUAdam`` (when importable).
2. The engine's optimizer phase: bf16 gradients in, loss-scale/clip coefficient applied, AdamW,
   bf16 parameters out. offload does it in one pass (``adam_step(grad=bf16, grad_scale=s,
   out=bf16)``, 28 B/param); DeepSpeed-composed: ``g32.copy_(g_bf16); g32.mul_(s);
   DeepSpeedCPUAdam.step(); out.copy_(p)``; torch-fused-composed: ``g32.copy_(g_bf16)``, then
   ``AdamW(fused=True).step()`` with the scale fused through its ``grad_scale`` input (the
   GradScaler protocol), then ``out.copy_(p)``.

Method: every variant works on the same buffers (optimizer states are pre-populated with the
shared ``exp_avg``/``exp_avg_sq``), variants are interleaved (A B C ... A B C ...), each round
uses a fresh allocation, and the table reports medians over all timed steps of all rounds.
Every timed step starts after a 0.2 s idle gap, then, in the ``after torch`` mode (``--lead``),
a short torch workload on the same threads (elementwise adds over 4M elements and a 512 x 512
matmul, a few ms: how a training step reaches its optimizer, right after backward's last ops)
and the step at once; in the ``idle`` mode the step starts after the gap alone. After torch
work, torch's OpenMP workers keep spinning for ~5 ms (libgomp's default wait policy): an
optimizer on threads of its own competes with them, DeepSpeedCPUAdam's OpenMP loop reuses them.
Effective GB/s = 28 bytes x parameters / median time for every row (the bytes the step must
move), so "% roof" compares each variant with the streaming kernel measured in the same run
and mode.

Run: TORCH_EXTENSIONS_DIR=/work/peers-venv/torch_extensions /work/peers-venv/bin/python \\
         benchmarks/bench_cpu_adam.py [--sizes 64M,256M] [--threads 1,2] [--rounds 3] [--reps 3]
         [--lead torch,idle]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's offload, not another one installed in the venv

from offload import _native  # noqa: E402
from offload.optim import adam_step  # noqa: E402

BYTES_PER_PARAM = 28
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
SCALE = 1.0 / 1024  # loss-scale unscaling x clipping coefficient, applied to the gradient
# libgomp (torch, DeepSpeed) keeps its workers spinning for ~5 ms after a parallel region. The
# idle gap before every timed step gives each variant the same start: quiet ("idle"), or quiet
# and then the same torch work right before the step ("after torch", as in training).
SETTLE_S = 0.2
MODES = ("after torch", "idle")


class TorchLeadIn:
    """A few ms of torch work on torch's threads, the way a backward ends before the step."""

    def __init__(self) -> None:
        self.x, self.y, self.z = torch.randn(4 << 20), torch.randn(4 << 20), torch.empty(4 << 20)
        self.w = torch.randn(512, 512)

    def __call__(self) -> None:
        for _ in range(4):
            torch.add(self.x, self.y, out=self.z)
        torch.mm(self.w, self.w, out=self.w.new_empty(512, 512))


def _deepspeed_adam() -> tuple[type | None, str]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415

        probe = torch.nn.Parameter(torch.zeros(16))
        DeepSpeedCPUAdam([probe])  # builds / loads the op now, not inside a timed region
        return DeepSpeedCPUAdam, ""
    except Exception as exc:  # noqa: BLE001 - any failure means "unavailable"
        return None, f"{type(exc).__name__}: {exc}"[:160]


@dataclass
class Buffers:
    """One allocation shared by every variant of a round."""

    n: int
    p: torch.Tensor = field(init=False)
    g32: torch.Tensor = field(init=False)
    m: torch.Tensor = field(init=False)
    v: torch.Tensor = field(init=False)
    g16: torch.Tensor = field(init=False)
    out: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        n = self.n
        self.p = torch.empty(n).uniform_(-1, 1)
        self.g32 = torch.empty(n).uniform_(-1e-2, 1e-2)
        self.m = torch.zeros(n)
        self.v = torch.zeros(n)
        self.g16 = torch.empty(n, dtype=torch.bfloat16).uniform_(-10, 10)  # "loss-scaled"
        self.out = torch.empty(n, dtype=torch.bfloat16)


def _param(b: Buffers) -> torch.nn.Parameter:
    p = torch.nn.Parameter(b.p)  # shares storage with b.p
    p.grad = b.g32
    return p


def _torch_opt(b: Buffers, **kw) -> torch.optim.Optimizer:
    p = _param(b)
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": b.m, "exp_avg_sq": b.v}
    return opt


def _ds_opt(ds_cls: type, b: Buffers):
    p = _param(b)
    opt = ds_cls([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
    opt.state[p] = {"step": 0, "exp_avg": b.m, "exp_avg_sq": b.v}
    return opt


def plain_variants(b: Buffers, ds_cls: type | None, foreach: bool) -> dict[str, Callable | None]:
    mod = _native.get()
    state = {"step": 0}

    def offload_step() -> None:
        state["step"] += 1
        adam_step(b.p, b.g32, b.m, b.v, step=state["step"], lr=LR, betas=BETAS, eps=EPS,
                  weight_decay=WD)  # fmt: skip

    ptrs = (b.p.data_ptr(), b.g32.data_ptr(), b.m.data_ptr(), b.v.data_ptr())
    fused = _torch_opt(b, fused=True)
    variants: dict[str, Callable | None] = {
        "stream 4r3w (roof)": lambda: mod.stream_4r3w(*ptrs, b.n, 0.5),
        "offload adam_step": offload_step,
        "torch AdamW fused": fused.step,
        "torch AdamW foreach": _torch_opt(b, foreach=True).step if foreach else None,
        "DeepSpeedCPUAdam": _ds_opt(ds_cls, b).step if ds_cls else None,
    }
    return variants


def fused_phase_variants(b: Buffers, ds_cls: type | None) -> dict[str, Callable | None]:
    state = {"step": 0}

    def offload_fused() -> None:
        state["step"] += 1
        adam_step(b.p, b.g16, b.m, b.v, step=state["step"], lr=LR, betas=BETAS, eps=EPS,
                  weight_decay=WD, grad_scale=SCALE, out=b.out)  # fmt: skip

    ds = _ds_opt(ds_cls, b) if ds_cls else None

    def ds_composed() -> None:
        b.g32.copy_(b.g16)
        b.g32.mul_(SCALE)
        ds.step()
        b.out.copy_(b.p)

    tf = _torch_opt(b, fused=True)
    tf.grad_scale = torch.tensor(1.0 / SCALE)  # fused unscale: the kernel divides by it
    tf.found_inf = torch.tensor(0.0)

    def torch_fused_composed() -> None:
        b.g32.copy_(b.g16)
        tf.step()
        b.out.copy_(b.p)

    return {
        "offload adam_step fused": offload_fused,
        "DeepSpeed composed": ds_composed if ds else None,
        "torch fused composed": torch_fused_composed,
    }


def measure(
    n: int,
    threads: int,
    rounds: int,
    reps: int,
    ds_cls: type | None,
    foreach: bool,
    modes: tuple[str, ...],
) -> dict[str, tuple[dict[str, list[float]], dict[str, list[float]]]]:
    """mode -> (plain-step times, fused-phase times), each name -> seconds."""
    torch.set_num_threads(threads)  # also DeepSpeed's OpenMP: it shares torch's libgomp
    _native.set_num_threads(threads)
    lead_in = TorchLeadIn()
    out = {mode: ({}, {}) for mode in modes}
    for _ in range(rounds):
        b = Buffers(n)
        for kind, variants in enumerate(
            (plain_variants(b, ds_cls, foreach), fused_phase_variants(b, ds_cls))
        ):
            for name, fn in variants.items():
                for mode in modes:
                    out[mode][kind].setdefault(name, [])
                if fn is not None:
                    fn()  # warm-up: first touch of optimizer internals
            for _ in range(reps):  # interleaved: A B C ... A B C ..., each in every mode
                for name, fn in variants.items():
                    if fn is None:
                        continue
                    for mode in modes:
                        time.sleep(SETTLE_S)  # the previous variant's OpenMP threads stop spinning
                        if mode == "after torch":
                            lead_in()
                        t0 = time.perf_counter()
                        fn()
                        out[mode][kind][name].append(time.perf_counter() - t0)
            del variants
            gc.collect()
        del b
        gc.collect()
    return out


def _fmt_size(n: int) -> str:
    return f"{n // 2**20}M" if n % 2**20 == 0 else str(n)


def report(n: int, threads: int, mode: str, plain: dict, phase: dict) -> list[str]:
    med = {k: statistics.median(v) for k, v in {**plain, **phase}.items() if v}
    roof = med.get("stream 4r3w (roof)")
    rows = []
    for name in [*plain, *phase]:
        if name not in med:
            rows.append(f"| {_fmt_size(n)} | {threads} | {mode} | {name} | unavailable | | | | |")
            continue
        t = med[name]
        gbs = BYTES_PER_PARAM * n / t / 1e9
        pct = f"{100 * roof / t:.0f}%" if roof else "-"
        ours = med["offload adam_step"] if name in plain else med["offload adam_step fused"]
        rows.append(
            f"| {_fmt_size(n)} | {threads} | {mode} | {name} | {t * 1e3:.1f} | {n / t / 1e9:.2f} | "
            f"{gbs:.1f} | {pct} | {t / ours:.2f}x |"
        )
    return rows


def verdicts(n: int, threads: int, mode: str, plain: dict, phase: dict) -> list[str]:
    med = {k: statistics.median(v) for k, v in {**plain, **phase}.items() if v}
    out = []
    ours, roof = med["offload adam_step"], med["stream 4r3w (roof)"]
    peers = [med[k] for k in ("torch AdamW fused", "DeepSpeedCPUAdam") if k in med]
    best = min(peers)
    out.append(
        f"{_fmt_size(n)} x{threads} {mode}: plain step {best / ours:.2f}x the better of torch fused/"
        f"DeepSpeed (bar 0.95), {100 * roof / ours:.0f}% of the streaming roof (bar 85%)"
    )
    fused = med["offload adam_step fused"]
    for k in ("DeepSpeed composed", "torch fused composed"):
        if k in med:
            out.append(
                f"{_fmt_size(n)} x{threads} {mode}: fused phase {med[k] / fused:.2f}x {k} (bar 1.3)"
            )
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult != 1 else s) * mult)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64M,256M", help="parameter counts (M = 2**20)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3, help="fresh allocations per size/threads")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per variant per round")
    ap.add_argument(
        "--no-foreach", action="store_true", help="skip torch foreach (slow, +4 B/param temp)"
    )
    ap.add_argument(
        "--lead", default=",".join(MODES), help="modes: 'after torch' work and/or 'idle'"
    )
    args = ap.parse_args()
    modes = tuple(m.strip() for m in args.lead.split(","))
    if not set(modes) <= set(MODES):
        ap.error(f"--lead {args.lead!r}; allowed: {', '.join(MODES)}")
    if not _native.available():
        raise SystemExit(f"offload native extension unavailable: {_native.reason()}")
    ds_cls, ds_why = _deepspeed_adam()
    import importlib.metadata as md  # noqa: PLC0415

    try:
        ds_ver = md.version("deepspeed") if ds_cls else f"unavailable ({ds_why})"
    except md.PackageNotFoundError:
        ds_ver = "unknown"
    print(
        f"machine: {_cpu_model()}, {os.cpu_count()} cores, SIMD {_native.simd_level()}; "
        f"torch {torch.__version__}; DeepSpeed {ds_ver}; {time.strftime('%Y-%m-%d %H:%M %Z')}"
    )
    print(
        f"rounds={args.rounds} (fresh allocations) x reps={args.reps}, interleaved; medians; "
        f"load average at start {os.getloadavg()[0]:.1f}\n"
    )
    header = [
        "| params | threads | mode | variant | median ms | Gparam/s | eff. GB/s (28 B/param) | % roof | time vs offload |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(header), flush=True)
    notes = []
    for n in (_parse_size(s) for s in args.sizes.split(",")):
        for threads in (int(t) for t in args.threads.split(",")):
            got = measure(n, threads, args.rounds, args.reps, ds_cls, not args.no_foreach, modes)
            for mode, (plain, phase) in got.items():
                print("\n".join(report(n, threads, mode, plain, phase)), flush=True)
                notes += verdicts(n, threads, mode, plain, phase)
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")
    print("\n".join(notes))


if __name__ == "__main__":
    main()
