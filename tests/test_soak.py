"""Soak: a long run with params and optimizer state on NVMe leaks nothing (issue 13, part 5).

After a warm-up the training process's open file descriptors, OS threads, swap-file bytes on
disk and GC-tracked Python objects stay exactly flat, and its RSS (after giving freed heap back
to the OS) within a small allowance: allocator noise, not a per-step growth. The run is a fresh
process (``_soak_worker.py``) so other tests cannot move its figures. The default suite runs
150 steps; the slow one runs 1,000 and prints the figures at steps 100, 500 and 1,000.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from children import ROOT

WORKER = Path(__file__).resolve().parent / "_soak_worker.py"
RSS_ALLOWANCE = 4 << 20  # bytes of RSS growth tolerated after warm-up (allocator noise)
OBJECT_ALLOWANCE = 64  # GC-tracked objects tolerated after warm-up (caches of lazy imports)
# under AddressSanitizer (tests/test_sanitizers.py) freed memory waits in its quarantine, so RSS
# grows by design there; the other figures still must stay flat
ASAN = "libasan" in os.environ.get("LD_PRELOAD", "")


def soak(tmp_path, steps: int, *report: int) -> dict[int, dict]:
    """Runs the worker; returns step -> figures for each step in ``report`` and the last."""
    out = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), str(steps), *map(str, report)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=str(tmp_path),
        timeout=1800,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    samples = [json.loads(line) for line in out.stdout.splitlines()]
    return {s.pop("step"): s for s in samples}


def assert_flat(samples: dict[int, dict], warmup: int) -> None:
    first, last = samples[warmup], samples[max(samples)]
    for key in ("fds", "threads", "python_threads", "swap_bytes"):
        assert last[key] == first[key], f"{key}: {first[key]} after warm-up, {last[key]} at end"
    assert last["swap_bytes"] > 0
    assert last["objects"] - first["objects"] <= OBJECT_ALLOWANCE, (first, last)
    assert ASAN or last["rss"] - first["rss"] <= RSS_ALLOWANCE, (first, last)


@pytest.mark.heavy
def test_soak_150_steps(tmp_path):
    assert_flat(soak(tmp_path, 150, 50), warmup=50)


@pytest.mark.slow
def test_soak_1000_steps(tmp_path):
    samples = soak(tmp_path, 1000, 100, 500)
    for step, s in sorted(samples.items()):
        print(
            f"soak step {step}: rss {s['rss'] / 2**20:.1f} MiB, fds {s['fds']}, threads "
            f"{s['threads']} (python {s['python_threads']}), swap {s['swap_bytes']} bytes, "
            f"gc objects {s['objects']}"
        )
    assert_flat(samples, warmup=100)
