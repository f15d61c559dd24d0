"""Peak RSS growth during ``offload.wrap`` alone (issue 14's figure), each case in a fresh process.

    python benchmarks/wrap_memory.py [--modes live weights] [--dtypes bf16 fp32]

The model: a 16-block MLP stack of 128M parameters (256 MiB in bf16, 512 MiB in fp32), params
and optimizer state on NVMe with 4 x 16 MiB buffers in each pool.

- ``live``: the model is materialized first; the growth is over the RSS that holds it (what
  ``wrap`` adds on top of the model).
- ``weights``: the model is built on the meta device and wrapped with ``weights=`` a sharded
  safetensors checkpoint written beforehand (in the parent process); the growth is over the
  RSS before ``wrap`` (the model holds no bytes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.nn as nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

BLOCKS, DIM, HIDDEN = 16, 1024, 4095  # 8M parameters a block
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP() for _ in range(BLOCKS))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _config(work: Path, dtype: str) -> dict:
    pool = {"buffer_count": 4, "buffer_size": "16MiB"}
    return {
        "device": "cpu",
        "dtype": dtype,
        "offload_param": {
            "device": "nvme",
            "nvme_path": str(work / "p"),
            "persistence_threshold": 0,
        }
        | pool,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(work / "o")} | pool,
        "wrap": {"module_classes": ["MLP"]},
    }


def child(work: Path, dtype: str, mode: str) -> dict:
    import offload  # noqa: PLC0415

    torch.manual_seed(0)
    if mode == "weights":
        with torch.device("meta"):
            model = Stack().to(DTYPES[dtype])
    else:
        model = Stack().to(DTYPES[dtype])
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak, stop = [base], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    weights = work / "ckpt" if mode == "weights" else None
    model, opt = offload.wrap(model, _config(work, dtype), weights=weights)
    seconds = time.perf_counter() - t0
    stop.set()
    t.join()
    opt.close()
    nbytes = sum(p.numel() for p in model.parameters()) * DTYPES[dtype].itemsize
    return {"growth": max(peak[0], proc.memory_info().rss) - base, "model": nbytes, "s": seconds}


def _write_checkpoint(directory: Path, dtype: str) -> None:
    from offload.api.pretrained import write_shards  # noqa: PLC0415

    torch.manual_seed(0)
    entries = []
    for name, t in Stack().to(DTYPES[dtype]).state_dict().items():
        entries.append((name, t.dtype, list(t.shape), lambda t=t: iter([t])))
    write_shards(directory, entries, "100MB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["live", "weights"])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        work, dtype, mode = args.child
        print(json.dumps(child(Path(work), dtype, mode)))
        return 0
    for mode in args.modes:
        for dtype in args.dtypes:
            with tempfile.TemporaryDirectory(prefix="offload-wrap-memory-") as tmp:
                work = Path(tmp)
                (work / "p").mkdir()
                (work / "o").mkdir()
                if mode == "weights":
                    _write_checkpoint(work / "ckpt", dtype)
                cmd = [sys.executable, __file__, "--child", str(work), dtype, mode]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"{mode:<8} {dtype}: model {r['model'] / 2**20:.0f} MiB, wrap peak RSS growth "
                f"+{r['growth'] / 2**20:.0f} MiB ({r['s']:.1f} s)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
