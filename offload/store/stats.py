"""Counters of the tiered store: bytes, transfers and waiting per tier pair, prefetch, evictions.

Telemetry reads these (``TieredStore.stats()``), never estimates: every byte the store moves is
counted where the transfer is issued, every second it blocks is counted where it waits.
"""

from __future__ import annotations

from offload.store.state import Tier

PAIRS: tuple[tuple[Tier, Tier], ...] = ((Tier.NVME, Tier.HOST), (Tier.HOST, Tier.NVME))


def pair_name(src: Tier, dst: Tier) -> str:
    """``"nvme->host"`` etc."""
    return f"{src.name.lower()}->{dst.name.lower()}"


class StoreCounters:
    """Plain counters; ``as_dict`` returns a JSON-able snapshot."""

    def __init__(self) -> None:
        self._pairs: dict[str, dict[str, float]] = {
            pair_name(s, d): {"bytes": 0, "transfers": 0, "wait_seconds": 0.0} for s, d in PAIRS
        }
        self.prefetch_hits = 0
        """Replayed uses whose shard was resident or in flight (count)."""
        self.prefetch_misses = 0
        """Replayed uses whose shard had not been started (count)."""
        self.prefetches_started = 0
        """Trace prefetches that started a transfer or took a buffer (count)."""
        self.read_aheads_started = 0
        """Reads that a ``read_ahead`` hint started (count; not in ``prefetches_started``)."""
        self.prefetches_deferred = 0
        """Prefetches that found no buffer they were allowed to take (retried later; count)."""
        self.rerecords = 0
        """Times the recorded trace was replaced (count)."""
        self.evictions = {"host": 0}
        self.budget_waits = 0
        """Times a demand fetch waited for a transfer in flight to free a buffer (count)."""
        self.fetched_bytes = 0
        """IO bytes of the fetches that needed an NVMe-homed shard's data: read from disk, read
        ahead, or found in host memory (``offload.plan.traffic`` predicts this)."""

    def moved(self, src: Tier, dst: Tier, nbytes: int) -> None:
        entry = self._pairs[pair_name(src, dst)]
        entry["bytes"] += nbytes
        entry["transfers"] += 1

    def waited(self, src: Tier, dst: Tier, seconds: float) -> None:
        self._pairs[pair_name(src, dst)]["wait_seconds"] += seconds

    def prefetch(self, hit: bool) -> None:
        if hit:
            self.prefetch_hits += 1
        else:
            self.prefetch_misses += 1

    def prefetch_started(self, started: bool, hint: bool) -> None:
        if started and hint:
            self.read_aheads_started += 1
        elif started:
            self.prefetches_started += 1
        else:
            self.prefetches_deferred += 1

    def evicted(self, tier: Tier) -> None:
        self.evictions[tier.name.lower()] += 1

    def as_dict(self, *, host: dict) -> dict:
        """Snapshot: ``tiers`` (per pair: bytes, transfers, wait_seconds), prefetch counts,
        evictions, and the ``host_*`` budget figures passed in (flat keys)."""
        uses = self.prefetch_hits + self.prefetch_misses
        return {
            "tiers": {name: dict(entry) for name, entry in self._pairs.items()},
            "prefetch_hits": self.prefetch_hits,
            "prefetch_misses": self.prefetch_misses,
            "prefetch_hit_rate": self.prefetch_hits / uses if uses else 0.0,
            "prefetches_started": self.prefetches_started,
            "read_aheads_started": self.read_aheads_started,
            "prefetches_deferred": self.prefetches_deferred,
            "rerecords": self.rerecords,
            "evictions": dict(self.evictions),
            "budget_waits": self.budget_waits,
            "fetched_bytes": self.fetched_bytes,
            **host,
        }
