"""The demo's training loop: plain PyTorch, timed per phase, with the engine's counters per step.

Note: where the numbers come from
    The loop measures the wall time of each phase itself (``forward_wall``: model + loss,
    ``backward_wall``, ``step_wall``: ``optimizer.step()`` + ``zero_grad()``). The engine's
    ``optimizer.stats()`` supplies what only it knows: time waiting on IO, the CPU optimizer
    time, bytes per tier pair, prefetch hits and memory peaks, each for the last step. The
    plotted split uses the engine's ``forward_seconds`` / ``backward_seconds`` /
    ``io_wait_seconds`` / ``optimizer_seconds`` when present and falls back to the loop's own
    wall time for a phase the engine does not report (IO wait then counts as 0), so a plain
    ``torch.optim`` optimizer (``--baseline``) yields a meaningful report too. Nothing is
    computed twice: a number is either the engine's or the loop's, never both summed. The
    engine counts IO wait (blocking on a parameter gather's reads) and the gathers' copies to
    the device inside its forward/backward timers, so the three phases add up to the step and
    those two are parts of them, not more addends.

Note: several ranks
    With ``comm`` (the model's collectives, when several ranks train) a step's record is the
    run's: its loss the mean of the ranks' losses (each the mean over its own batch of one
    size) and its tokens every rank's, one all-reduce per step after the step's timing; the
    time, IO and memory figures stay this rank's. Each rank then sees the same loss, so a
    non-finite one stops every rank at the same step.

Note: accumulation
    With ``accumulation`` N > 1 (the config's ``gradient_accumulation_steps``) a step is N
    micro-batches of ``batch_size``, each loss divided by N before its backward (the mean over
    the step's sequences), then one ``optimizer.step()``: the step's record has the mean of
    their losses, every micro-batch's tokens, and the forward and backward walls summed.

Note: Ctrl-C
    ``KeyboardInterrupt`` anywhere in a step ends the loop; the result says how many steps
    finished, and the caller closes the engine and removes swap files in its ``finally``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from offload.demo.data import ByteCorpus, batches, get_batch
from offload.demo.model import lm_loss
from offload.demo.report import TIER_PAIRS, MetricsWriter

STAT_KEYS: tuple[str, ...] = (
    "step_seconds",
    "forward_seconds",
    "backward_seconds",
    "io_wait_seconds",
    "gather_copy_seconds",
    "optimizer_seconds",
    "prefetch_hits",
    "prefetch_misses",
    "host_peak_bytes",
    "rss_bytes",
)


def normalize_stats(stats: Mapping[str, Any] | None) -> dict[str, Any]:
    """The engine's per-step counters with every documented key present (missing -> 0)."""
    stats = stats or {}
    out: dict[str, Any] = {key: stats.get(key, 0) or 0 for key in STAT_KEYS}
    moved = dict.fromkeys(TIER_PAIRS, 0)
    for pair, n in (stats.get("bytes") or {}).items():
        moved[str(pair)] = int(n or 0)
    out["bytes"] = moved
    return out


