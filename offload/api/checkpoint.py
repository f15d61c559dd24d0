"""Sharded checkpoints and consolidated export: what of the engine goes into which file.

Note: format and atomicity
    A checkpoint directory holds one ``unit_NNNNN.safetensors`` per unit (flat fp32 ``master``,
    ``exp_avg``, ``exp_avg_sq`` over the trainable prefix, and the ``frozen`` compute params)
    plus ``meta.json`` (layout, step counters, loss scale, hyperparameters, the caller's extra
    JSON, and every file's size and SHA-256). No pickle anywhere. Tensors are streamed piece by
    piece from wherever they live (NVMe-resident state is never pulled whole into RAM). The
    files, checksums, the commit (temp directory, fsync, rename, ``latest`` pointer) and the
    verifying reader live in :mod:`offload.api.checkpoint_files`; this module only knows which
    state goes where, and reads and writes it through the runtime's values
    (``offload.runtime.values``: each unit's file is a value source on load).

Note: a load changes everything or nothing
    ``load_checkpoint`` runs in three stages: (1) verify the whole directory (schema, files,
    headers, checksums, streamed; nothing is changed), (2) compare its layout and counters with
    the model and optimizer (an error names the parameter and both shapes), (3) only then write
    the values, piece by piece, and last the counters and hyperparameters. What can still fail
    in (3) is IO of the model's own state (an EIO of the swap device): the error then says
    which unit was being written; earlier units hold the checkpoint's values.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.nn as nn

from offload.api import checkpoint_files as files
from offload.api.checkpoint_files import CheckpointError
from offload.homes.optim import KINDS
from offload.plan import Unit
from offload.runtime.values import FROZEN, ValueSource

__all__ = ["CheckpointError", "export", "load_checkpoint", "save_checkpoint"]


def _unit_file(unit: Unit) -> str:
    return f"unit_{unit.index:05d}.safetensors"


def _unit_meta(unit: Unit) -> dict:
    return {
        "name": unit.name,
        "trainable": unit.layout.trainable,
        "total": unit.layout.total,
        "params": [
            [s.name, s.offset, s.numel, list(s.shape), s.trainable] for s in unit.layout.segments
        ],
    }


def _engine(model: nn.Module):
    from offload.api.wrap import engine_of  # noqa: PLC0415

    return engine_of(model)


def _to_json(extra: dict) -> dict:
    try:
        json.dumps(extra)
    except TypeError as exc:
        raise TypeError(
            f"save_checkpoint: extra values must be JSON-serializable (numbers, strings, lists, "
            f"dicts), e.g. scheduler=sched.state_dict(); got {exc}"
        ) from None
    return extra


def _unit_entries(engine, unit: Unit) -> list[files.Entry]:
    """The tensors of one unit's file, each produced piece by piece from its owner."""
    values = engine.values
    n, total = unit.layout.trainable, unit.layout.total
    kinds = [(k, torch.float32, n) for k in (KINDS if n else ())]
    kinds += [(FROZEN, engine.dtype, total - n)] if total > n else []
    return [
        (
            kind,
            dtype,
            [numel],
            lambda k=kind: (values.flat(unit, k, lo, hi) for lo, hi in values.pieces(unit, k)),
        )
        for kind, dtype, numel in kinds
    ]


def save_checkpoint(
    directory: str | os.PathLike, model: nn.Module, optimizer, *, keep_last: int = 1, **extra
) -> Path:
    """Saves model and optimizer state under ``directory`` (see the module Note); returns the
    checkpoint's own directory. ``extra`` (JSON-serializable) comes back from load_checkpoint."""
    engine = _engine(model)
    engine.check_idle("save_checkpoint")
    _to_json(extra)
    name = f"ckpt-{engine.step_count:08d}-{time.time_ns()}"
    with files.CheckpointWriter(Path(directory), name) as out:
        for unit in engine.units:
            out.add_file(_unit_file(unit), _unit_entries(engine, unit))
        group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        meta = {
            "dtype": str(engine.dtype).removeprefix("torch."),
            "step_count": engine.step_count,
            "skipped_steps": optimizer.skipped_steps,
            "loss_scaler": optimizer.scaler.state_dict() if optimizer.scaler is not None else None,
            "param_group": {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()},
            "units": [_unit_meta(u) for u in engine.units],
            "extra": extra,
        }
        return out.commit(meta, keep_last)


