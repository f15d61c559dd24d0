"""``benchmarks/nvme_phases.py --hook-functions``: every function it names still exists where it
says (a rename fails here, not in someone's diagnostic run), only the training thread's calls
are counted, and the originals come back."""

from __future__ import annotations

import importlib
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import nvme_phases  # noqa: E402

from offload.io import AsyncIO  # noqa: E402


def _originals():
    return [
        getattr(importlib.import_module(m), c).__dict__[f] for m, c, f in nvme_phases.HOOK_FUNCTIONS
    ]


def test_hook_functions_count_the_training_thread_and_restore(tmp_path):
    before = _originals()
    functions = nvme_phases.HookFunctions()
    try:
        assert all(now is not was for now, was in zip(_originals(), before, strict=True))
        buf = torch.arange(1024, dtype=torch.float32)
        with AsyncIO() as io:
            io.write(buf, tmp_path / "f").wait()
            functions.clear()
            io.read(torch.empty_like(buf), tmp_path / "f").wait()
            other = threading.Thread(
                target=lambda: io.read(torch.empty_like(buf), tmp_path / "f").wait()
            )
            other.start()
            other.join()
        assert functions.calls == {"AsyncIO.read": 1, "IOHandle.wait": 1}
        assert functions.seconds["AsyncIO.read"] > 0
    finally:
        functions.restore()
    assert all(now is was for now, was in zip(_originals(), before, strict=True))
