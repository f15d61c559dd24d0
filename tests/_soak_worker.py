"""Run by test_soak.py in a fresh process (so other tests' history does not move its figures):
``python tests/_soak_worker.py ROOT STEPS STEP...`` trains the shared test model with params
and optimizer state on NVMe under ROOT, and prints one JSON line of figures after each listed
step and at the end: RSS (bytes, after returning freed heap to the OS), open file descriptors,
OS threads, Python threads, swap-file bytes on disk, GC-tracked objects.
"""

import ctypes
import gc
import json
import os
import sys
import threading
from pathlib import Path

import psutil
import torch
from engine_models import batches, lm_loss, make_model, placement_config

import offload
from offload.io import _owner


def figures(root: Path) -> dict:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # RSS then counts live memory, not the free lists
    return dict(
        rss=psutil.Process().memory_info().rss,
        fds=len(os.listdir("/proc/self/fd")),
        threads=psutil.Process().num_threads(),
        python_threads=threading.active_count(),
        swap_bytes=sum(_owner.disk_bytes(str(d)) for d in root.glob("nvme_*")),
        objects=len(gc.get_objects()),
    )


def main() -> None:
    root, steps = Path(sys.argv[1]), int(sys.argv[2])
    report = {int(s) for s in sys.argv[3:]} | {steps}
    torch.set_num_threads(1)  # tiny matmuls: torch's intra-op threads only add noise
    model, opt = offload.wrap(
        make_model(hidden=32, huge_rows=256), placement_config("nvme", "nvme", root)
    )
    data = batches(8, batch=2, seq=8)
    for step in range(1, steps + 1):
        loss = lm_loss(model, data[step % len(data)])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if not torch.isfinite(loss):
            sys.exit(f"step {step}: loss {loss}")
        if step in report:
            opt.synchronize()
            print(json.dumps(dict(step=step, **figures(root))), flush=True)
    opt.close()


if __name__ == "__main__":
    main()
