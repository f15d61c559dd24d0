"""Run by test_memory.py in a fresh process: peak RSS while training with params and optimizer
state on NVMe, against the host memory the configuration allows (``frozen``: forwards only, of
a model with no trainable parameter; ``opt_cpu``: the optimizer state on the CPU). Prints one
JSON line."""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.nn as nn
import torch.nn.functional as F
from engine_models import Block

import offload
from offload.api import engine_of

DIM, HIDDEN = 256, 1024
PARAM_BUF, OPT_BUF = 256 * 1024, 512 * 1024
VOCAB = 16384  # the LM's root: 2 x 16 MiB in fp32, 16 blocks


class Stack(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(DIM, HIDDEN) for _ in range(blocks))
        self.out = nn.Linear(DIM, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class LM(nn.Module):
    """An LM whose root (embedding and head, untied) is its largest unit, many times a block."""

    def __init__(self, blocks: int, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HIDDEN) for _ in range(blocks))
        self.head = nn.Linear(DIM, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _peak_of(fn) -> int:
    """The peak RSS while ``fn()`` runs, sampled every 2 ms."""
    proc = psutil.Process()
    peak = [proc.memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        fn()
    finally:
        stop.set()
        t.join()
    return max(peak[0], proc.memory_info().rss)


def _arena_bytes() -> list[int] | None:
    """The bytes each of glibc's malloc arenas holds from the OS (``malloc_info``'s current
    system size per heap, the main arena first), None where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "malloc_info.xml")
        f = libc.fopen(path.encode(), b"w")
        libc.malloc_info(0, f)
        libc.fclose(f)
        with open(path) as xml:
            heaps = re.findall(
                r'<heap nr="\d+">.*?<system type="current" size="(\d+)"', xml.read(), re.S
            )
    return [int(n) for n in heaps]


def main() -> None:
    workdir = Path(sys.argv[1])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y = torch.randn(2, 4, DIM), torch.randn(2, 4, 1)  # activations stay negligible
    proc = psutil.Process()
    (workdir / "p").mkdir()
    (workdir / "o").mkdir()
    cfg = {
        "device": "cpu",
        "dtype": "fp32",
        "offload_param": {
            "device": "nvme",
            "nvme_path": str(workdir / "p"),
            "buffer_count": 4,
            "buffer_size": PARAM_BUF,
            "persistence_threshold": 0,
        },
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": str(workdir / "o"),
            "buffer_count": 8,
            "buffer_size": OPT_BUF,
            "step_in_backward": "step_in_backward" in sys.argv[3:],
        },
        "wrap": {"module_classes": ["Block"]},
    }
    frozen = "frozen" in sys.argv[3:]  # nothing trains: forwards only (ZeRO-Inference's use)
    if "opt_cpu" in sys.argv[3:]:
        cfg["offload_optimizer"] = {"device": "cpu"}
    if "bf16" in sys.argv[3:]:  # (the LM's inputs are token ids: its compute dtype is free)
        cfg["dtype"] = "bf16"
    lm = "lm" in sys.argv[3:]  # the LM, with the "auto" swap buffers (the largest unit each)
    if lm:
        for section in ("offload_param", "offload_optimizer"):
            for key in ("buffer_count", "buffer_size"):
                cfg[section].pop(key, None)
    # Warm up what any training loop pays once, before the baseline: the autograd engine and
    # the first torch.optim.Optimizer (which imports torch._dynamo, ~50 MB of RSS).
    warm = nn.Linear(DIM, 1)
    F.mse_loss(warm(x), y).backward()
    torch.optim.SGD(warm.parameters(), lr=0.1).step()
    if lm:
        x, y = torch.randint(0, VOCAB, (2, 4)), torch.randint(0, VOCAB, (2, 4))
    base = proc.memory_info().rss  # before the model exists: everything after is the run's
    model = LM(int(sys.argv[2])) if lm else Stack(int(sys.argv[2]))
    n_params = sum(p.numel() for p in model.parameters())
    unit_params = sum(p.numel() for p in model.blocks[0].parameters())
    root_params = n_params - sum(p.numel() for p in model.blocks.parameters())
    loss_fn = (lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())) if lm else F.mse_loss
    if frozen:
        model.requires_grad_(False)
    model, opt = offload.wrap(model, cfg)  # the model's own fp32 storage is released here
    after_wrap = proc.memory_info().rss

    def train() -> None:
        for _ in range(3):
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    def infer() -> None:  # a model that trains nothing: forwards without gradients
        with torch.no_grad():
            for _ in range(3):
                model(x)

    peak = _peak_of(infer if frozen else train)
    saves = {}
    if "save" in sys.argv[3:]:  # a checkpoint and an export after training: peak over before
        for what, save in (
            ("export", lambda: offload.save_pretrained(model, workdir / "hf")),
            ("checkpoint", lambda: offload.save_checkpoint(workdir / "ckpt", model, opt)),
        ):
            before = proc.memory_info().rss
            top = _peak_of(save)
            saves[what] = top - before
            saves[f"{what}_growth"] = top - base
        before, arenas = proc.memory_info().rss, _arena_bytes()
        offload.load_checkpoint(workdir / "ckpt", model, opt)
        saves["kept_by_load"] = proc.memory_info().rss - before  # after it returned
        if arenas is not None:  # what each arena grew by (one made by the load: all of it)
            after = _arena_bytes()
            arenas += [0] * (len(after) - len(arenas))
            saves["arenas_grown_by_load"] = sum(max(0, a - b) for a, b in zip(after, arenas))
    if "resume" in sys.argv[3:]:  # the loaded run goes on: training, a checkpoint, an export
        saves["resumed_growth"] = _peak_of(train) - base
        saves["resumed_checkpoint_growth"] = (
            _peak_of(lambda: offload.save_checkpoint(workdir / "ckpt", model, opt)) - base
        )
        saves["resumed_export_growth"] = (
            _peak_of(lambda: offload.save_pretrained(model, workdir / "hf")) - base
        )
    pools = {k: s.stats()["host_reserved_bytes"] for k, s in engine_of(model).stores.items()}
    buffers = sum(pools.values())  # (opt.stats()'s, which a run with no step has not)
    if not lm:  # as configured (without the param pool's lent slots)
        buffers = 4 * PARAM_BUF + 8 * OPT_BUF * ("offload_optimizer" in pools)
    files = {d: [f for f in (workdir / d).rglob("*") if f.is_file()] for d in "po"}
    swap = {d: sum(f.stat().st_blocks * 512 for f in fs) for d, fs in files.items()}  # on disk
    opt.close()
    print(
        json.dumps(
            saves
            | {
                "pools": pools,
                "swap_bytes": swap,
                "base": base,
                "after_wrap": after_wrap,
                "peak": peak,
                "growth": peak - base,
                "n_params": n_params,
                "unit_params": unit_params,
                "largest_unit": max(unit_params, root_params),
                "fp32_state": 16 * n_params,
                "buffers": buffers,
            }
        )
    )


if __name__ == "__main__":
    main()
