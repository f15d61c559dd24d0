"""Per-step telemetry of a wrapped model: one plain dict, built from counters that already exist
(the engine's phase timers and the stores' per-tier byte counters); nothing is measured twice."""

from __future__ import annotations

import psutil

from offload.engine.engine import Engine

TIMERS = (
    "step_seconds",
    "forward_seconds",
    "backward_seconds",
    "io_wait_seconds",
    "optimizer_seconds",
)


def _bytes(store_stats: dict) -> dict[str, int]:
    """Tier-pair byte counters of one store, as ``{"nvme->host": n, ...}``."""
    out: dict[str, int] = {}
    for pair, rec in store_stats.get("tiers", {}).items():
        out[pair] = out.get(pair, 0) + int(rec.get("bytes", 0))
    return out


def step_stats(engine: Engine) -> dict:
    last = getattr(engine, "last_timers", {})
    out: dict = {k: float(last.get(k, 0.0)) for k in TIMERS}
    totals_bytes: dict[str, int] = {}
    hits = misses = 0
    peak = 0
    stores = {}
    for name, store in engine.stores.items():
        st = store.stats()
        stores[name] = st
        for pair, n in _bytes(st).items():
            totals_bytes[pair] = totals_bytes.get(pair, 0) + n
        hits += int(st.get("prefetch_hits", 0))
        misses += int(st.get("prefetch_misses", 0))
        peak += int(st.get("peak_host_bytes", 0))
    prev = getattr(engine, "_prev_bytes", {})
    out["bytes"] = {k: v - prev.get(k, 0) for k, v in totals_bytes.items()}
    engine._prev_bytes = totals_bytes
    prev_hm = getattr(engine, "_prev_hits", (0, 0))
    out["prefetch_hits"], out["prefetch_misses"] = hits - prev_hm[0], misses - prev_hm[1]
    engine._prev_hits = (hits, misses)
    out["host_peak_bytes"] = peak
    out["rss_bytes"] = psutil.Process().memory_info().rss
    out["steps"] = engine.step_count
    out["total"] = {k: float(engine.totals.get(k, 0.0)) for k in TIMERS}
    out["total"]["bytes"] = totals_bytes
    out["total"]["prefetch_hits"], out["total"]["prefetch_misses"] = hits, misses
    out["stores"] = stores
    return out
