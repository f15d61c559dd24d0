"""Property tests: random register/use/fetch/modify/release sequences under tight budgets.

Invariants checked after every operation: every byte read back equals the reference model
(NVMe reads are also CRC-checked by the NvmeStore), the store's own accounting and the pool's
handed-out buffers stay within the budgets, and nothing blocks: the pool timeout is short, so a
fetch that could not get a buffer would raise instead of passing, and a watchdog kills a hang.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload import _native
from offload.io import AsyncIO, BufferPool, NvmeStore
from offload.store import Tier, TieredStore

BUFFER = 4096
OPS = ("use", "fetch", "modify", "release", "iteration", "flush", "read_into", "write_from")
# weighted: mostly the fetch / modify / release cycle that moves bytes between tiers
WEIGHTED_OPS = ("use",) * 3 + ("fetch",) * 4 + ("modify",) * 2 + ("release",) * 4 + OPS[4:]

shard_specs = st.lists(
    st.tuples(
        st.integers(1, 1024),  # numel (fp32: up to one 4096-byte buffer)
        st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
        st.sampled_from([Tier.NVME, Tier.NVME, Tier.HOST]),
    ),
    min_size=1,
    max_size=5,
)
op_lists = st.lists(
    st.tuples(st.sampled_from(WEIGHTED_OPS), st.integers(0, 99), st.integers(0, 99), st.booleans()),
    max_size=60,
)


def _fill(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    # small integers are exact in fp16/bf16, so comparisons are bitwise
    return (torch.arange(numel) * 7 + seed * 13) % 61 - 30.0


class Harness:
    """A store under test plus the reference contents and the currently fetched shards."""

    def __init__(self, tmp, specs, depth, max_pins, backend) -> None:
        self.max_pins = max_pins
        self.aio = AsyncIO(block_size=BUFFER, queue_depth=4, thread_count=2)
        self.pool = BufferPool(max_pins + depth, BUFFER, timeout=2.0)
        self.nvme = NvmeStore(tmp, aio=self.aio, checksum=True)
        self.store = TieredStore(
            pool=self.pool,
            nvme=self.nvme,
            prefetch_depth=depth,
            name="offload_param",
        )
        self.keys: list[str] = []
        self.ref: dict[str, torch.Tensor] = {}
        self.meta: dict[str, tuple[int, torch.dtype, Tier]] = {}
        for i, (numel, dtype, home) in enumerate(specs):
            key = f"s{i}"
            init = _fill(numel, dtype, i).to(dtype)
            self.store.register(key, numel, dtype, home, init=init)
            self.keys.append(key)
            self.ref[key] = init.clone()
            self.meta[key] = (numel, dtype, home)
        self.held: list[tuple[str, Tier, torch.Tensor, bool]] = []  # key, tier, tensor, modified

    def tiers_for(self, key: str) -> list[Tier]:
        return [Tier.HOST]  # shards are fetched into host memory whatever their home

    def apply(self, op: str, a: int, b: int, flag: bool) -> None:
        store = self.store
        key = self.keys[a % len(self.keys)]
        tiers = self.tiers_for(key)
        tier = tiers[b % len(tiers)]
        if op == "use":
            store.use(key, tier)
        elif op == "fetch":
            if len(self.held) >= self.max_pins or any(h[0] == key for h in self.held):
                return
            read = not (flag and b % 3 == 0)
            tensor = store.fetch(key, tier, read=read).wait()
            numel, dtype, _ = self.meta[key]
            assert tensor.numel() == numel and tensor.dtype == dtype
            if read:
                assert torch.equal(tensor.cpu(), self.ref[key]), (key, tier)
            else:  # the caller promised to overwrite all of it
                tensor.copy_(_fill(numel, dtype, b).to(dtype))
                self.ref[key] = tensor.cpu().clone()
            self.held.append((key, tier, tensor, not read))
        elif op == "modify" and self.held:
            key, tier, tensor, _ = self.held[a % len(self.held)]
            tensor.add_(b % 5 + 1)
            self.ref[key] = tensor.cpu().clone()
            index = [h[0] for h in self.held].index(key)
            self.held[index] = (key, tier, tensor, True)
        elif op == "release" and self.held:
            key, tier, _, modified = self.held.pop(a % len(self.held))
            store.release(key, tier, dirty=modified or flag)
        elif op == "iteration":
            store.end_iteration()
            store.begin_iteration()
        elif op == "flush":
            store.flush()
        elif op == "read_into":
            out = torch.empty(self.meta[key][0], dtype=self.meta[key][1])
            if any(h[0] == key for h in self.held):
                return
            store.read_into(key, out)
            assert torch.equal(out, self.ref[key]), key
        elif op == "write_from":
            if any(h[0] == key for h in self.held):
                return
            numel, dtype, _ = self.meta[key]
            src = _fill(numel, dtype, b + 100).to(dtype)
            store.write_from(key, src)
            self.ref[key] = src.clone()

    def check_budgets(self) -> None:
        s = self.store.stats()
        handed_out = self.pool.buffer_count - self.pool.free_count
        assert s["host_buffers_in_use"] == handed_out <= self.pool.buffer_count
        assert s["peak_host_buffers"] <= self.pool.buffer_count

    def finish(self) -> None:
        for key, tier, _, modified in self.held:
            self.store.release(key, tier, dirty=modified)
        self.held.clear()
        self.store.flush()
        for key in self.keys:  # every write-back reached the NVMe home itself
            numel, dtype, home = self.meta[key]
            if home is Tier.NVME:
                raw = torch.empty(self.store._shards[key].io_nbytes, dtype=torch.uint8)
                self.nvme.read(key, raw).wait()
                assert torch.equal(raw[: numel * dtype.itemsize].view(dtype), self.ref[key]), key
        for key in self.keys:  # nothing lost, nothing corrupted
            numel, dtype, _ = self.meta[key]
            out = torch.empty(numel, dtype=dtype)
            self.store.read_into(key, out)
            assert torch.equal(out, self.ref[key]), key
        self.store.close()
        assert self.pool.free_count == self.pool.buffer_count
        self.nvme.close()
        self.pool.close()
        self.aio.close()


@pytest.fixture(params=["native", "fallback"])
def backend(request):
    if request.param == "native":
        mod = _native.get() if _native.available() else None
        if mod is None or not hasattr(mod, "AioEngine"):
            pytest.skip("native AioEngine not built")
        yield "native"
    else:
        with _native.force_fallback():
            yield "fallback"


def _run(tmp_path_factory, specs, ops, depth, max_pins, backend) -> None:
    harness = Harness(tmp_path_factory.mktemp("nv"), specs, depth, max_pins, backend)
    harness.store.begin_iteration()
    for op in ops:
        harness.apply(*op)
        harness.check_budgets()
    harness.finish()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(specs=shard_specs, ops=op_lists, depth=st.integers(0, 2))
def test_random_sequences_one_shard_plus_prefetch(
    tmp_path_factory, backend, watchdog, specs, ops, depth
):
    """Budget = exactly one shard + prefetch depth, one fetch outstanding at a time."""
    _run(tmp_path_factory, specs, ops, depth, 1, backend)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(specs=shard_specs, ops=op_lists, depth=st.integers(0, 2), max_pins=st.integers(2, 3))
def test_random_sequences_several_fetches_outstanding(
    tmp_path_factory, watchdog, specs, ops, depth, max_pins
):
    _run(tmp_path_factory, specs, ops, depth, max_pins, "native-or-fallback")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(order=st.permutations(list(range(6))), depth=st.integers(1, 3))
def test_repeated_trace_through_one_shard_plus_prefetch_hits_every_time(
    tmp_path_factory, order, depth
):
    """NVMe-homed shards, host pool of 1 + depth buffers: from the second replay on every use
    finds its shard resident or in flight, and data stays intact."""
    harness = Harness(
        tmp_path_factory.mktemp("nv"),
        [(1000, torch.float32, Tier.NVME)] * 6,
        depth,
        1,
        "default",
    )
    store = harness.store
    for iteration in range(4):
        before = store.stats()
        store.begin_iteration()
        for i in order:
            key = f"s{i}"
            tier = Tier.HOST
            store.use(key, tier)
            assert torch.equal(store.fetch(key, tier).wait(), harness.ref[key])
            store.release(key, tier)
            harness.check_budgets()
        store.end_iteration()
        after = store.stats()
        if iteration >= 2:
            assert after["prefetch_hits"] - before["prefetch_hits"] == len(order)
            assert after["prefetch_misses"] == before["prefetch_misses"]
    assert store.stats()["rerecords"] == 0
    harness.finish()
