"""bench_adam_phase: the optimizer phase inside a real training step, right after backward.

The demo GPT (fp32, ``--size``) in a plain loop, one copy of the model per variant (the same
initial weights and batch): forward and backward untimed, then ``optimizer.step()`` timed on its
own, started the moment ``backward()`` returns, as training does. At that moment torch's OpenMP
workers are still spinning from backward's last parallel regions (libgomp's default wait
policy keeps them busy ~5 ms), so an optimizer with threads of its own competes with them for
the cores; DeepSpeedCPUAdam's OpenMP loop runs on those same threads. Each variant's step is
also timed after a 0.2 s idle gap between backward and step (``gap`` rows): the difference
between the two rows is what the contention costs.

Variants (interleaved A B C D per rep, both modes in each rep; medians over ``--reps`` after
``--warmup`` steps):

- ``offload wrap``: ``offload.wrap(model, device="cpu", offload_optimizer.device="cpu")``,
  the engine's host optimizer (one native call for the whole step), on the default compute
  threads: torch's OpenMP team when torch runs on libgomp (``csrc/compute_threads.h``).
- ``offload wrap, no_decay``: the same with biases and LayerNorm weights undecayed
  (``optimizer.no_decay``): the update's two kernel calls (decayed, not) instead of one.
- ``offload wrap, param_groups``: the same with three param groups of their own
  (``offload.wrap(param_groups=)``: the attention weights, the MLP weights, the rest, each
  with its own LR), interleaved in every block: one kernel call per group and piece instead
  of one per piece.
- ``offload wrap, own pool``: the same, its kernels on offload's own thread pool (what every
  step ran on before the team was joined): the in-run reference for the contention fix.
- ``offload CPUAdam``: ``offload.optim.CPUAdam`` as a drop-in ``torch.optim.Optimizer`` (one
  native call per param group).
- ``DeepSpeedCPUAdam``: the peer, as a drop-in optimizer (``adamw_mode=True``).
- ``torch AdamW fused``: ``torch.optim.AdamW(fused=True)``, for orientation.

Bar (issue 16): the offload step after backward >= 0.95x DeepSpeedCPUAdam's (time ratio
DeepSpeed / offload).

Run: TORCH_EXTENSIONS_DIR=/work/peers-venv/torch_extensions /work/peers-venv/bin/python \\
         benchmarks/bench_adam_phase.py [--size 50M] [--reps 10]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's offload, not another one installed in the venv

import offload  # noqa: E402
from offload import _native  # noqa: E402
from offload.demo.model import GPT, config_for_size, lm_loss  # noqa: E402
from offload.optim import CPUAdam  # noqa: E402

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.999), 1e-8, 0.01
GAP_S = 0.2  # the idle gap of the "gap" rows: libgomp's spinning workers have gone to sleep


def _deepspeed_adam() -> tuple[type | None, str]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415

        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(16))])  # build / load the op now
        return DeepSpeedCPUAdam, ""
    except Exception as exc:  # noqa: BLE001 - any failure means "unavailable"
        return None, f"{type(exc).__name__}: {exc}"[:160]


def _variants(base: torch.nn.Module, ds_cls: type | None) -> dict[str, tuple]:
    """name -> (model, optimizer); each model a deep copy of ``base``."""
    out: dict[str, tuple] = {}
    config = {
        "device": "cpu",
        "dtype": "fp32",
        "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        "offload_param": {"device": "none"},
        "offload_optimizer": {"device": "cpu"},
    }
    model, opt = offload.wrap(copy.deepcopy(base), config)
    out["offload wrap"] = (model, opt)
    undecayed = config | {"optimizer": config["optimizer"] | {"no_decay": ["bias", "ln"]}}
    model, opt = offload.wrap(copy.deepcopy(base), undecayed)
    out["offload wrap, no_decay"] = (model, opt)
    model = copy.deepcopy(base)
    model, opt = offload.wrap(model, config, param_groups=_kind_groups(model))
    out["offload wrap, param_groups"] = (model, opt)
    if _native.compute_backend().startswith("openmp"):  # the same step on offload's own threads
        model, opt = offload.wrap(copy.deepcopy(base), config)
        out["offload wrap, own pool"] = (model, _OnPool(opt))
    m = copy.deepcopy(base)
    out["offload CPUAdam"] = (
        m,
        CPUAdam(m.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
    )
    if ds_cls is not None:
        m = copy.deepcopy(base)
        ds = ds_cls(m.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        out["DeepSpeedCPUAdam"] = (m, ds)
    m = copy.deepcopy(base)
    fused = torch.optim.AdamW(
        m.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True
    )
    out["torch AdamW fused"] = (m, fused)
    return out


def _kind_groups(model: torch.nn.Module) -> list[dict]:
    """Three groups interleaved in every block: attention weights, MLP weights, the rest."""
    kinds: list[list] = [[], [], []]
    for name, p in model.named_parameters():
        kind = 0 if ".attn." in name and name.endswith("weight") else 2
        kinds[1 if ".mlp." in name and name.endswith("weight") else kind].append(p)
    lrs = (0.5 * LR, 2 * LR, LR)
    return [{"params": ps, "lr": lr} for ps, lr in zip(kinds, lrs, strict=True)]


class _OnPool:
    """An optimizer whose ``step()`` runs the kernels on offload's own thread pool instead of
    torch's OpenMP team (``offload._native.compute_backend_set``): the contention fix's in-run
    reference."""

    def __init__(self, opt) -> None:
        self.opt = opt

    def step(self) -> None:
        with _native.compute_backend_set("pool"):
            self.opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        self.opt.close()


def _step_after_backward(model, opt, x, gap: float) -> float:
    """Forward and backward (untimed), then ``opt.step()`` timed; ``gap`` seconds idle between."""
    loss = lm_loss(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    if gap:
        time.sleep(gap)
    t0 = time.perf_counter()
    opt.step()
    dt = time.perf_counter() - t0
    opt.zero_grad(set_to_none=True)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="50M", help="demo GPT size (offload.demo.model)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch and offload threads (2)")
    ap.add_argument("--reps", type=int, default=10, help="timed steps per variant and mode")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # also DeepSpeed's OpenMP: it shares torch's libgomp
    _native.set_num_threads(args.threads)
    ds_cls, ds_why = _deepspeed_adam()
    torch.manual_seed(0)
    gcfg = config_for_size(args.size, seq_len=args.seq)
    base = GPT(gcfg)
    n = sum(p.numel() for p in base.parameters())
    x = torch.randint(0, 256, (args.batch, args.seq + 1))
    variants = _variants(base, ds_cls)
    del base
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if "model name" in ln), "?"
    )
    load = [os.getloadavg()[0]]
    print(
        f"# bench_adam_phase {time.strftime('%Y-%m-%d %H:%M %Z')}; {cpu}, {os.cpu_count()} cores, "
        f"SIMD {_native.simd_level()}; torch {torch.__version__}; threads {args.threads} "
        f"(offload's on {_native.compute_backend()}); "
        f"model {n / 1e6:.1f}M params ({gcfg.n_layer} x d{gcfg.d_model}), batch {args.batch} x "
        f"seq {args.seq}, fp32; DeepSpeed {'available' if ds_cls else 'unavailable: ' + ds_why}"
    )
    for _ in range(args.warmup):
        for model, opt in variants.values():
            _step_after_backward(model, opt, x, 0.0)
    times: dict[tuple[str, str], list[float]] = {}
    modes: dict[str, float] = {"after backward": 0.0, "gap": GAP_S}
    steps: list[tuple[str, str, Callable[[], float]]] = [
        (name, mode, lambda mv=mv, g=g: _step_after_backward(*mv, x, g))
        for name, mv in variants.items()
        for mode, g in modes.items()
    ]
    for r in range(args.reps):
        k = r % len(steps)
        for name, mode, fn in steps[k:] + steps[:k]:  # rotate the order each rep
            times.setdefault((name, mode), []).append(fn())
        load.append(os.getloadavg()[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# load average (1 min), start and after each rep: {' '.join(f'{x:.1f}' for x in load)}")
    print()
    print("| variant | step after backward, median ms | step after a 0.2 s gap, median ms "
          "| after backward / gap | DeepSpeed / variant (after backward) |")  # fmt: skip
    print("|---|---|---|---|---|")
    ds = med.get(("DeepSpeedCPUAdam", "after backward"))
    for name in variants:
        a, g = med[(name, "after backward")], med[(name, "gap")]
        vs = f"{ds / a:.2f}x" if ds else "-"
        print(f"| {name} | {a * 1e3:.1f} | {g * 1e3:.1f} | {a / g:.2f}x | {vs} |")
    if ds:
        for name in ("offload wrap", "offload CPUAdam"):
            r = ds / med[(name, "after backward")]
            print(f"bar: {name} step after backward {r:.2f}x DeepSpeedCPUAdam "
                  f"({'PASS' if r >= 0.95 else 'FAIL'} >= 0.95x)")  # fmt: skip
    for _, opt in variants.values():
        if hasattr(opt, "close"):
            opt.close()


if __name__ == "__main__":
    main()
