"""Run by test_memory.py in a fresh process: peak RSS growth while wrapping with params and
optimizer on NVMe, either from a sharded safetensors checkpoint into a model on the meta device
(``weights``) or from a materialized model (``live``), then one training step and a
``save_pretrained`` export. Prints one JSON line.

    _load_memory_worker.py WORKDIR weights|live
"""

from __future__ import annotations

import json
import sys
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

DIM, HIDDEN, BLOCKS = 512, 2048, 28
PARAM_BUF, OPT_BUF = 1 << 20, 2 << 20


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(DIM, HIDDEN) for _ in range(BLOCKS))
        self.out = nn.Linear(DIM, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class Peak:
    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.value = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return self.proc.memory_info().rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.value = max(self.value, self.rss())
            time.sleep(0.002)

    def __enter__(self) -> Peak:
        self.value = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.value = max(self.value, self.rss())


def main() -> None:
    workdir, mode = Path(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, y = torch.randn(2, 4, DIM), torch.randn(2, 4, 1)
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
        },
        "wrap": {"module_classes": ["Block"]},
    }
    warm = nn.Linear(DIM, 1)  # what any training loop pays once (see _memory_worker.py)
    F.mse_loss(warm(x), y).backward()
    torch.optim.SGD(warm.parameters(), lr=0.1).step()
    if mode == "weights":
        with torch.device("meta"):
            model = Stack()
        weights = workdir / "ckpt"
    else:
        model, weights = Stack(), None
    base = Peak().rss()  # the model exists (on meta: no bytes; live: its own fp32 values)
    with Peak() as wrap_peak:
        model, opt = offload.wrap(model, cfg, weights=weights)
    with Peak() as train_peak:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
    with Peak() as export_peak:
        offload.save_pretrained(model, workdir / "export", max_shard_size="50MB")
    unit = engine_of(model).plan.largest_unit
    n_params = sum(p.numel() for p in model.parameters())
    opt.close()
    print(
        json.dumps(
            {
                "wrap": wrap_peak.value - base,
                "train": train_peak.value - base,
                "export": export_peak.value - base,
                "n_params": n_params,
                "largest_unit": unit,
                "fp32_state": 16 * n_params,
                "buffers": 4 * PARAM_BUF + 8 * OPT_BUF,
            }
        )
    )


if __name__ == "__main__":
    main()