def _unit_tensors(unit: Unit) -> dict[str, tuple[tuple[str, ...], list[int]]]:
    """The tensors the unit's file must hold: name -> (allowed dtype codes, shape)."""
    n, total = unit.layout.trainable, unit.layout.total
    out = {k: (("F32",), [n]) for k in (KINDS if n else ())}
    if total > n:  # frozen values convert to the model's dtype on load
        out["frozen"] = (("F32", "BF16", "F16"), [total - n])
    return out


def load_checkpoint(directory: str | os.PathLike, model: nn.Module, optimizer) -> dict:
    """Restores what :func:`save_checkpoint` wrote into a model wrapped with the same layout;
    returns the ``extra`` values. Verifies everything before changing anything (module Note);
    a bad checkpoint raises :class:`CheckpointError` and leaves the model as it was."""
    engine = _engine(model)
    engine.check_idle("load_checkpoint", restoring=True)
    with files.open_checkpoint(files.resolve(Path(directory))) as ckpt:  # (1)
        files.check_layout(  # (2)
            ckpt,
            [_unit_meta(u) for u in engine.units],
            {_unit_file(u): _unit_tensors(u) for u in engine.units},
        )
        counters = files.check_counters(
            ckpt, optimizer.param_groups[0], loss_scale=optimizer.scaler is not None
        )
        for run in engine.runs:  # (3)
            try:
                _apply_unit(ckpt, engine, run)
            except Exception as exc:  # not a CheckpointError: that one means nothing changed
                raise RuntimeError(
                    f"load_checkpoint: writing unit '{run.unit.label}' from '{ckpt.path}' failed "
                    f"after the checkpoint was verified ({exc}); the units before it hold the "
                    "checkpoint's values, it and the rest may hold either, the counters are "
                    "unchanged: load a checkpoint again before training"
                ) from exc
    engine.step_count = counters["step_count"]
    optimizer.skipped_steps = counters["skipped_steps"]
    if counters["loss_scaler"] is not None:
        optimizer.scaler.load_state_dict(counters["loss_scaler"])
    optimizer.param_groups[0].update(counters["param_group"])
    engine.zero_grad()
    engine.state_restored()
    return counters["extra"]


class _UnitFile(ValueSource):
    """One unit's verified file as a source of values: flat slices read per piece (each into a
    buffer borrowed until the next read; ``Values.load`` uses a piece before the next)."""

    def __init__(self, ckpt: files.VerifiedCheckpoint, unit: Unit) -> None:
        self.ckpt, self.name = ckpt, _unit_file(unit)
        self.base = {FROZEN: unit.layout.trainable}

    def piece(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        base = self.base.get(kind, 0)
        return self.ckpt.read(self.name, kind, lo - base, hi - base)


def _apply_unit(ckpt: files.VerifiedCheckpoint, engine, run) -> None:
    """Stage (3) for one unit: the saved values into its homes, piece by piece."""
    engine.values.load(run.unit, _UnitFile(ckpt, run.unit))
    run.release()  # a gathered copy would be stale


def export(model: nn.Module, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes one consolidated safetensors file with every parameter (by its qualified name,
    tied ones under each name) and persistent buffer, usable without offload
    (``safetensors.torch.load_file`` then ``model.load_state_dict``). Written to a temp name,
    fsynced and renamed."""
    engine = _engine(model)
    engine.check_idle("export")
    path = Path(path)
    names: dict[nn.Parameter, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    entries = []
    for unit in engine.units:
        cache: dict = {}

        def produce(p, u=unit, cache=cache):
            if u.index not in cache:
                cache.clear()
                cache[u.index] = engine.full_values(u)
            yield cache[u.index][p].to(dtype)

        for seg in unit.layout.segments:
            for name in names[seg.param]:
                entries.append((name, dtype, list(seg.shape), lambda p=seg.param, f=produce: f(p)))
    for mname, module in model.named_modules():
        for bname, buf in module._buffers.items():
            if buf is None or bname in module._non_persistent_buffers_set:
                continue
            full = f"{mname}.{bname}" if mname else bname
            bdt = dtype if buf.is_floating_point() else buf.dtype
            if bdt in files.ST_DTYPES:
                entries.append((full, bdt, list(buf.shape), lambda b=buf, d=bdt: iter([b.to(d)])))
    tmp = path.with_name(path.name + ".tmp")
    files.write_safetensors(tmp, entries, metadata={"format": "pt", "producer": "offload"})
    os.replace(tmp, path)
    files.fsync_dir(path.parent if str(path.parent) else Path("."))
    return path
