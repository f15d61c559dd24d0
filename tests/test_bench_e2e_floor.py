"""``benchmarks/bench_e2e.py``'s clipping floor (``clip_floor``): the window from the global norm
to the next forward's end carries every state byte that host memory cannot hold."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_e2e  # noqa: E402

N = 1_000_000  # parameters: 16 MB read and 12 MB written in the window with nothing held


def test_with_nothing_held_the_window_reads_16_and_writes_12_bytes_a_parameter():
    floor, window = bench_e2e.clip_floor(1.0, 0.001, N, held=0, rd_bw=2e9, wr_bw=1e9)
    assert window == pytest.approx(16e6 / 2e9 + 12e6 / 1e9)
    assert floor == pytest.approx(1.0 - 0.001 + window)


def test_memory_that_holds_the_writes_leaves_only_reads():
    _, window = bench_e2e.clip_floor(1.0, 0.001, N, held=13e6, rd_bw=1e9, wr_bw=1e9)
    assert window == pytest.approx(3e6 / 1e9)


def test_a_forward_longer_than_the_window_hides_it():
    floor, window = bench_e2e.clip_floor(1.0, 0.5, N, held=0, rd_bw=1e9, wr_bw=1e9)
    assert window == pytest.approx(0.028)
    assert floor == pytest.approx(1.0)


def test_less_memory_never_lowers_the_floor():
    floors = [
        bench_e2e.clip_floor(1.0, 0.002, N, held=h, rd_bw=1e9, wr_bw=1e9)[0]
        for h in (0, 4e6, 12e6, 16e6, 20e6)
    ]
    assert floors == sorted(floors, reverse=True)
    assert floors[0] > floors[-1] == pytest.approx(1.0)