def current_rss() -> int:
    """Resident set size of this process in bytes (0 when psutil is missing)."""
    try:
        import psutil  # noqa: PLC0415
    except ImportError:  # pragma: no cover - psutil is a dependency
        return 0
    return int(psutil.Process().memory_info().rss)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: torch.Tensor,
    *,
    batch_size: int,
    seq_len: int,
    n_batches: int,
    device: torch.device | str = "cpu",
    seed: int = 1234,
) -> float:
    """Mean loss on ``n_batches`` fixed validation batches (same batches every call)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    try:
        losses = []
        for _ in range(n_batches):
            x, y = get_batch(data, batch_size, seq_len, gen)
            losses.append(float(lm_loss(model(x.to(device)), y.to(device))))
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


@dataclass(slots=True)
class TrainResult:
    """What a run did: steps finished, whether Ctrl-C ended it, and every record written."""

    steps_done: int = 0
    interrupted: bool = False
    records: list[dict[str, Any]] = field(default_factory=list)


def _postfix(rec: Mapping[str, Any]) -> str:
    return (
        f"loss {rec['loss']:.3f} | {rec['tokens_per_second']:.0f} tok/s | "
        f"IO {rec['io_gb_per_second']:.2f} GB/s | fwd {rec['forward_seconds']:.2f} "
        f"bwd {rec['backward_seconds']:.2f} cpu-step {rec['optimizer_seconds']:.2f} s "
        f"(io wait {rec['io_wait_seconds']:.2f})"
    )


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    corpus: ByteCorpus,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    warmup_steps: int = 0,
    seed: int = 0,
    eval_batches: int = 0,
    device: torch.device | str = "cpu",
    writer: MetricsWriter | None = None,
    progress: bool = True,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    comm=None,
    accumulation: int = 1,
) -> TrainResult:
    """Train for ``steps`` steps (see the module Notes); Ctrl-C ends it early and cleanly.
    ``comm``: the model's collectives when several ranks train (Note: several ranks);
    ``accumulation``: micro-batches per step (Note: accumulation)."""
    from tqdm.auto import tqdm  # noqa: PLC0415

    result = TrainResult()

    def emit(record: dict[str, Any]) -> None:
        result.records.append(record)
        if writer is not None:
            writer.write(record)

    stream = batches(corpus.train, batch_size, seq_len, seed)
    stats_fn = getattr(optimizer, "stats", None)
    bar = tqdm(total=steps, disable=not progress, unit="step", dynamic_ncols=True)
    t_start = time.perf_counter()
    try:
        if eval_batches > 0:
            val = evaluate(
                model,
                corpus.val,
                batch_size=batch_size,
                seq_len=seq_len,
                n_batches=eval_batches,
                device=device,
            )
            emit({"kind": "eval", "step": 0, "val_loss": val})
            restart = getattr(optimizer, "restart_step_counters", None)
            if callable(restart):
                restart()  # the eval pass is not step 1's time or IO
        for step in range(steps):
            scale = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
            for group in optimizer.param_groups:
                group["lr"] = lr * scale
            c0 = time.process_time()
            walls = {"forward": 0.0, "backward": 0.0}
            loss_value, tokens = 0.0, 0
            for _ in range(accumulation):
                x, y = next(stream)
                x, y = x.to(device), y.to(device)
                t1 = time.perf_counter()
                loss = lm_loss(model(x), y) / accumulation
                t2 = time.perf_counter()
                scale_loss = getattr(optimizer, "scale_loss", None)  # (fp16: offload's scaling)
                (scale_loss(loss) if callable(scale_loss) else loss).backward()
                walls["forward"] += t2 - t1
                walls["backward"] += time.perf_counter() - t2
                loss_value += float(loss.detach())
                tokens += x.numel()
            t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            t3 = time.perf_counter()
            walls["optimizer"] = t3 - t2
            stats = stats_fn() if callable(stats_fn) else None
            rec = normalize_stats(stats)
            for phase, wall in walls.items():
                if not (stats or {}).get(f"{phase}_seconds"):
                    rec[f"{phase}_seconds"] = wall
            wall = sum(walls.values())  # (the batches' slicing is not the step's)
            io_bytes = sum(rec["bytes"].values())
            if comm is not None:
                loss_value, tokens = _over_ranks(comm, loss_value, tokens)
            rec.update(
                kind="step",
                step=step + 1,
                loss=loss_value,
                lr=lr * scale,
                tokens=tokens,
                wall_seconds=wall,
                cpu_seconds=time.process_time() - c0,  # all threads of this process
                forward_wall=walls["forward"],
                backward_wall=walls["backward"],
                step_wall=walls["optimizer"],
                elapsed_seconds=time.perf_counter() - t_start,
                io_bytes=io_bytes,
                io_gb_per_second=io_bytes / wall / 1e9 if wall > 0 else 0.0,
                tokens_per_second=tokens / wall if wall > 0 else 0.0,
            )
            if not rec["rss_bytes"]:
                rec["rss_bytes"] = current_rss()
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"loss became {loss_value} at step {step + 1}")
            emit(rec)
            result.steps_done = step + 1
            bar.set_postfix_str(_postfix(rec), refresh=False)
            bar.update(1)
            if on_step is not None:
                on_step(rec)
        if eval_batches > 0 and result.steps_done:
            val = evaluate(
                model,
                corpus.val,
                batch_size=batch_size,
                seq_len=seq_len,
                n_batches=eval_batches,
                device=device,
            )
            emit({"kind": "eval", "step": result.steps_done, "val_loss": val})
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        bar.close()
    return result


def _over_ranks(comm, loss: float, tokens: int) -> tuple[float, int]:
    """The step's loss (the mean of the ranks') and tokens (their sum) over the ranks (Note:
    several ranks); float64, so that every rank holds the same numbers."""
    both = torch.tensor([loss, tokens], dtype=torch.float64)
    comm.all_reduce(both, what="the step's loss and tokens").wait()
    return float(both[0]) / comm.world, int(both[1])
