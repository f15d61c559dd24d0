"""Sharded checkpoints and consolidated export.

Note: format and atomicity
    A checkpoint directory holds one ``unit_NNNNN.safetensors`` per unit (flat fp32 ``master``,
    ``exp_avg``, ``exp_avg_sq`` over the trainable prefix, and the ``frozen`` compute params)
    plus ``meta.json`` (layout, step counters, loss scale, hyperparameters and the caller's
    extra JSON). No pickle anywhere. Tensors are streamed piece by piece from wherever they live
    (NVMe-resident state is never pulled whole into RAM): the safetensors header is computed
    first from the known sizes, then each piece's bytes are appended.

    ``save_checkpoint(root, ...)`` writes ``root/.ckpt-...tmp``, fsyncs every file and the
    directory, renames it to ``root/ckpt-<step>-<ns>``, then atomically replaces the pointer file
    ``root/latest`` (temp name, fsync, rename) and only then deletes older checkpoints. A crash
    at any point leaves ``latest`` naming a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn as nn

from offload.homes.optim import KINDS
from offload.plan import Unit
from offload.runtime.values import FROZEN, ValueSource

FORMAT = "offload-checkpoint"
VERSION = 1
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_safetensors(
    path: Path,
    entries: list[tuple[str, torch.dtype, list[int], Callable[[], Iterable[torch.Tensor]]]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Writes a safetensors file whose tensors are produced piece by piece (in order)."""
    header: dict = {}
    offset = 0
    for name, dtype, shape, _ in entries:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, dtype, _shape, produce in entries:
            written = 0
            for piece in produce():
                piece = piece.detach().to("cpu", dtype).contiguous()
                f.write(piece.view(torch.uint8).numpy().tobytes())
                written += piece.numel() * piece.element_size()
            want = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
            if written != want:
                raise RuntimeError(
                    f"checkpoint: tensor '{name}' produced {written} bytes, expected {want}"
                )
        f.flush()
        os.fsync(f.fileno())


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


def save_checkpoint(
    directory: str | os.PathLike, model: nn.Module, optimizer, *, keep_last: int = 1, **extra
) -> Path:
    """Saves model and optimizer state under ``directory`` (see the module Note); returns the
    checkpoint's own directory. ``extra`` (JSON-serializable) comes back from load_checkpoint."""
    engine = _engine(model)
    engine.check_idle("save_checkpoint")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{engine.step_count:08d}-{time.time_ns()}"
    tmp = root / f".{name}.tmp"
    tmp.mkdir()
    try:
        values = engine.values
        for unit in engine.units:
            entries = []
            n, total = unit.layout.trainable, unit.layout.total
            for kind, dtype, numel in ((k, torch.float32, n) for k in KINDS) if n else ():
                entries.append((kind, dtype, [numel], _pieces_of(values, unit, kind)))
            if total > n:
                entries.append(
                    (FROZEN, engine.dtype, [total - n], _pieces_of(values, unit, FROZEN))
                )
            _write_safetensors(tmp / f"unit_{unit.index:05d}.safetensors", entries)
        group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "step_count": engine.step_count,
            "skipped_steps": optimizer.skipped_steps,
            "loss_scaler": optimizer.scaler.state_dict() if optimizer.scaler is not None else None,
            "param_group": {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()},
            "units": [_unit_meta(u) for u in engine.units],
            "extra": _to_json(extra),
        }
        with open(tmp / "meta.json", "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        final = root / name
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = root / "latest.tmp"
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / "latest")
    _fsync_dir(root)
    old = sorted(p for p in root.glob("ckpt-*") if p.is_dir() and p.name != name)
    for p in old[: max(0, len(old) - (keep_last - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def _pieces_of(values, unit: Unit, kind: str) -> Callable[[], Iterable[torch.Tensor]]:
    """The flat tensor ``kind`` of ``unit``, produced piece by piece from its owner."""
    return lambda: (values.flat(unit, kind, lo, hi) for lo, hi in values.pieces(unit, kind))


class _UnitFile(ValueSource):
    """One unit's checkpoint file as a source of values (flat slices, read per piece)."""

    def __init__(self, f, unit: Unit) -> None:
        self.f, self.base = f, {FROZEN: unit.layout.trainable}

    def piece(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        base = self.base.get(kind, 0)
        return self.f.get_slice(kind)[lo - base : hi - base]


def _resolve(directory: Path) -> Path:
    if (directory / "meta.json").exists():
        return directory
    pointer = directory / "latest"
    if not pointer.exists():
        raise FileNotFoundError(
            f"load_checkpoint: no checkpoint in '{directory}' (no 'latest' file or meta.json)"
        )
    ckpt = directory / pointer.read_text().strip()
    if not (ckpt / "meta.json").exists():
        raise FileNotFoundError(
            f"load_checkpoint: '{pointer}' names '{ckpt.name}', which is incomplete or missing"
        )
    return ckpt


def load_checkpoint(directory: str | os.PathLike, model: nn.Module, optimizer) -> dict:
    """Restores what :func:`save_checkpoint` wrote into a model wrapped with the same layout;
    returns the ``extra`` values."""
    from safetensors import safe_open  # noqa: PLC0415

    engine = _engine(model)
    engine.check_idle("load_checkpoint")
    ckpt = _resolve(Path(directory))
    meta = json.loads((ckpt / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"load_checkpoint: '{ckpt / 'meta.json'}' is not an offload checkpoint")
    saved_units = meta["units"]
    if len(saved_units) != len(engine.units):
        raise ValueError(
            f"load_checkpoint: checkpoint has {len(saved_units)} units, the model has "
            f"{len(engine.units)}; wrap the same model with the same wrap config"
        )
    for unit, saved in zip(engine.units, saved_units):
        if _unit_meta(unit) != saved:
            raise ValueError(
                f"load_checkpoint: unit '{unit.label}' differs from the checkpoint's "
                f"'{saved['name'] or '<root>'}' (parameters, shapes or order)"
            )
    for run in engine.runs:
        unit = run.unit
        with safe_open(str(ckpt / f"unit_{unit.index:05d}.safetensors"), framework="pt") as f:
            engine.values.load(unit, _UnitFile(f, unit))
        run.release()  # a gathered copy would be stale
    engine.step_count = int(meta["step_count"])
    optimizer.skipped_steps = int(meta["skipped_steps"])
    if optimizer.scaler is not None and meta.get("loss_scaler"):
        optimizer.scaler.load_state_dict(meta["loss_scaler"])
    for k, v in meta["param_group"].items():
        optimizer.param_groups[0][k] = tuple(v) if k == "betas" else v
    engine.zero_grad()
    return meta["extra"]


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
            if bdt in _ST_DTYPES:
                entries.append((full, bdt, list(buf.shape), lambda b=buf, d=bdt: iter([b.to(d)])))
    tmp = path.with_name(path.name + ".tmp")
    _write_safetensors(tmp, entries, metadata={"format": "pt", "producer": "offload"})
    os.replace(tmp, path)
    _fsync_dir(path.parent if str(path.parent) else Path("."))
    return path
