"""The demo's report: ``metrics.jsonl`` (one JSON object per line), a PNG, and a summary table.

Note: the records
    ``metrics.jsonl`` holds one ``{"kind": "run", ...}`` line (model, config, budget), one
    ``{"kind": "step", ...}`` line per training step and, when the run ends (also after
    Ctrl-C), one ``{"kind": "summary", ...}`` line. Step records are flat apart from ``bytes``
    (tier pair -> bytes moved in that step), so ``pandas.read_json(lines=True)`` or ``jq`` read
    them directly. The PNG has four panels: loss per step (validation points when evaluated),
    the step-time split as stacked bars (forward, backward, CPU optimizer step, with the
    measured wall time of the step drawn over them as a line, so overlap or a gap shows; the
    engine's IO wait is part of its forward/backward timers and is drawn as a narrow bar over
    them rather than stacked on top), bytes moved per tier pair per step, and resident host memory
    (RSS) over time beside the host buffer budget. Only matplotlib's Agg backend is used (no
    display needed).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

PHASES: tuple[tuple[str, str], ...] = (
    ("forward_seconds", "forward"),
    ("backward_seconds", "backward"),
    ("optimizer_seconds", "CPU step"),
)
IO_WAIT = ("io_wait_seconds", "IO wait")
TIME_PARTS: tuple[tuple[str, str], ...] = (*PHASES, IO_WAIT)
TIER_PAIRS: tuple[str, ...] = ("nvme->host", "host->nvme", "host->device", "device->host")


class MetricsWriter:
    """Appends JSON records to ``path``, one per line, flushed as written (survives Ctrl-C)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO | None = open(self.path, "w", encoding="utf-8")  # noqa: SIM115

    def write(self, record: Mapping[str, Any]) -> None:
        if self._fh is None:
            raise ValueError(f"MetricsWriter for {str(self.path)!r} is closed")
        self._fh.write(json.dumps(record, separators=(",", ":"), default=_jsonable) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, tuple | set):
        return list(value)
    return str(value)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl`` (raises ValueError naming the line that is bad)."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{os.fspath(path)}:{lineno}: not a JSON object ({exc})") from None
    return records


def step_records(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("kind") == "step"]


def plot_report(
    records: Iterable[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    title: str = "offload demo",
    host_budget_bytes: int | None = None,
) -> Path:
    """Write the four-panel PNG (see the module Note) and return its path."""
    import matplotlib  # noqa: PLC0415  (optional dependency: offload[plot])

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # noqa: PLC0415

    steps = step_records(records)
    evals = [r for r in records if r.get("kind") == "eval"]
    xs = [int(r["step"]) for r in steps]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), dpi=100)
    ax_loss, ax_time, ax_bytes, ax_rss = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]

    losses = [float(r.get("loss", math.nan)) for r in steps]
    ax_loss.plot(xs, losses, color="C0", alpha=0.35, lw=1, label="train (per step)")
    ax_loss.plot(xs, ema(losses), color="C0", lw=2, label="train (moving average)")
    if evals:
        ax_loss.plot(
            [r["step"] for r in evals], [r["val_loss"] for r in evals], "o", label="validation"
        )
    ax_loss.axhline(math.log(256), color="grey", lw=0.8, ls=":", label="uniform guess (ln 256)")
    ax_loss.set(title="loss (nats per byte)", xlabel="step", ylabel="cross-entropy")
    ax_loss.legend(loc="upper right", fontsize=8)

    bottom = [0.0] * len(steps)
    for (key, label), color in zip(PHASES, ("C0", "C1", "C3")):
        vals = [float(r.get(key, 0.0) or 0.0) for r in steps]
        ax_time.bar(xs, vals, bottom=bottom, label=label, color=color, width=0.85)
        bottom = [b + v for b, v in zip(bottom, vals)]
    io_wait = [float(r.get(IO_WAIT[0], 0.0) or 0.0) for r in steps]
    if any(io_wait):
        # the engine counts waits for gathered params inside the forward/backward timers
        ax_time.bar(
            xs, io_wait, width=0.35, color="C2", alpha=0.9,
            label="IO wait (part of forward/backward)",
        )  # fmt: skip
    ax_time.plot(xs, [r.get("wall_seconds", 0.0) for r in steps], "k.-", lw=1, label="wall")
    ax_time.set(title="time per step", xlabel="step", ylabel="seconds")
    ax_time.legend(loc="upper right", fontsize=8)

    pairs = list(TIER_PAIRS) + sorted(
        {k for r in steps for k in (r.get("bytes") or {})} - set(TIER_PAIRS)
    )
    bottom = [0.0] * len(steps)
    for i, pair in enumerate(pairs):
        vals = [float((r.get("bytes") or {}).get(pair, 0)) / 1e6 for r in steps]
        if not any(vals):
            continue
        ax_bytes.bar(xs, vals, bottom=bottom, label=pair, color=f"C{i + 4}", width=0.85)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if not any(bottom):
        ax_bytes.text(0.5, 0.5, "no bytes reported", ha="center", transform=ax_bytes.transAxes)
    else:
        ax_bytes.legend(loc="upper right", fontsize=8)
    ax_bytes.set(title="bytes moved per tier pair", xlabel="step", ylabel="MB per step")

    ax_rss.plot(
        [r.get("elapsed_seconds", 0.0) for r in steps],
        [r.get("rss_bytes", 0) / 1e6 for r in steps],
        ".-",
        color="C3",
        label="resident (RSS)",
    )
    if host_budget_bytes:
        ax_rss.axhline(host_budget_bytes / 1e6, color="C2", ls="--", label="host buffer budget")
    ax_rss.set(title="host memory", xlabel="seconds", ylabel="MB")
    top = max([r.get("rss_bytes", 0) / 1e6 for r in steps] + [(host_budget_bytes or 0) / 1e6])
    ax_rss.set_ylim(0, max(1.0, top * 1.15))
    ax_rss.legend(loc="center right", fontsize=8)

    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out


