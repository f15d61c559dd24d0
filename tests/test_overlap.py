"""Moves overlap compute: the next unit's parameters are read while this one runs, and the NVMe
update reads the next pieces while it updates this one. Each is checked twice: by the state of
the shards while the compute runs (deterministic), and by time against the serial sum with
disk latency and compute made large by the test (each fails when that read-ahead is off)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.nn.functional as F
from engine_models import STACK_VOCAB, StackBlock, StackLM

import offload
from offload.api.wrap import engine_of
from offload.config import OffloadConfig
from offload.homes import grads as grads_mod
from offload.homes.params import NvmeParams
from offload.plan.placement import make_placement
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


def _backward(model, tokens) -> None:
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, STACK_VOCAB), tokens[:, 1:].reshape(-1)).backward()


def _step(model, opt, tokens) -> None:
    _backward(model, tokens)
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


def _probed_forward(model, opt, probe) -> list:
    """Two steps (the first records the trace), then a forward of its own (no update in flight
    to confuse it) with ``probe(block)`` called as each block computes; its results."""
    tokens = torch.randint(0, STACK_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        _step(model, opt, tokens)
    opt.synchronize()
    TimedBlock.seen, TimedBlock.probe = [], probe
    try:
        with torch.no_grad():
            model(tokens[:, :-1])
    finally:
        TimedBlock.probe = None
    return TimedBlock.seen


@pytest.mark.parametrize("depth", [2, 0])
def test_the_next_unit_is_read_while_this_one_computes(tmp_path, depth):
    # more blocks than the param pool holds (its 6 buffers and the one its gathers lend), so
    # without reads ahead the update cannot have left every next unit cached
    model, opt = offload.wrap(StackLM(n=8, block=TimedBlock), _config(tmp_path, depth))
    runtime = engine_of(model)
    store = runtime.stores["offload_param"]
    index = {run.unit.module: run.unit.index for run in runtime.runs}
    last = max(index.values())

    def next_unit_on_its_way(block) -> bool:
        k = index[block] + 1
        return k > last or store.state(f"param.u{k}.0") is not ShardState.NVME

    try:
        seen = _probed_forward(model, opt, next_unit_on_its_way)
        prefetched = sum(seen[:-1])  # the last block has no next unit
        if depth:
            assert prefetched == len(seen) - 1, seen
        else:  # only what the update left cached: the check tells the two apart
            assert prefetched < len(seen) - 1, seen
    finally:
        opt.close()


def test_the_depth_counts_units_whatever_their_pieces(tmp_path):
    """With buffers a quarter of a block, one unit ahead is all of the next unit's pieces on
    their way while this one computes (counting pieces, depth 1 read one of them)."""
    cfg = _config(tmp_path, 1)
    cfg["offload_param"].update(buffer_count=16, buffer_size="8KiB")
    model, opt = offload.wrap(StackLM(n=6, block=TimedBlock), cfg)
    runtime = engine_of(model)
    store = runtime.stores["offload_param"]
    units = {run.unit.module: run.unit for run in runtime.runs}
    following = {u.index: n for u, n in zip(runtime.plan.units, runtime.plan.units[1:])}
    keys = {
        u.index: [NvmeParams.key(u, lo) for lo, _ in runtime.plan.pieces(u)]
        for u in runtime.plan.units
    }
    blocks = [u for m, u in units.items() if isinstance(m, TimedBlock)]
    assert all(len(keys[u.index]) >= 3 for u in blocks)  # a block is pieces, not one

    def next_unit_on_its_way(block) -> list[bool]:
        nxt = following.get(units[block].index)
        return [store.state(k) is not ShardState.NVME for k in keys[nxt.index]] if nxt else []

    try:
        seen = _probed_forward(model, opt, next_unit_on_its_way)
        assert len(seen) == 6
        assert all(all(pieces) for pieces in seen), seen
    finally:
        opt.close()


@pytest.mark.parametrize(("count", "warned"), [(6, True), (8, False)])
def test_a_pool_that_cannot_read_the_next_unit_is_named(tmp_path, caplog, count, warned):
    """bench_e2e's split: 8 MiB buffers, a 19 MiB unit (3 pieces) and an update holding 2."""
    cfg = OffloadConfig.from_dict({**_config(tmp_path, 2), "dtype": "fp32"})  # params: master
    cfg.offload_param.buffer_count = count
    cfg.offload_param.buffer_size = 8 * 2**20
    cfg.offload_optimizer.buffer_count = 16
    cfg.offload_optimizer.buffer_size = 8 * 2**20
    cfg.offload_optimizer.step_in_backward = True
    with caplog.at_level(logging.WARNING, logger="offload.plan"):
        pl = make_placement(cfg, torch.device("cpu"), largest_unit=19 * 2**18)
    assert pl.stores["offload_param"] == 2 * 3  # two units of three pieces ahead
    said = [r.getMessage() for r in caplog.records if r.name == "offload.plan"]
    if warned:
        assert len(said) == 1, said
        assert "offload_param.buffer_count=6" in said[0] and "prefetch.depth=2" in said[0]
        assert "use offload_param.buffer_count >= 8" in said[0]
    else:
        assert said == []


