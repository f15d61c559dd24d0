"""The access trace: record, replay with lookahead, quiet re-record; steady-state hit rate."""

from __future__ import annotations

import logging

import pytest
import torch

from offload.io import AsyncIO, BufferPool, NvmeStore
from offload.store import Tier, TieredStore
from offload.store.prefetch import TracePrefetcher


def test_first_iteration_records_then_replays_with_lookahead():
    p = TracePrefetcher(depth=2)
    p.begin_iteration()
    assert [p.use(x) for x in "abcd"] == [[], [], [], []]  # recording: no lookahead yet
    assert p.end_iteration() == ["a", "b"]  # head of the next iteration
    assert p.trace == tuple("abcd")
    p.begin_iteration()
    assert p.use("a") == ["b", "c"]
    assert p.use("b") == ["c", "d"]
    assert p.use("c") == ["d", "a"]  # wraps into the next iteration
    assert p.use("d") == ["a", "b"]
    p.end_iteration()
    assert p.rerecords == 0


def test_distance_counts_from_the_current_access():
    p = TracePrefetcher(depth=1)
    for x in "abc":
        p.use(x)
    p.end_iteration()
    p.begin_iteration()
    assert p.distance("a") == 0  # before any use: position 0
    p.use("a")
    assert p.distance("a") == 0  # the access just recorded is the nearest
    assert p.distance("b") == 1
    assert p.distance("zz") == float("inf")


def test_order_change_rerecords_quietly(caplog):
    p = TracePrefetcher(depth=1)
    for x in "abc":
        p.use(x)
    p.end_iteration()
    caplog.set_level(logging.DEBUG, logger="offload.store.prefetch")
    p.begin_iteration()
    assert p.use("a") == ["b"]
    assert p.use("c") == []  # diverged: stop replaying
    assert not p.replaying and p.distance("a") is None
    p.use("b")
    p.end_iteration()
    assert p.rerecords == 1
    assert p.trace == ("a", "c", "b")
    assert all(r.levelno == logging.DEBUG for r in caplog.records)
    # same order again: nothing changes
    p.begin_iteration()
    for x in "acb":
        p.use(x)
    p.end_iteration()
    assert p.rerecords == 1


def test_shorter_iteration_is_a_change_and_empty_one_is_not():
    p = TracePrefetcher(depth=1)
    for x in "abc":
        p.use(x)
    p.end_iteration()
    p.begin_iteration()
    p.end_iteration()  # no uses at all: keep the trace
    assert p.trace == tuple("abc") and p.rerecords == 0
    p.begin_iteration()
    p.use("a")
    p.use("b")
    p.end_iteration()
    assert p.trace == ("a", "b") and p.rerecords == 1


def test_depth_is_validated():
    with pytest.raises(ValueError, match="prefetch depth"):
        TracePrefetcher(depth=-1)


def _run_iterations(store: TieredStore, order: list[tuple[str, Tier]], iterations: int) -> list:
    """Engine-like loop: use, fetch, wait, release; returns (hits, misses) per iteration."""
    per_iteration = []
    for _ in range(iterations):
        before = store.stats()
        store.begin_iteration()
        for key, tier in order:
            store.use(key, tier)
            tensor = store.fetch(key, tier).wait()
            assert tensor.numel() > 0
            store.release(key, tier)
        store.end_iteration()
        after = store.stats()
        per_iteration.append(
            (
                after["prefetch_hits"] - before["prefetch_hits"],
                after["prefetch_misses"] - before["prefetch_misses"],
            )
        )
    return per_iteration


def _nvme_store(tmp_path, buffers, depth, numel=1023, dtype=torch.float32):
    aio = AsyncIO(block_size=1 << 16, queue_depth=4, thread_count=2)
    pool = BufferPool(buffers, ((numel * dtype.itemsize + 4095) // 4096) * 4096, timeout=1.0)
    nvme = NvmeStore(tmp_path, aio=aio)
    store = TieredStore(pool=pool, nvme=nvme, prefetch_depth=depth)
    return store, (nvme, pool, aio)


def _close(store, parts):
    store.close()
    for part in parts:
        part.close()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_steady_state_hit_rate_is_100_percent(tmp_path, depth):
    """NVMe-homed shards cached in host memory through a budget of depth + 1 buffers."""
    store, parts = _nvme_store(tmp_path, depth + 1, depth)
    order = [(f"u{i}", Tier.HOST) for i in range(7)]
    for key, _ in order:
        store.register(key, 1023, torch.float32, Tier.NVME)
    result = _run_iterations(store, order, iterations=4)
    assert result[0] == (0, 0)  # recording: nothing counted
    for hits, misses in result[1:]:
        assert (hits, misses) == (len(order), 0)
    assert store.stats()["peak_host_buffers"] <= depth + 1
    _close(store, parts)


def test_order_change_is_counted_and_replay_recovers(tmp_path):
    store, parts = _nvme_store(tmp_path, 3, 2, numel=7, dtype=torch.float16)
    keys = [f"k{i}" for i in range(5)]
    for key in keys:
        store.register(key, 7, torch.float16, Tier.NVME)
    order = [(k, Tier.HOST) for k in keys]
    _run_iterations(store, order, iterations=2)
    changed = list(reversed(order))
    _run_iterations(store, changed, iterations=1)
    assert store.stats()["rerecords"] == 1
    result = _run_iterations(store, changed, iterations=2)
    assert result[-1] == (len(order), 0)
    assert store.stats()["rerecords"] == 1
    _close(store, parts)


def test_prefetch_never_displaces_a_copy_needed_sooner(tmp_path):
    """Host budget of 2 buffers, depth 3, trace a b c d: the window does not fit, so the
    prefetcher must keep a and b (needed first) instead of trading them for c and d."""
    store, parts = _nvme_store(tmp_path, 2, 3, numel=1024)
    order = [(k, Tier.HOST) for k in "abcd"]
    for key, _ in order:
        store.register(key, 1024, torch.float32, Tier.NVME)
    _run_iterations(store, order, iterations=1)  # record; head prefetch brings a and b
    store.flush()
    assert [store.state(k).name for k in "abcd"] == ["HOST", "HOST", "NVME", "NVME"]
    store.begin_iteration()
    store.use("a", Tier.HOST)  # window b, c, d: nothing may evict a or b
    assert store.state("a").name == "HOST" and store.state("b").name == "HOST"
    assert store.stats()["prefetches_deferred"] >= 1
    _close(store, parts)
