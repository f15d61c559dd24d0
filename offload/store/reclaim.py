"""Making room under the host budget: evict, wait for a transfer, or fail naming the budget.

Note: budgets and eviction
    A host copy of an NVMe-homed shard takes one ``BufferPool`` buffer. When the pool is empty
    the store evicts a released, clean, settled copy chosen by ``planner.choose_victim``: farthest
    next use in the recorded trace, LRU before one exists. Dirty copies are never evicted: their
    write-back was started at release, and when nothing else is evictable the store waits for
    the oldest unpinned transfer in flight (a write-back, or a prefetch nobody has claimed yet)
    and tries again. Only when every buffer belongs to a fetched, unreleased shard does it block
    on the pool for the pool's timeout and then raise an error that names the budget. Every such
    wait releases the store's lock while it sleeps, so another thread using the store (the
    background step) goes on.

Note: prefetch never starves a demand fetch
    Prefetches never block and never wait. They take a free buffer, or evict a copy whose next
    use is strictly farther than the prefetched shard's; an unclaimed prefetched copy is an
    ordinary candidate for a demand fetch (near next use, so it goes last), and an unclaimed
    prefetch still in flight is waited for and then evicted. So with a pool of one shard plus
    ``prefetch_depth`` buffers a single outstanding demand fetch always gets a buffer.

Note: expected copies
    A fetch outside the trace (the update in the backward reading a unit's params, which are
    its fp32 master) has no next use in it: its copies look a whole iteration away and the
    backward's prefetches took their buffers just before the update read them again
    (``TieredStore.expect``; ``benchmarks/README.md``, beyond_ram: 23.1 B/param read a step
    instead of 15.5 with 4 param buffers); so did the update writing a unit's new compute
    params (a master of its own, bf16), which then evicted the read-ahead's copies for buffers
    to write them in. A caller that knows it fetches a key next says so;
    until that fetch (or the iteration's end) the key's next use counts as now: no prefetch
    displaces its copy, and a demand fetch takes it last.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from offload._interrupts import interrupts_deferred
from offload.store.budget import HostBudget
from offload.store.planner import choose_victim
from offload.store.prefetch import TracePrefetcher
from offload.store.shard import Shard, Transfer
from offload.store.state import ShardState, Tier
from offload.store.stats import StoreCounters

_SLICE = 0.05  # seconds a blocked buffer wait sleeps before looking at the store again


class Transfers(Protocol):
    """What the reclaimer needs of the store's transfers in flight."""

    def in_flight(self) -> Iterable[Shard]: ...

    def finish_other(self, shard: Shard) -> None:
        """Wait for the pending transfer of a shard the waiting caller does not hold and apply
        its transition; a failure is kept for whom it concerns, not raised to that caller (the
        store's Note on whose error)."""


