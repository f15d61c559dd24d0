"""bench_autocast: training under ``torch.autocast`` (bf16 over fp32 weights), offload against
torch, in time and in the bf16 copies of the weights kept alive.

A stack of ``--blocks`` MLP blocks (``--dim`` x 4 ``--dim``) on ``--tokens`` tokens, one copy of
the model per variant (the same initial weights and batch); fwd+bwd timed (the optimizer step
after it is not: ``step_in_backward`` is off), the variants interleaved A B C per rep, medians
over ``--reps`` after one warm-up step:

- ``torch``: the plain model under ``torch.autocast`` (its cast cache on, torch's default).
- ``offload``: ``offload.wrap`` (params on the device, optimizer on the CPU), its forward saving
  references to the weights' casts (``offload/runtime/autocast.py``).
- ``offload, copies saved``: the same with the references turned off (``AutocastSaves`` packs
  every tensor as is): what offload did before them, less its cache setting.

``--frozen`` freezes the blocks' matrices (an adapter's base: their copies are matched by their bits).
Then one more step of each, untimed, under a dispatch mode that holds every bf16 copy of a
weight-shaped tensor weakly: the most alive at once (torch's whole model's; offload's 2 at most).

Run: python benchmarks/bench_autocast.py [--blocks 8] [--dim 1024] [--tokens 512] [--frozen]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's offload, not another one installed

import offload  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, blocks: int, dim: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class LiveCopies(TorchDispatchMode):
    """The most bf16 copies of a tensor of one of ``shapes`` alive at once while it ran."""

    def __init__(self, shapes) -> None:
        super().__init__()
        self.shapes, self.refs, self.peak = shapes, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16:
            if tuple(out.shape) in self.shapes:
                self.refs.append(weakref.ref(out))
                self.peak = max(self.peak, sum(r() is not None for r in self.refs))
        return out


def _wrapped(model: nn.Module, references: bool):
    cfg = {
        "device": "cpu",
        "dtype": "fp32",
        "optimizer": {"type": "adamw", "lr": 1e-4},
        "offload_param": {"device": "none"},
        "offload_optimizer": {"device": "cpu", "step_in_backward": False},
        "wrap": {"module_classes": ["Block"]},
    }
    model, opt = offload.wrap(model, cfg)
    if not references:
        saves = opt._engine.autocast
        saves.hooks = (lambda t: t, saves.hooks[1])  # (the pair is pushed as it is here)
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--frozen", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    base = Stack(args.blocks, args.dim)
    if args.frozen:
        for b in base.blocks:
            b.fc1.weight.requires_grad_(False)
            b.fc2.weight.requires_grad_(False)
    x = torch.randn(4, args.tokens // 4, args.dim)
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-4)
    variants = {
        "torch": (ref, ref_opt),
        "offload": _wrapped(copy.deepcopy(base), references=True),
        "offload, copies saved": _wrapped(copy.deepcopy(base), references=False),
    }

    def step(model, opt) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        took = time.perf_counter() - t0
        opt.step()
        opt.zero_grad()
        return took

    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.reps + 1):
        for name, (model, opt) in variants.items():
            took = step(model, opt)
            if rep:  # (the first is the warm-up)
                times[name].append(took)
    shapes = {tuple(p.shape) for p in base.parameters() if p.dim() == 2}
    n = sum(p.numel() for p in base.parameters())
    print(
        f"bench_autocast: {args.blocks} blocks of {args.dim} x {4 * args.dim} ({n / 1e6:.1f}M "
        f"params{', matrices frozen' if args.frozen else ''}), {args.tokens} tokens, "
        f"{torch.get_num_threads()} threads, medians of {args.reps}"
    )
    print(f"{'variant':<24}{'fwd+bwd':>10}{'/ torch':>10}{'bf16 weight copies alive':>28}")
    t_torch = statistics.median(times["torch"])
    for name, (model, opt) in variants.items():
        copies = LiveCopies(shapes)
        with copies:
            step(model, opt)
        t = statistics.median(times[name])
        print(f"{name:<24}{t:>9.3f}s{t / t_torch:>9.2f}x{copies.peak:>28d}")
    for name, (_, opt) in variants.items():
        if name != "torch":
            opt.close()


if __name__ == "__main__":
    main()