def ema(values: list[float], alpha: float = 0.3) -> list[float]:
    """Exponential moving average, bias-corrected so the first value is the first sample."""
    out: list[float] = []
    avg, weight = 0.0, 0.0
    for v in values:
        avg = (1 - alpha) * avg + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(avg / weight)
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Numbers for the summary table (also written as the ``summary`` record)."""
    records = list(records)
    steps = step_records(records)
    evals = [r for r in records if r.get("kind") == "eval"]
    losses = [float(r["loss"]) for r in steps if "loss" in r]
    k = max(1, min(3, len(losses) // 3))
    walls = [float(r.get("wall_seconds", 0.0)) for r in steps]
    total_wall = sum(walls)
    bytes_total: dict[str, int] = {}
    for r in steps:
        for pair, n in (r.get("bytes") or {}).items():
            bytes_total[pair] = bytes_total.get(pair, 0) + int(n)
    io_bytes = sum(bytes_total.values())
    tokens = sum(int(r.get("tokens", 0)) for r in steps)
    hits = sum(int(r.get("prefetch_hits", 0)) for r in steps)
    misses = sum(int(r.get("prefetch_misses", 0)) for r in steps)
    return {
        "steps": len(steps),
        "loss_first": _mean(losses[:k]) if losses else None,
        "loss_last": _mean(losses[-k:]) if losses else None,
        "loss_window": k,
        "val_first": evals[0]["val_loss"] if evals else None,
        "val_last": evals[-1]["val_loss"] if len(evals) > 1 else None,
        "tokens": tokens,
        "tokens_per_second": tokens / total_wall if total_wall > 0 else 0.0,
        "wall_seconds_total": total_wall,
        "wall_seconds_median": _median(walls),
        "split_median": {
            label: _median([float(r.get(key, 0.0) or 0.0) for r in steps])
            for key, label in TIME_PARTS
        },
        "bytes_total": bytes_total,
        "io_gb_per_second": io_bytes / total_wall / 1e9 if total_wall > 0 else 0.0,
        "prefetch_hits": hits,
        "prefetch_misses": misses,
        "rss_peak_bytes": max((int(r.get("rss_bytes", 0)) for r in steps), default=0),
        "host_peak_bytes": max((int(r.get("host_peak_bytes", 0)) for r in steps), default=0),
    }


def fmt_size(n: float) -> str:
    """Bytes as decimal GB (>= 0.1 GB) or MB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def format_summary(summary: Mapping[str, Any], header: Iterable[tuple[str, str]] = ()) -> str:
    """A two-column table: what, value."""
    s = summary
    rows: list[tuple[str, str]] = list(header)
    rows.append(("steps", str(s["steps"])))
    if s["loss_first"] is not None:
        rows.append(
            (
                "train loss",
                f"{s['loss_first']:.3f} -> {s['loss_last']:.3f} "
                f"(mean of first / last {s['loss_window']} steps; uniform guess 5.545)",
            )
        )
    if s["val_first"] is not None:
        last = f" -> {s['val_last']:.3f}" if s["val_last"] is not None else ""
        rows.append(("validation loss", f"{s['val_first']:.3f}{last}"))
    rows.append(("tokens/s", f"{s['tokens_per_second']:.0f}"))
    split = s["split_median"]
    rows.append(
        (
            "step time (median)",
            f"{s['wall_seconds_median']:.3f} s wall: "
            + ", ".join(f"{label} {split[label]:.3f}" for _, label in PHASES)
            + f" s; IO wait {split[IO_WAIT[1]]:.3f} s of forward+backward",
        )
    )
    moved = {k: v for k, v in s["bytes_total"].items() if v}
    if moved:
        per_step = max(1, s["steps"])
        rows.append(
            (
                "bytes moved (total)",
                ", ".join(f"{k} {fmt_size(v)}" for k, v in moved.items())
                + f"; {fmt_size(sum(moved.values()) / per_step)}/step",
            )
        )
    rows.append(("IO throughput", f"{s['io_gb_per_second']:.2f} GB/s (bytes moved / wall time)"))
    lookups = s["prefetch_hits"] + s["prefetch_misses"]
    if lookups:
        rows.append(
            (
                "prefetch",
                f"{s['prefetch_hits']} hits, {s['prefetch_misses']} misses "
                f"({100.0 * s['prefetch_hits'] / lookups:.0f} % hit)",
            )
        )
    rows.append(("peak RSS", fmt_size(s["rss_peak_bytes"])))
    if s["host_peak_bytes"]:
        rows.append(("host buffers peak", fmt_size(s["host_peak_bytes"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
