"""Moves overlap compute: the next unit's parameters are read while this one runs, and the NVMe
update reads the next pieces while it updates this one. Each is checked twice: by the state of
the shards while the compute runs (deterministic), and by time against the serial sum with
disk latency and compute made large by the test (each fails when that read-ahead is off)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from engine_models import STACK_VOCAB, StackBlock, StackLM

import offload
from offload.api.wrap import engine_of
from offload.homes import optim as optim_mod
from offload.store import ShardState

LATENCY = 0.04  # seconds each disk read takes, added by the test
COMPUTE = 0.04  # seconds each unit's compute takes, added by the test


class SlowRead:
    """A disk read that completes ``LATENCY`` seconds after it was issued."""

    def __init__(self, handle) -> None:
        self.handle, self.at = handle, time.perf_counter() + LATENCY

    def done(self) -> bool:
        return time.perf_counter() >= self.at and self.handle.done()

    def wait(self):
        time.sleep(max(0.0, self.at - time.perf_counter()))
        return self.handle.wait()


def _slow_reads(store) -> None:
    real = store._nvme.read
    store._nvme.read = lambda key, buf, *a: SlowRead(real(key, buf, *a))


def _config(tmp_path, depth: int, opt_buffer: str = "64KiB") -> dict:
    """Each block is one piece of 16384 elements; the optimizer's pieces are ``opt_buffer``."""
    for d in ("p", "o"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    return {
        "device": "cpu",
        "offload_param": {
            "device": "nvme",
            "nvme_path": str(tmp_path / "p"),
            "buffer_count": 6,
            "buffer_size": "64KiB",
            "persistence_threshold": 0,
        },
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": str(tmp_path / "o"),
            "buffer_count": 12,
            "buffer_size": opt_buffer,
            "step_in_backward": False,  # the update after the backward, timed on its own
        },
        "wrap": {"module_classes": ["StackBlock", "TimedBlock"]},
        "prefetch": {"depth": depth},
    }


