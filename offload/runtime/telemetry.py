"""Per-step telemetry of a wrapped model: one plain dict per optimizer step, built from counters
that already exist (the runtime's phase timers, the stores' per-tier byte counters, the
host <-> device transfers' counters and the collectives' counters, ``offload.dist``); nothing
is measured twice. Optionally each step's dict is appended to a JSON-lines file
(``telemetry.jsonl_path``).

Collectives: ``collectives`` holds this step's ``{op: {bytes, calls, wait_seconds}}`` on this
rank (bytes as ``offload.dist`` counts them: the textbook volume), ``collective_bytes`` and
``collective_wait_seconds`` their sums.
"""

from __future__ import annotations

import json

import psutil

TIMERS = (
    "step_seconds",
    "forward_seconds",
    "backward_seconds",
    "io_wait_seconds",  # gathering params, but for issuing their copies to the device:
    # waiting for their reads (on the CPU also for their pages, on CUDA for a copy to give a
    # pool buffer back); inside forward_seconds and backward_seconds
    "forward_io_wait_seconds",
    "backward_io_wait_seconds",
    "gather_copy_seconds",  # the gathers' copies to the device (on the CPU the copies
    # themselves, on CUDA the host's time queueing them); inside forward and backward seconds
    "hook_seconds",  # offload's forward and backward hooks on the thread that runs the model
    # (gathers, releases, taking the gradients, and the waits in them, io_wait_seconds and
    # gather_copy_seconds included); inside forward_seconds and backward_seconds
    "optimizer_seconds",  # the update; with NVMe state it runs in the background, overlapping
    # the forward of the step it is counted in
    "step_wait_seconds",  # waiting for the background NVMe update (inside forward_seconds,
    # backward_seconds, or optimizer.step() when the update ran in the backward)
    "rollbacks",  # count: speculative updates undone (redone, skipped on an fp16 overflow, or
    # dropped with their gradients: zero_grad() before step(), a backward that failed)
    "updates_in_backward",  # count: updates that ran speculatively in the step's last backward
    # (kept or rolled back); a step with none updated after its backward
    "clipped_steps",  # count: steps whose gradients were clipped (coefficient < 1)
)


def collective_totals(counted) -> dict[str, dict]:
    """``{op: {bytes, calls, wait_seconds}}`` summed over everything counted, cumulative."""
    out: dict[str, dict] = {}
    for obj in counted:
        for op, rec in obj.stats().get("collectives", {}).items():
            acc = out.setdefault(op, {"bytes": 0, "calls": 0, "wait_seconds": 0.0})
            for k in acc:
                acc[k] += rec.get(k, 0)
    return out


def _minus(now: dict[str, dict], before: dict[str, dict]) -> dict[str, dict]:
    return {
        op: {k: v - before.get(op, {}).get(k, 0) for k, v in rec.items()} for op, rec in now.items()
    }


def store_totals(counted) -> tuple[dict[str, int], int, int, int, dict]:
    """(bytes per tier pair, prefetch hits, misses, peak host buffer bytes used, raw stats)
    summed over everything that counts moved bytes (the stores and the host <-> device
    transfers: ``Runtime.counted()``), cumulative since wrap."""
    moved: dict[str, int] = {}
    hits = misses = peak = 0
    raw = {}
    for obj in counted:
        st = obj.stats()
        raw[getattr(obj, "name", "transfers")] = st
        for pair, rec in st.get("tiers", {}).items():
            moved[pair] = moved.get(pair, 0) + int(rec.get("bytes", 0))
        hits += int(st.get("prefetch_hits", 0))
        misses += int(st.get("prefetch_misses", 0))
        peak += int(st.get("peak_host_bytes", 0))
    return moved, hits, misses, peak, raw


class Telemetry:
    """Snapshots the counters at the end of every step; :meth:`stats` returns the last one."""

    def __init__(self, jsonl_path: str | None = None) -> None:
        self.jsonl_path = jsonl_path
        self._prev = ({}, 0, 0)  # cumulative bytes, hits, misses at the previous step's end
        self._prev_coll: dict[str, dict] = {}  # cumulative collectives at the previous step's end
        self._last: dict = {}
        self._totals: dict[str, float] = {k: 0.0 for k in TIMERS}

    def end_step(self, timers: dict[str, float], counted, steps: int, skipped: bool) -> None:
        moved, hits, misses, peak, raw = store_totals(counted)
        prev_moved, prev_hits, prev_misses = self._prev
        self._prev = (moved, hits, misses)
        for k in TIMERS:
            self._totals[k] += timers.get(k, 0.0)
        rec: dict = {k: float(timers.get(k, 0.0)) for k in TIMERS}
        rec["bytes"] = {k: v - prev_moved.get(k, 0) for k, v in moved.items()}
        coll = collective_totals(counted)
        rec["collectives"] = _minus(coll, self._prev_coll)
        self._prev_coll = coll
        rec["collective_bytes"] = sum(r["bytes"] for r in rec["collectives"].values())
        rec["collective_wait_seconds"] = sum(r["wait_seconds"] for r in rec["collectives"].values())
        rec["prefetch_hits"] = hits - prev_hits
        rec["prefetch_misses"] = misses - prev_misses
        rec["host_peak_bytes"] = peak  # used by shards at the peak, summed over the pools
        rec["host_reserved_bytes"] = sum(st.get("host_reserved_bytes", 0) for st in raw.values())
        rec["rss_bytes"] = psutil.Process().memory_info().rss
        rec["steps"] = steps
        rec["skipped"] = skipped
        rec["total"] = {
            **self._totals,
            "bytes": moved,
            "prefetch_hits": hits,
            "prefetch_misses": misses,
        }
        if self.jsonl_path:
            line = {k: v for k, v in rec.items() if k != "total"}
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(line) + "\n")
        rec["stores"] = raw
        self._last = rec

    def rebase(self, counted) -> None:
        """The next step's byte and prefetch counts start from here."""
        moved, hits, misses, _, _ = store_totals(counted)
        self._prev = (moved, hits, misses)
        self._prev_coll = collective_totals(counted)

    def stats(self, counted=None) -> dict:
        """The last step's record (all zeros before the first step). With ``counted`` (the
        engine's counted objects), its ``total`` bytes and prefetch counts are read now rather
        than at the step's end: an update running in the background is in them as far as it
        has gone (whole after a ``synchronize()``), which no step's record holds until the next
        step closes (``bytes``)."""
        if not self._last:
            out = {k: 0.0 for k in TIMERS} | {
                "bytes": {},
                "collectives": {},
                "collective_bytes": 0,
                "collective_wait_seconds": 0.0,
                "prefetch_hits": 0,
                "prefetch_misses": 0,
                "steps": 0,
                "total": {},
            }
        else:
            out = dict(self._last)
        if counted is not None:
            moved, hits, misses, _, _ = store_totals(counted)
            out["total"] = {**self._totals, **out["total"]} | {
                "bytes": moved,
                "prefetch_hits": hits,
                "prefetch_misses": misses,
            }
        return out


def check_jsonl_path(path: str | None) -> None:
    """Fails at wrap time (naming the key) when the telemetry file cannot be appended to: it is
    opened for appending once (created empty when missing; an existing file is not changed),
    so a directory, a read-only file or a missing directory is found here and not at the
    first ``step()``."""
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        from offload.config import ConfigError  # noqa: PLC0415

        raise ConfigError(
            f"telemetry.jsonl_path={path!r}: cannot append to it ({exc.strerror or exc}); "
            "allowed: a file that can be appended to, or a path in a writable directory"
        ) from exc