def test_the_gathers_reads_go_ahead_of_the_updates_io(tmp_path):
    """Both stores share one IO engine; the param store's reads (a gather waits on them) are
    the urgent ones, the update's reads and every write queue behind them (the engine's order
    is tested in test_aio)."""
    model, opt = offload.wrap(StackLM(n=2, block=TimedBlock), _config(tmp_path, 2))
    stores = engine_of(model).stores
    try:
        params, optim = stores["offload_param"]._nvme, stores["offload_optimizer"]._nvme
        assert params._aio is optim._aio
        assert params.urgent_reads and not optim.urgent_reads
        seen = []  # (the param store's, urgent) of every read
        real = params._aio.read

        def read(tensor, path, *a, **k):
            seen.append((str(path).startswith(params.directory), k.get("urgent", False)))
            return real(tensor, path, *a, **k)

        params._aio.read = read
        tokens = torch.randint(0, STACK_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            _step(model, opt, tokens)
        opt.synchronize()
        assert {False, True} <= {mine for mine, _ in seen}  # both stores read
        assert all(mine == urgent for mine, urgent in seen), seen
    finally:
        opt.close()


def _accumulating(tmp_path):
    """Accumulation 2 with the step in backward over 4 blocks, 12 optimizer buffers of 16 KiB
    (4 grad pieces a block): the model, its optimizer, the runtime, the gradients' owner and
    the optimizer store."""
    cfg = _config(tmp_path, 2, opt_buffer="16KiB")
    cfg["gradient_accumulation_steps"] = 2
    cfg["offload_optimizer"]["step_in_backward"] = True
    model, opt = offload.wrap(StackLM(n=4, block=TimedBlock), cfg)
    runtime = engine_of(model)
    return model, opt, runtime, runtime.grads.owner, runtime.stores["offload_optimizer"]


def _train_accumulating(model, opt, steps: int, after_step=lambda: None) -> None:
    """``steps`` optimizer steps of two backwards each, then the optimizer closed."""
    gen = torch.Generator().manual_seed(0)
    try:
        for _ in range(steps):
            for _ in range(2):
                _backward(model, torch.randint(0, STACK_VOCAB, (2, 9), generator=gen))
            opt.step()
            opt.zero_grad()
            after_step()
        opt.synchronize()
    finally:
        opt.close()


def _second_backward_pieces(tmp_path, monkeypatch, hint: bool) -> list[bool]:
    """Steps 2 and 3 of :func:`_accumulating`'s training: per piece the second backward adds
    to, whether it was on its way or in memory as its unit's backward ended (``hint``: with
    the owner's ``expect``)."""
    model, opt, runtime, owner, store = _accumulating(tmp_path)
    if not hint:
        monkeypatch.setattr(owner, "expect", lambda unit, first: None)
    seen: list[bool] = []
    real = owner.absorb
    steps = [0]  # steps done

    def absorb(unit, parts, first):
        if not first and not unit.is_root and steps[0] > 0:
            for lo, _ in runtime.plan.trainable_pieces(unit):
                seen.append(store.state(owner.key(unit, lo)) is not ShardState.NVME)
        return real(unit, parts, first)

    monkeypatch.setattr(owner, "absorb", absorb)
    try:
        _train_accumulating(model, opt, 3, after_step=lambda: steps.__setitem__(0, steps[0] + 1))
    finally:
        monkeypatch.undo()
    assert len(seen) == 2 * 4 * 4  # two steps, four blocks of four pieces
    return seen


def test_the_earlier_micro_steps_gradients_are_asked_for_before_the_unit_adds_to_them(
    tmp_path, monkeypatch
):
    """Accumulation 2 with the step in backward: in the last backward, before each block adds
    its gradients to the sum the earlier one left on NVMe, the owner's ``expect`` has asked the
    store to read ahead exactly that block's pieces; in the first backward, which overwrites,
    it asks for nothing. (The root's gradients are final only when the backward ends, and are
    read then: no hint holds its sum through the whole backward.)"""
    model, opt, runtime, owner, store = _accumulating(tmp_path)
    asked: list[str] = []
    misses: list[tuple] = []
    real_read_ahead, real_absorb = store.read_ahead, owner.absorb

    def read_ahead(keys, *args, **kwargs):
        keys = list(keys)
        asked.extend(k for k in keys if k.startswith("grad."))
        return real_read_ahead(keys, *args, **kwargs)

    def absorb(unit, parts, first):
        want = (
            [] if first else [owner.key(unit, lo) for lo, _ in runtime.plan.trainable_pieces(unit)]
        )
        if not unit.is_root and asked != want:
            misses.append((unit.label, first, list(asked), want))
        asked.clear()
        return real_absorb(unit, parts, first)

    monkeypatch.setattr(store, "read_ahead", read_ahead)
    monkeypatch.setattr(owner, "absorb", absorb)
    _train_accumulating(model, opt, 2)
    assert not misses, misses


@pytest.mark.slow
def test_the_earlier_micro_steps_gradients_are_read_while_the_unit_runs_backward(
    tmp_path, monkeypatch
):
    """What the hint buys: the last backward finds more of the sum's pieces in memory or on
    their way. Without it only the pieces the first backward wrote last are still in memory. A
    prefetch takes only buffers the update is not holding, so it is timing: on a loaded machine
    one run's counts of 32 were 3-13 without the hint and 9-25 with it (unloaded, 10-15 and
    21-31). Three runs each, interleaved so that load falls on both alike; their totals."""
    hinted, plain = [], []
    for k in range(3):
        hinted += _second_backward_pieces(tmp_path / f"hint{k}", monkeypatch, hint=True)
        plain += _second_backward_pieces(tmp_path / f"plain{k}", monkeypatch, hint=False)
    assert sum(plain) <= len(plain) // 2, plain
    assert sum(hinted) >= sum(plain) + len(hinted) // 8, (sum(hinted), sum(plain))


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


@pytest.mark.heavy  # (the update's reads ahead stay in the default suite)
def test_reading_ahead_hides_the_disk_waits(tmp_path):
    """Against the same forwards without reads ahead, in the same run: while a block computes,
    the next blocks' reads complete, so the forward waits for the disk much less."""
    ahead = _forward_disk_waits(tmp_path / "ahead", depth=2)
    serial = _forward_disk_waits(tmp_path / "serial", depth=0)
    assert serial > 3 * LATENCY  # there are misses to hide without reads ahead
    assert ahead < 0.5 * serial, (ahead, serial)


def _update(tmp_path, monkeypatch, lookahead: int | None, dtype: str = "bf16"):
    """One NVMe update over 3 blocks in pieces of 4096 elements, every disk read ``LATENCY``
    and every piece's Adam ``COMPUTE`` long: for each piece, whether the next piece's master
    (its own shard in bf16; in fp32 the params, which are the master) was read or on its way
    while it was updated, and the seconds the update waited for the disk."""
    # no trace prefetch: the update's own reads ahead are what is looked at
    cfg = {**_config(tmp_path, 0, opt_buffer="16KiB"), "dtype": dtype}
    model, opt = offload.wrap(StackLM(n=3), cfg)
    runtime = engine_of(model)
    stores = [runtime.stores["offload_optimizer"], runtime.stores["offload_param"]]
    order = [(u, lo) for u in runtime.plan.units for lo, _ in runtime.plan.trainable_pieces(u)]
    assert len(order) >= 4 and runtime.optim.lookahead >= 1
    if dtype == "fp32":
        assert runtime.optim.param_ahead >= 1

        def master(unit, lo):
            return stores[1], f"param.u{unit.index}.{lo}"
    else:

        def master(unit, lo):
            return stores[0], f"master.u{unit.index}.{lo}"

    if lookahead is not None:
        monkeypatch.setattr(runtime.optim, "lookahead", lookahead)
        monkeypatch.setattr(runtime.optim, "param_ahead", lookahead)
    seen: list[bool] = []
    real = grads_mod.adam_step  # (what the NVMe update calls, through adam_runs)

    def probe(master_values, grad, *args, **kwargs):
        j = len(seen)
        if j + 1 < len(order):
            store, key = master(*order[j + 1])
            seen.append(store.state(key) is not ShardState.NVME)
        time.sleep(COMPUTE)
        return real(master_values, grad, *args, **kwargs)

    def waits() -> float:
        return sum(s.stats()["tiers"]["nvme->host"]["wait_seconds"] for s in stores)

    tokens = torch.randint(0, STACK_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    try:
        _step(model, opt, tokens)
        opt.synchronize()
        for store in stores:
            store.flush()
            _slow_reads(store)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, STACK_VOCAB), tokens[:, 1:].reshape(-1)).backward()
        for store in stores:  # what the backward left cached is not the update's to find
            store.flush()
            for key in list(store._room.cached):
                if not store._shards[key].pinned():
                    store._drop_copies(store._shards[key])
        monkeypatch.setattr(grads_mod, "adam_step", probe)
        before = waits()
        opt.step()
        opt.synchronize()
        waited = waits() - before
        monkeypatch.setattr(grads_mod, "adam_step", real)
        assert len(seen) == len(order) - 1
        return seen, waited
    finally:
        opt.close()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_update_reads_ahead_of_the_piece_it_updates(tmp_path, monkeypatch, dtype):
    """The next piece's reads are in flight while a piece is updated, and the update waits
    for the disk less than half as long as without reading ahead. The waits include the real
    disk's, which the machine shares: in 2 of about 10 full-suite runs on the 2-core machine
    (2026-12-01 and -02; never alone) a run reading ahead waited longer than one without (1.23
    s against 0.56 s in the second). So the waits are compared in up to three rounds, each against a
    run without reading ahead made right after it; an update that does not read ahead fails
    every round (its waits are those of the run without)."""
    rounds = []
    for r in range(3):
        seen, waited = _update(tmp_path / f"ahead{r}", monkeypatch, None, dtype)
        # the next piece's reads were in flight during this update (for nearly every piece: a
        # read ahead waits for a free buffer, and a loaded machine can keep write-backs
        # holding them)
        assert sum(seen) >= 0.75 * len(seen), seen
        seen_off, waited_off = _update(tmp_path / f"off{r}", monkeypatch, 0, dtype)
        assert not any(seen_off), seen_off  # the check tells the two apart
        assert waited_off > 3 * LATENCY
        rounds.append((waited, waited_off))
        if waited < 0.5 * waited_off:
            return
    raise AssertionError(f"the update waited as long reading ahead as without: {rounds}")


