"""The demo's report: ``metrics.jsonl`` (one JSON object per line), a PNG, and a summary table.

Note: the records
    ``metrics.jsonl`` holds one ``{"kind": "run", ...}`` line (model, config, host budget), one
    ``{"kind": "step", ...}`` line per training step and, when the run ends (also after
    Ctrl-C), one ``{"kind": "summary", ...}`` line. Step records are flat apart from ``bytes``
    (tier pair -> bytes moved in that step), so ``pandas.read_json(lines=True)`` or ``jq`` read
    them directly. Only matplotlib's Agg backend is used (no display needed).

Note: the picture adds up
    The PNG has four panels: loss per step (validation points when evaluated); time per step;
    bytes moved per tier pair per step; resident host memory (RSS) against the documented
    budget.

    Time: with the optimizer state on NVMe the engine runs the CPU step in the background, into
    the next step's forward, so forward + backward + CPU step is MORE than the step's wall time.
    The solid bars are what the training loop waited for, which adds up to the wall time:
    forward, backward, and the part of the CPU step the loop waited for in ``optimizer.step()``
    (``step_wall``). The rest of the CPU step ran beside the next forward; it is drawn hatched
    on top, above the wall-time line, and the panel's caption says so (:func:`time_split`). The
    IO wait is part of the forward/backward timers and is drawn as a narrow bar inside them.

    Memory: the documented budget (README "Memory: what host RAM holds") bounds the GROWTH of
    RSS over the process before the model existed: the pools + 4 x the largest unit in fp32 +
    48 MiB fixed (``offload.estimate.host_memory_budget``). The panel draws RSS, the RSS before
    the model, and that baseline + the budget, with the budget's parts in the legend. The pools
    alone are not the budget: a run within its budget would read as an overrun against them.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import textwrap
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:  # pragma: no cover
    from offload.estimate import HostBudget

PHASES: tuple[tuple[str, str], ...] = (
    ("forward_seconds", "forward"),
    ("backward_seconds", "backward"),
    ("optimizer_seconds", "CPU step"),
)
IO_WAIT = ("io_wait_seconds", "IO wait")
GATHER_COPY = ("gather_copy_seconds", "gather copies")
TIME_PARTS: tuple[tuple[str, str], ...] = (*PHASES, IO_WAIT, GATHER_COPY)
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


def read_metrics(
    path: str | os.PathLike[str], on_bad: Callable[[str], None] | None = None
) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl``. A line that is not a JSON object raises ValueError
    naming it, or, with ``on_bad``, is left out and named to it (a run killed mid-write)."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                bad = "" if isinstance(rec, dict) else f"a JSON {type(rec).__name__}"
            except json.JSONDecodeError as exc:
                bad = str(exc)
            if not bad:
                records.append(rec)
                continue
            what = f"{os.fspath(path)}:{lineno}: not a JSON object ({bad})"
            if on_bad is None:
                raise ValueError(what)
            on_bad(what)
    return records


def step_records(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("kind") == "step"]


def time_split(rec: Mapping[str, Any]) -> dict[str, float]:
    """One step's seconds as the PNG draws them (see the Note "the picture adds up").

    ``forward``, ``backward`` and ``step_waited`` (the loop's time inside ``optimizer.step()``,
    ``step_wall``) are what the loop waited for and add up to the wall time, less ``other``
    (the loop's own overhead between the timers). ``step_overlapped`` is the rest of the CPU
    step, run in the background beside the next forward. A record without ``step_wall`` (older
    files) takes the wall time left after forward and backward as the waited part.
    """
    fwd = float(rec.get("forward_seconds", 0.0) or 0.0)
    bwd = float(rec.get("backward_seconds", 0.0) or 0.0)
    step = float(rec.get("optimizer_seconds", 0.0) or 0.0)
    wall = float(rec.get("wall_seconds", 0.0) or 0.0)
    waited = rec.get("step_wall")
    if waited is None:
        waited = min(step, max(0.0, wall - fwd - bwd))
    waited = float(waited)
    return {
        "forward": fwd,
        "backward": bwd,
        "step_waited": waited,
        "step_overlapped": max(0.0, step - waited),
        "other": max(0.0, wall - fwd - bwd - waited),
    }


def plot_report(
    records: Iterable[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    title: str = "offload demo",
    host_budget: HostBudget | None = None,
    rss_before_bytes: int | None = None,
    loss_title: str = "loss (nats per byte)",
    uniform_loss: float = math.log(256),
) -> Path:
    """Write the four-panel PNG (see the module Notes) and return its path.

    ``host_budget`` is the documented budget of the run (``offload.estimate.host_memory_budget``)
    and ``rss_before_bytes`` the process's RSS before the model existed, which it is counted
    from; either may be None (no budget line; a budget without a baseline is drawn from 0).
    """
    import matplotlib  # noqa: PLC0415  (optional dependency: offload[plot])

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # noqa: PLC0415

    records = list(records)
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
    ax_loss.axhline(
        uniform_loss,
        color="grey",
        lw=0.8,
        ls=":",
        label=f"uniform guess (ln {math.exp(uniform_loss):.0f})",
    )
    ax_loss.set(title=loss_title, xlabel="step", ylabel="cross-entropy")
    ax_loss.legend(loc="upper right", fontsize=8)

    _plot_time(ax_time, steps, xs)

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

    _plot_memory(ax_rss, steps, host_budget, rss_before_bytes)

    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out


def _plot_time(ax: Any, steps: list[Mapping[str, Any]], xs: list[int]) -> None:
    """Solid bars that add up to the wall time, the background part of the step hatched on top
    (see the Note "the picture adds up")."""
    splits = [time_split(r) for r in steps]
    bottom = [0.0] * len(steps)
    solid = (
        ("forward", "forward", "C0"),
        ("backward", "backward", "C1"),
        ("step_waited", "CPU step: waited for", "C3"),
    )
    for key, label, color in solid:
        vals = [s[key] for s in splits]
        ax.bar(xs, vals, bottom=bottom, label=label, color=color, width=0.85)
        bottom = [b + v for b, v in zip(bottom, vals)]
    hidden = [s["step_overlapped"] for s in splits]
    if any(hidden):
        ax.bar(
            xs, hidden, bottom=bottom, width=0.85, color="none", edgecolor="C3", hatch="///",
            lw=0.6, label="CPU step: in the background",
        )  # fmt: skip
    io_wait = [float(r.get(IO_WAIT[0], 0.0) or 0.0) for r in steps]
    if any(io_wait):
        # the engine counts waits for gathered params inside the forward/backward timers
        ax.bar(
            xs, io_wait, width=0.35, color="C2", alpha=0.9,
            label="IO wait (part of forward/backward)",
        )  # fmt: skip
    walls = [float(r.get("wall_seconds", 0.0) or 0.0) for r in steps]
    ax.plot(xs, walls, "k.-", lw=1, label="wall")
    top = max([b + h for b, h in zip(bottom, hidden)] + walls, default=0.0)
    ax.set_ylim(0, max(1e-3, top) * 1.6)  # room for the legend above the bars
    ax.set(title="time per step", ylabel="seconds")
    ax.set_xlabel("step\n" + time_caption(splits), fontsize=9)
    ax.legend(loc="upper right", fontsize=8)


def time_caption(splits: list[Mapping[str, float]]) -> str:
    """The line under the time panel that says why the bars do (not) stack to the wall line."""
    text = "Solid bars: what the training loop waited for; they add up to the wall time."
    if any(s["step_overlapped"] for s in splits):
        share = sum(s["step_overlapped"] for s in splits) / max(
            1e-12, sum(s["step_waited"] + s["step_overlapped"] for s in splits)
        )
        text += (
            f" Hatched: the {100 * share:.0f} % of the CPU step that ran in the background,"
            " overlapping the next forward (optimizer state on NVMe): not in the wall time."
        )
    return textwrap.fill(text, width=88)


def _plot_memory(
    ax: Any,
    steps: list[Mapping[str, Any]],
    budget: HostBudget | None,
    before: int | None,
) -> None:
    """RSS against the documented budget counted from the RSS before the model (see the Note)."""
    rss_mb = [r.get("rss_bytes", 0) / 1e6 for r in steps]
    ax.plot(
        [r.get("elapsed_seconds", 0.0) for r in steps], rss_mb, ".-", color="C3",
        label="resident (RSS)",
    )  # fmt: skip
    tops = [*rss_mb]
    base = (before or 0) / 1e6
    if before:
        ax.axhline(base, color="grey", ls=":", lw=1, label=f"RSS before the model ({base:.0f} MB)")
        tops.append(base)
    if budget is not None:
        line = base + budget.total / 1e6
        where = "RSS before the model + " if before else ""
        ax.axhline(
            line,
            color="C2",
            ls="--",
            label=f"documented budget (README 'Memory'): {where}{budget.total / 1e6:.0f} MB\n"
            f"= buffers {budget.buffers / 1e6:.0f} + 4 x largest unit in fp32 "
            f"{budget.units / 1e6:.0f} + fixed {budget.fixed / 1e6:.0f} MB",
        )
        tops.append(line)
    ax.set(title="host memory", xlabel="seconds", ylabel="MB")
    ax.set_ylim(0, max(1.0, max(tops, default=0.0) * 1.25))
    ax.legend(loc="lower right", fontsize=7.5)


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
        "step_background_median": _median([time_split(r)["step_overlapped"] for r in steps]),
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


def format_summary(
    summary: Mapping[str, Any],
    header: Iterable[tuple[str, str]] = (),
    uniform_loss: float = math.log(256),
) -> str:
    """A two-column table: what, value (``uniform_loss``: the loss of a uniform guess)."""
    s = summary
    rows: list[tuple[str, str]] = list(header)
    rows.append(("steps", str(s["steps"])))
    if s["loss_first"] is not None:
        rows.append(
            (
                "train loss",
                f"{s['loss_first']:.3f} -> {s['loss_last']:.3f} "
                f"(mean of first / last {s['loss_window']} steps; uniform guess "
                f"{uniform_loss:.3f})",
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
            + " s"
            + (
                f" ({s['step_background_median']:.3f} s of the CPU step in the background, "
                "overlapped with the backward or the next forward)"
                if s.get("step_background_median")
                else ""
            )
            + f"; IO wait {split[IO_WAIT[1]]:.3f} s and gather copies "
            + f"{split[GATHER_COPY[1]]:.3f} s of forward+backward",
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