class Reclaimer:
    """The host budget of one store and the copies holding its buffers.

    Args:
        name: the store's config section, for error messages.
        pool: the ``BufferPool`` the budget draws from.
        prefetcher: the store's trace, for next-use distances.
        counters: the store's counters (evictions, budget waits, seconds waited).
        lock: the store's lock, released while a blocking wait sleeps.
        transfers: the store's transfers in flight.
    """

    def __init__(
        self,
        name: str,
        pool: Any,
        prefetcher: TracePrefetcher,
        counters: StoreCounters,
        lock: Any,
        transfers: Transfers,
    ) -> None:
        self.name, self.pool = name, pool
        self.budget = HostBudget(pool)
        self._prefetcher, self._counters, self._lock = prefetcher, counters, lock
        self._transfers = transfers
        self.cached: dict[str, Shard] = {}  # shards holding a pool buffer: eviction candidates
        self._expected: set[str] = set()  # keys a fetch outside the trace takes next (Note)
        self.held_bytes = 0  # IO bytes of the shards holding a buffer (what the pages hold)
        self.peak_held_bytes = 0

    # -- buffers ------------------------------------------------------------------------------
    def took(self, shard: Shard) -> None:
        """``shard`` now holds a pool buffer."""
        self.cached[shard.key] = shard
        self.held_bytes += shard.io_nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def give_buf(self, shard: Shard) -> None:
        """Drops the host copy of ``shard`` (clean, settled) and gives its buffer back."""
        with interrupts_deferred():  # dropped and given back together (a buffer lost, or
            self._gone(shard, shard.drop_host())  # given back twice, otherwise)

    def give_aborted(self, shard: Shard, buf: torch.Tensor) -> None:
        """A read into ``buf`` failed: the buffer goes back."""
        with interrupts_deferred():
            self._gone(shard, buf)

    def _gone(self, shard: Shard, buf: torch.Tensor) -> None:
        self.budget.give(buf)
        if self.cached.pop(shard.key, None) is not None:
            self.held_bytes -= shard.io_nbytes

    def close(self) -> None:
        """Gives every buffer back (the store has settled every transfer). Stopped part way
        (a Ctrl-C), the next call gives the rest: each is given back and forgotten together
        (given back again, the pool raised "released twice" at the next close)."""
        while self.cached:
            with interrupts_deferred():
                key, shard = next(iter(self.cached.items()))
                if shard.host_buf is not None:
                    self.budget.give(shard.host_buf)
                    shard.host_buf = None
                del self.cached[key]

    # -- waiting --------------------------------------------------------------------------------
    def block_on(self, transfer: Transfer) -> None:
        """Waits for ``transfer`` with the store's lock released (every level of it), so another
        thread using this store (the background step, the backward handing it gradients) is not
        stopped for the duration of a disk transfer. Callers look at the shard again afterwards;
        an error is left for the store's ``finish``, whose wait raises it.

        The release, the wait and the taking back are one block for a Ctrl-C: landing between
        the release and the ``try``, it left the lock released under callers that hold it
        (their ``with`` then released what they no longer held). The wait is native and runs
        to its end whatever the signal, so nothing is delayed by holding it back."""
        with interrupts_deferred():
            saved = self._lock._release_save()  # as threading.Condition.wait does (RLock)
            try:
                start = time.perf_counter()
                with contextlib.suppress(Exception):
                    transfer.handle.wait()
                waited = time.perf_counter() - start
            finally:
                self._lock._acquire_restore(saved)
        self._counters.waited(transfer.src, transfer.dst, waited)

    def _wait_one(self, shard: Shard) -> bool:
        """Finish the oldest unpinned transfer in flight (it may free a copy); False if none."""
        waiting = [s for s in self._transfers.in_flight() if s is not shard and not s.pinned()]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda s: s.pending.issued)
        self._counters.budget_waits += 1
        transfer = oldest.pending
        if not transfer.done():
            self.block_on(transfer)  # lock released meanwhile: look at the shard again
        if oldest.pending is transfer:
            self._transfers.finish_other(oldest)
        return True

    # -- taking a buffer ----------------------------------------------------------------------------
    # -- expected copies (Note) ---------------------------------------------------------------
    def expect(self, keys: Iterable[str]) -> None:
        self._expected.update(keys)

    def claimed(self, key: str) -> None:
        """The fetch that :meth:`expect` announced for ``key`` came."""
        self._expected.discard(key)

    def forget_expected(self) -> None:
        """The iteration ended: a hint nobody followed lapses."""
        self._expected.clear()

    def _distance(self, key: str) -> float | None:
        if key in self._expected:
            return 0.0
        return self._prefetcher.distance((key, Tier.HOST))

    def take(self, shard: Shard, *, prefetch: bool) -> torch.Tensor | None:
        """A pool buffer for ``shard``: free, or freed by evicting a copy (the Notes); None
        when neither can be had now. Never blocks: its caller gives the buffer to the shard in
        the same block for a Ctrl-C (the store's Note on Ctrl-C and IO in flight), and waits
        for room with :meth:`wait_for_room`, holding nothing."""
        while True:
            buf = self.budget.try_take()
            if buf is not None:
                return buf
            candidates = [
                s
                for s in self.cached.values()
                if s is not shard
                and s.pending is None
                and not s.pinned()
                and not s.dirty
                and s.state is ShardState.HOST
            ]
            victim = self._choose(candidates, shard, prefetch)
            if victim is None:
                return None
            self.give_buf(victim)
            self._counters.evicted(Tier.HOST)

    def wait_for_room(self, shard: Shard, since: float | None) -> float | None:
        """Waits a while for room for ``shard``, holding no buffer (a Ctrl-C may end the wait
        at any line): for the oldest unpinned transfer in flight, or else a slice of waiting
        for the pool with the store's lock released (another thread's release may free a
        buffer, or leave a copy that :meth:`take` can evict). ``since``: when the caller's
        first wait for the pool began (``time.monotonic``; None before it), returned updated;
        once the pool's timeout has passed since then, raises naming the budget."""
        if self._wait_one(shard):
            return since
        since = time.monotonic() if since is None else since
        timeout = getattr(self.pool, "timeout", 60.0)
        left = since + timeout - time.monotonic()
        if left <= 0:
            host = self.budget
            held = list(self.cached) or [
                "none of this store's; is the pool shared with another user?"
            ]
            raise RuntimeError(
                f"{self.name}: host budget exhausted fetching {shard.key!r}: all "
                f"{host.capacity} buffers ({self.name}.buffer_count={host.capacity}, "
                f"{self.name}.buffer_size={host.buffer_size} bytes) are held by fetched, "
                f"unreleased shards {held[:8]} and none came free within {timeout} s; "
                f"raise {self.name}.buffer_count or release shards sooner"
            )
        with interrupts_deferred():  # (as in block_on; a slice is 50 ms at most)
            saved = self._lock._release_save()
            try:
                self.budget.wait_free(min(_SLICE, left))
            finally:
                self._lock._acquire_restore(saved)
        return since

    def _choose(self, candidates: list[Shard], shard: Shard, prefetch: bool) -> Shard | None:
        if not candidates:
            return None
        farther: float | None = None
        if prefetch:
            farther = self._distance(shard.key)
            if farther is None:
                return None  # no known future: a prefetch never evicts
        trace_known = self._prefetcher.position() is not None
        return choose_victim(
            candidates,
            next_use=(lambda s: self._distance(s.key)) if trace_known else None,
            last_used=lambda s: s.last_used,
            farther_than=farther,
        )

    def stats(self) -> dict:
        host = self.budget
        return {
            "host_buffers": host.capacity,
            "host_buffer_size": host.buffer_size,
            "host_reserved_bytes": host.capacity * host.buffer_size,
            "host_buffers_in_use": host.in_use,
            "peak_host_buffers": host.peak,
            "peak_host_bytes": self.peak_held_bytes,
        }
