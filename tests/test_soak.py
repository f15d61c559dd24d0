"""Soak: a long run with params and optimizer state on NVMe leaks nothing (issue 13, part 5).

After a warm-up the process's open file descriptors, OS threads, swap-file bytes on disk and
GC-tracked Python objects stay exactly flat, and its RSS stays within a small allowance (the
allocator's noise, not a per-step growth). The default suite runs 150 steps; the slow one runs
1,000 and prints the figures at steps 100 and 1,000.
"""

from __future__ import annotations

import gc
import os
import threading

import psutil
import pytest
import torch
from engine_models import batches, lm_loss, make_model, placement_config

import offload
from offload.io import _owner

RSS_ALLOWANCE = 8 << 20  # bytes of RSS growth tolerated after warm-up (allocator noise)
# under AddressSanitizer (tests/test_sanitizers.py) freed memory waits in its quarantine, so RSS
# grows by design there; the other figures still must stay flat
ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")
OBJECT_ALLOWANCE = 64  # GC-tracked objects tolerated after warm-up (caches of lazy imports)


def sample(tmp_path) -> dict:
    gc.collect()
    return dict(
        rss=psutil.Process().memory_info().rss,
        fds=len(os.listdir("/proc/self/fd")),
        threads=psutil.Process().num_threads(),
        python_threads=threading.active_count(),
        swap_bytes=sum(_owner.disk_bytes(str(d)) for d in tmp_path.glob("nvme_*")),
        objects=len(gc.get_objects()),
    )


def soak(tmp_path, steps: int, warmup: int, report: tuple[int, ...] = ()) -> dict[int, dict]:
    """Trains ``steps`` steps; returns the samples taken after ``warmup`` and at each step in
    ``report`` and at the end (step -> sample)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: torch's intra-op threads only add noise
    try:
        model, opt = offload.wrap(
            make_model(hidden=32, huge_rows=256), placement_config("nvme", "nvme", tmp_path)
        )
        data = batches(8, batch=2, seq=8)
        samples = {}
        try:
            for step in range(1, steps + 1):
                loss = lm_loss(model, data[step % len(data)])
                loss.backward()
                opt.step()
                opt.zero_grad()
                assert torch.isfinite(loss), f"step {step}: loss {loss}"
                if step in (warmup, steps, *report):
                    opt.synchronize()
                    samples[step] = sample(tmp_path)
        finally:
            opt.close()
        return samples
    finally:
        torch.set_num_threads(threads)


def assert_flat(samples: dict[int, dict], warmup: int) -> None:
    first, last = samples[warmup], samples[max(samples)]
    for key in ("fds", "threads", "python_threads", "swap_bytes"):
        assert last[key] == first[key], f"{key}: {first[key]} after warm-up, {last[key]} at end"
    assert last["swap_bytes"] > 0
    assert last["objects"] - first["objects"] <= OBJECT_ALLOWANCE, (first, last)
    assert ASAN or last["rss"] - first["rss"] <= RSS_ALLOWANCE, (first, last)


def test_soak_150_steps(tmp_path):
    assert_flat(soak(tmp_path, 150, warmup=50), warmup=50)


@pytest.mark.slow
def test_soak_1000_steps(tmp_path):
    samples = soak(tmp_path, 1000, warmup=100, report=(100, 500))
    for step, s in sorted(samples.items()):
        print(
            f"soak step {step}: rss {s['rss'] / 2**20:.1f} MiB, fds {s['fds']}, threads "
            f"{s['threads']} (python {s['python_threads']}), swap {s['swap_bytes']} bytes, "
            f"gc objects {s['objects']}"
        )
    assert_flat(samples, warmup=100)