@pytest.mark.parametrize("step_in_backward", [False, True])
@pytest.mark.parametrize("param_buffers", [1, 2, 3, 6])
def test_the_update_and_the_gathers_share_the_param_pool(
    tmp_path, monkeypatch, param_buffers, step_in_backward
):
    """With fp32 params on NVMe as the master, the update holds param pieces while the next
    forward's (or this backward's) gathers hold theirs: it never holds more than its share,
    and the two shares fit in the pool (with one buffer, each holds one at a time)."""
    cfg = _config(tmp_path, 2, opt_buffer="16KiB")
    cfg["dtype"] = "fp32"
    cfg["offload_param"]["buffer_count"] = param_buffers
    cfg["offload_optimizer"].update(buffer_count=16, step_in_backward=step_in_backward)
    model, opt = offload.wrap(StackLM(n=3), cfg)
    runtime = engine_of(model)
    pl = runtime.plan.placement
    share = pl.param_ahead + 1
    assert pl.param_window + share <= param_buffers or (pl.param_window, share) == (1, 1)
    params = runtime.params
    held, most = set(), [0]
    real = {name: getattr(params, name) for name in ("master_piece", "commit", "give_up_out")}

    def master_piece(unit, lo, hi):
        held.add((unit.index, lo))
        most[0] = max(most[0], len(held))
        return real["master_piece"](unit, lo, hi)

    def letting_go(name):
        def call(unit, lo, hi):
            held.discard((unit.index, lo))
            return real[name](unit, lo, hi)

        return call

    monkeypatch.setattr(params, "master_piece", master_piece)
    monkeypatch.setattr(params, "commit", letting_go("commit"))
    monkeypatch.setattr(params, "give_up_out", letting_go("give_up_out"))
    tokens = torch.randint(0, STACK_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    try:
        for _ in range(3):
            _step(model, opt, tokens)
        opt.synchronize()
    finally:
        opt.close()
    assert most[0] == share, (most[0], share)  # reached, never passed