def _step(model, opt, tokens) -> None:
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, STACK_VOCAB), tokens[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad()


class TimedBlock(StackBlock):
    """Records, while its compute runs, whether the next unit's parameters are on their way."""

    seen: list = []
    probe = None
    delay = 0.0

    def forward(self, x):
        if TimedBlock.probe is not None:
            TimedBlock.seen.append(TimedBlock.probe(self))
        time.sleep(TimedBlock.delay)
        return super().forward(x)


@pytest.mark.parametrize("depth", [2, 0])
def test_the_next_unit_is_read_while_this_one_computes(tmp_path, depth):
    model, opt = offload.wrap(StackLM(n=6, block=TimedBlock), _config(tmp_path, depth))
    runtime = engine_of(model)
    store = runtime.stores["offload_param"]
    index = {run.unit.module: run.unit.index for run in runtime.runs}
    last = max(index.values())

    def next_unit_on_its_way(block) -> bool:
        k = index[block] + 1
        return k > last or store.state(f"param.u{k}.0") is not ShardState.NVME

    tokens = torch.randint(0, STACK_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    try:
        for _ in range(2):  # the first iteration records the trace
            _step(model, opt, tokens)
        opt.synchronize()
        TimedBlock.seen, TimedBlock.probe = [], next_unit_on_its_way
        with torch.no_grad():
            model(tokens[:, :-1])  # a forward of its own: no update in flight to confuse it
        TimedBlock.probe = None
        prefetched = sum(TimedBlock.seen[:-1])  # the last block has no next unit
        if depth:
            assert prefetched == len(TimedBlock.seen) - 1, TimedBlock.seen
        else:  # only what the update left cached: the check tells the two apart
            assert prefetched < len(TimedBlock.seen) - 1, TimedBlock.seen
    finally:
        TimedBlock.probe = None
        opt.close()


def _forward_disk_waits(tmp_path, depth: int) -> float:
    """Seconds the forward waited for disk reads: forwards with no update running through 7
    units and a pool of 4 buffers, every disk read ``LATENCY`` and every block's compute
    ``COMPUTE`` long, three of them once training recorded the trace."""
    cfg = _config(tmp_path, depth)
    cfg["offload_param"]["buffer_count"] = 4
    model, opt = offload.wrap(StackLM(n=6, block=TimedBlock), cfg)
    store = engine_of(model).stores["offload_param"]
    _slow_reads(store)
    tokens = torch.randint(0, STACK_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    try:
        for _ in range(2):
            _step(model, opt, tokens)
        opt.synchronize()
        before = store.stats()["tiers"]["nvme->host"]["wait_seconds"]
        TimedBlock.delay = COMPUTE
        with torch.no_grad():
            for _ in range(3):
                model(tokens[:, :-1])
        return store.stats()["tiers"]["nvme->host"]["wait_seconds"] - before
    finally:
        TimedBlock.delay = 0.0
        opt.close()


def test_reading_ahead_hides_the_disk_waits(tmp_path):
    """Against the same forwards without reads ahead, in the same run: while a block computes,
    the next blocks' reads complete, so the forward waits for the disk much less."""
    ahead = _forward_disk_waits(tmp_path / "ahead", depth=2)
    serial = _forward_disk_waits(tmp_path / "serial", depth=0)
    assert serial > 3 * LATENCY  # there are misses to hide without reads ahead
    assert ahead < 0.5 * serial, (ahead, serial)


def _update(tmp_path, monkeypatch, lookahead: int | None) -> tuple[list[bool], float]:
    """One NVMe update over 3 blocks in pieces of 4096 elements, every disk read ``LATENCY``
    and every piece's Adam ``COMPUTE`` long: for each piece, whether the next piece's reads
    were in flight while it was updated, and the seconds the update waited for the disk."""
    model, opt = offload.wrap(StackLM(n=3), _config(tmp_path, 2, opt_buffer="16KiB"))
    runtime = engine_of(model)
    store = runtime.stores["offload_optimizer"]
    order = [(u, lo) for u in runtime.plan.units for lo, _ in runtime.plan.trainable_pieces(u)]
    assert len(order) >= 4 and runtime.optim.lookahead >= 1
    if lookahead is not None:
        monkeypatch.setattr(runtime.optim, "lookahead", lookahead)
    seen: list[bool] = []
    real = optim_mod.adam_step

    def probe(master, grad, *args, **kwargs):
        j = len(seen)
        if j + 1 < len(order):
            unit, lo = order[j + 1]
            seen.append(store.state(f"master.u{unit.index}.{lo}") is not ShardState.NVME)
        time.sleep(COMPUTE)
        return real(master, grad, *args, **kwargs)

    tokens = torch.randint(0, STACK_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    try:
        _step(model, opt, tokens)
        opt.synchronize()
        store.flush()
        _slow_reads(store)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, STACK_VOCAB), tokens[:, 1:].reshape(-1)).backward()
        monkeypatch.setattr(optim_mod, "adam_step", probe)
        before = store.stats()["tiers"]["nvme->host"]["wait_seconds"]
        opt.step()
        opt.synchronize()
        waited = store.stats()["tiers"]["nvme->host"]["wait_seconds"] - before
        monkeypatch.setattr(optim_mod, "adam_step", real)
        assert len(seen) == len(order) - 1
        return seen, waited
    finally:
        opt.close()


def test_the_update_reads_ahead_of_the_piece_it_updates(tmp_path, monkeypatch):
    seen, waited = _update(tmp_path / "ahead", monkeypatch, None)
    # the next piece's reads were in flight during this update (for nearly every piece: a read
    # ahead waits for a free buffer, and a loaded machine can keep write-backs holding them)
    assert sum(seen) >= 0.75 * len(seen), seen
    seen_off, waited_off = _update(tmp_path / "off", monkeypatch, 0)
    assert not any(seen_off), seen_off  # the check tells the two apart
    assert waited_off > 3 * LATENCY
    assert waited < 0.5 * waited_off, (waited, waited_off)
