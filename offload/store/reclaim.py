"""Making room under the hard budgets: evict, wait for a transfer, or fail naming the budget.

Note: budgets and eviction
    A host copy of an NVMe-homed shard takes one ``BufferPool`` buffer; a device copy takes a
    device slab (``budget.py``). When a budget is full the store evicts a released, clean,
    settled copy chosen by ``planner.choose_victim``: farthest next use in the recorded trace,
    LRU before one exists. Dirty copies are never evicted: their write-back was started at
    release, and when nothing else is evictable the store waits for the oldest unpinned transfer
    in flight (a write-back, or a prefetch nobody has claimed yet) and tries again. Only when
    every buffer belongs to a fetched, unreleased shard does it block on the pool for the pool's
    timeout and then raise an error that names the budget. Every such wait releases the store's
    lock while it sleeps, so another thread using the store (the background step) goes on.

Note: prefetch never starves a demand fetch
    Prefetches never block and never wait. They take a free buffer, or evict a copy whose next
    use is strictly farther than the prefetched shard's; an unclaimed prefetched copy is an
    ordinary candidate for a demand fetch (near next use, so it goes last), and an unclaimed
    prefetch still in flight is waited for and then evicted. So with a pool of one shard plus
    ``prefetch_depth`` buffers a single outstanding demand fetch always gets a buffer.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from offload.store.planner import choose_victim
from offload.store.shard import Shard
from offload.store.state import ShardState, Tier

if TYPE_CHECKING:  # pragma: no cover
    from offload.store.budget import DeviceBudget, HostBudget
    from offload.store.prefetch import TracePrefetcher
    from offload.store.stats import StoreCounters

logger = logging.getLogger("offload.store")

_SLICE = 0.05  # seconds a blocked buffer wait sleeps before looking at the store again


class Reclaimer:
    """The budget half of ``TieredStore`` (a mixin: it uses the store's fields below)."""

    name: str
    _pool: Any
    _host: HostBudget | None
    _slabs: DeviceBudget
    _prefetcher: TracePrefetcher
    _counters: StoreCounters
    _inflight: dict[str, Shard]
    _on_host: dict[str, Shard]
    _on_device: dict[str, Shard]

    _lock: Any  # the store's RLock, released while a blocking wait sleeps

    _finish: Callable[[Shard], None]
    """Wait for a shard's pending transfer and apply its transition (``TieredStore._finish``)."""
    _settle: Callable[[Shard], None]
    """Finish every transfer the shard has pending (``TieredStore._settle``)."""

    def _give_slab(self, shard: Shard) -> None:
        self._slabs.give(shard.drop_device())
        self._on_device.pop(shard.key, None)

    def _give_buf(self, shard: Shard) -> None:
        self._host.give(shard.drop_host())
        self._on_host.pop(shard.key, None)

    def _drop_copies(self, shard: Shard) -> None:
        """A released shard whose value is not needed: its cached copies go, nothing is written."""
        self._settle(shard)
        shard.dirty = False
        if shard.state is ShardState.DEVICE and shard.home is not Tier.DEVICE:
            self._give_slab(shard)
        if shard.state is ShardState.HOST and shard.home is Tier.NVME:
            self._give_buf(shard)

    def _block_on(self, transfer: Any) -> None:
        """Waits for ``transfer`` with the store's lock released (every level of it), so another
        thread using this store (the background step, the backward handing it gradients) is not
        stopped for the duration of a disk transfer. Callers look at the shard again afterwards;
        an error is left for ``_finish``, whose wait raises it."""
        saved = self._lock._release_save()  # what threading.Condition.wait does with an RLock
        try:
            start = time.perf_counter()
            with contextlib.suppress(Exception):
                transfer.handle.wait()
            waited = time.perf_counter() - start
        finally:
            self._lock._acquire_restore(saved)
        self._counters.waited(transfer.src, transfer.dst, waited)

    # -- budgets -----------------------------------------------------------------------------------------
    def _distance(self, key: str, tiers: tuple[Tier, ...]) -> float | None:
        distances = [self._prefetcher.distance((key, t)) for t in tiers]
        if distances[0] is None:
            return None
        return min(distances)

    def _take_host(self, shard: Shard, *, blocking: bool, prefetch: bool) -> torch.Tensor | None:
        host = self._host
        assert host is not None
        tiers = (Tier.HOST, Tier.DEVICE)
        deadline = None
        while True:
            buf = host.try_take()
            if buf is not None:
                return buf
            candidates = [
                s
                for s in self._on_host.values()
                if s is not shard
                and s.home is Tier.NVME
                and s.pending is None
                and not s.pinned()
                and not s.dirty
                and s.state in (ShardState.HOST, ShardState.DEVICE)
            ]
            victim = self._choose(candidates, shard, tiers, prefetch)
            if victim is not None:
                if victim.state is ShardState.DEVICE:
                    self._give_slab(victim)
                self._give_buf(victim)
                self._counters.evicted(Tier.HOST)
                continue
            if not blocking:
                return None
            if self._wait_one(shard):
                continue
            timeout = getattr(self._pool, "timeout", 60.0)
            if deadline is None:
                deadline = time.monotonic() + timeout
            try:
                # in short slices with the lock released: another thread's release may free a
                # buffer, or leave a copy that can be evicted, which only this loop sees
                saved = self._lock._release_save()
                try:
                    return host.take_blocking(min(_SLICE, max(0.0, deadline - time.monotonic())))
                finally:
                    self._lock._acquire_restore(saved)
            except Exception as exc:
                if time.monotonic() < deadline:
                    continue
                held = list(self._on_host)
                if not held:
                    held = ["none of this store's; is the pool shared with another user?"]
                raise RuntimeError(
                    f"{self.name}: host budget exhausted fetching {shard.key!r}: all "
                    f"{host.capacity} buffers ({self.name}.buffer_count={host.capacity}, "
                    f"{self.name}.buffer_size={host.buffer_size} bytes) are held by fetched, "
                    f"unreleased shards {held[:8]} and none came free within {timeout} s; "
                    f"raise {self.name}.buffer_count or release shards sooner"
                ) from exc

    def _take_slab(self, shard: Shard, *, blocking: bool, prefetch: bool) -> Any | None:
        tiers = (Tier.DEVICE,)
        while True:
            slab = self._slabs.try_take(shard.nbytes)
            if slab is not None:
                return slab
            candidates = [
                s
                for s in self._on_device.values()
                if s is not shard
                and s.state is ShardState.DEVICE
                and s.pending is None
                and not s.pins[Tier.DEVICE]
                and not s.dirty
            ]
            victim = self._choose(candidates, shard, tiers, prefetch)
            if victim is not None:
                self._give_slab(victim)
                self._counters.evicted(Tier.DEVICE)
                continue
            if not blocking:
                return None
            if self._wait_one(shard):
                continue
            raise RuntimeError(
                f"{self.name}: device budget exhausted fetching {shard.key!r} "
                f"({shard.nbytes} bytes): {self._slabs.in_use} of device_budget="
                f"{self._slabs.budget} bytes are held by fetched, unreleased shards; raise "
                "device_budget or release device shards sooner"
            )

    def _choose(
        self, candidates: list[Shard], shard: Shard, tiers: tuple[Tier, ...], prefetch: bool
    ) -> Shard | None:
        if not candidates:
            return None
        farther: float | None = None
        if prefetch:
            farther = self._distance(shard.key, tiers)
            if farther is None:
                return None  # no known future: a prefetch never evicts
        trace_known = self._prefetcher.position() is not None
        return choose_victim(
            candidates,
            next_use=(lambda s: self._distance(s.key, tiers)) if trace_known else None,
            last_used=lambda s: s.last_used,
            farther_than=farther,
        )

    def _wait_one(self, shard: Shard) -> bool:
        """Finish the oldest unpinned transfer in flight (it may free a copy); False if none."""
        waiting = [s for s in self._inflight.values() if s is not shard and not s.pinned()]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda s: s.pending.issued)
        self._counters.budget_waits += 1
        transfer = oldest.pending
        if not transfer.done():
            self._block_on(transfer)  # lock released meanwhile: look at the shard again
        if oldest.pending is transfer:
            self._finish(oldest)
        return True
