"""Sharded checkpoints and consolidated export: what of the engine goes into which file.

Note: format and atomicity
    A checkpoint directory holds one ``unit_NNNNN.safetensors`` per unit (flat fp32 ``master``,
    ``exp_avg``, ``exp_avg_sq`` over the trainable prefix, and the ``frozen`` compute params),
    ``buffers.safetensors`` (the persistent buffers, :func:`_buffers_file`) and ``meta.json``
    (layout, step counters, loss scale, hyperparameters, the undecayed parameters' names, the
    caller's extra JSON, and every file's size and SHA-256). No pickle anywhere. Tensors are
    streamed piece by piece from wherever they live (NVMe-resident state is never pulled whole
    into RAM). The files, checksums, the commit (temp directory, fsync, rename, ``latest``
    pointer) and the verifying reader live in :mod:`offload.api.checkpoint_files`; this module
    only knows which state goes where, and reads and writes it through the runtime's values
    (``offload.runtime.values``: each unit's file is a value source on load).

Note: many ranks, and another world size
    With more than one rank, ``save_checkpoint`` and ``load_checkpoint`` are collective (every
    rank calls them). Each rank writes its share: ``unit_NNNNN.rank_RRRRR.safetensors`` holds
    the rank's part of the trainable prefix (master, moments) and of the frozen suffix;
    ``meta.json`` records ``world`` and each unit's layout at that world size (``units``: the
    padded lengths and every parameter's offset). Rank 0 owns the directory: it creates the
    temp directory, gathers every rank's file records once each rank has fsynced its files, and
    only then writes ``meta.json`` and moves ``latest`` (Note: commit in
    ``checkpoint_files``); a rank that fails makes every rank raise and nothing is committed.

    A load at any world size (the same or another) maps this rank's pieces onto the saved
    ranks' files: the trainable prefix and the frozen suffix are packed the same way whatever
    the world size (only their padding differs, and padding is zero), so element ``i`` of a
    region is element ``i`` of the saved region, held by the saved rank whose share covers
    it. Each rank opens only the files its share overlaps and verifies only the blocks it reads
    (``checkpoint_files``' Note on verification), and the ranks agree before anything changes:
    every rank's verification and layout check is gathered, and if one refused the checkpoint,
    every rank raises and none has changed anything. Resuming at the same world size reads
    back exactly the bytes saved (bitwise). With one rank and a one-rank checkpoint the load is
    the one below, file by whole file.

Note: a load changes everything or nothing
    ``load_checkpoint`` runs in three stages: (1) verify the whole directory (schema, files,
    headers, checksums, streamed; nothing is changed), (2) compare its layout and counters with
    the model and optimizer (an error names the parameter and both shapes), (3) only then write
    the values, piece by piece, and last the counters and hyperparameters. What can still fail
    in (3) is IO of the model's own state (an EIO of the swap device): the error then says
    which unit was being written; earlier units hold the checkpoint's values.

Note: what a load leaves in host memory
    A resumed run must hold what a run never resumed holds (README, "Memory"), but glibc keeps
    freed memory where trimming gives back only part of it, and a load used to leave some in
    two such places (a 67M-parameter LLaMA in bf16 with "auto" buffers, 2026-12-05: RSS after
    each resumed step 45-67 MiB over the run never resumed, training peaks up to 32 MiB over
    the budget of 1008 MiB):

    - the checksum threads' buffers (8 MiB each) in those threads' malloc arenas, whose free
      top glibc keeps and ``malloc_trim`` does not give back: 16 MiB on two cores for good.
      They are anonymous mappings now (``checkpoint_files._sha256_of``).
    - holes in the main heap: the compute-dtype copy of each unit's master (25 MiB) left a hole
      that the next unit's copy did not fit, small blocks having been taken from it meanwhile,
      so the heap grew by a piece per unit (75 MiB over 4). The trim when the load returns gave
      their pages back, but the steps then spread over the larger heap and touched 36 MiB more
      of it than a run never resumed. The homes now convert as they write
      (``ParamHome.load_shard``) and the reads share one scratch buffer
      (``VerifiedCheckpoint.read``): a load does not grow the heap.

    The rest it frees (Python objects, a scratch below glibc's mmap threshold) is given back by
    the trim when it returns.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import torch
import torch.nn as nn

from offload.api import checkpoint_files as files
from offload.api.checkpoint_files import CheckpointError
from offload.api.optimizer import HYPER_ALLOWED, hyperparameter
from offload.dist import CollectiveError
from offload.homes.optim import KINDS
from offload.plan import Unit
from offload.runtime.safetensors import NAMES, write_file
from offload.runtime.values import FROZEN, ValueSource

__all__ = ["CheckpointError", "export", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger("offload.checkpoint")


def _unit_file(unit: Unit | int, rank: int = 0, world: int = 1) -> str:
    index = unit if isinstance(unit, int) else unit.index
    if world == 1:
        return f"unit_{index:05d}.safetensors"
    return f"unit_{index:05d}.rank_{rank:05d}.safetensors"


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


def _optimizer_of(engine, optimizer, what: str):
    """The optimizer ``offload.wrap`` returned with the model, also through a wrapper that
    holds it as ``.optimizer`` (accelerate's); another model's was taken (its hyperparameters
    and loss scale saved, or loaded into it, with this model's state)."""
    given = optimizer
    while getattr(optimizer, "_engine", None) is not engine and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if getattr(optimizer, "_engine", None) is not engine:
        raise ValueError(
            f"{what}: the optimizer ({type(given).__name__}) is not the one offload.wrap "
            "returned with this model; pass that one (model, optimizer = offload.wrap(...)); "
            "nothing was changed"
        )
    return optimizer


def _to_json(extra: dict) -> dict:
    """``extra`` as the JSON ``meta.json`` holds (tuples, non-string keys and Counters kept:
    ``checkpoint_files.encode_extra``)."""
    for key, value in extra.items():  # each, so that the error names the one that is not
        try:
            json.dumps(files.encode_extra(value))
        except (TypeError, ValueError, RecursionError) as exc:  # (a cycle: RecursionError)
            raise TypeError(
                f"save_checkpoint: extra value {key!r} is not JSON-serializable ({exc}); "
                "allowed: numbers, strings, bools, None, and lists, tuples and dicts of them, "
                "e.g. scheduler=sched.state_dict() (a tensor: .tolist())"
            ) from None
    return files.encode_extra(extra)


def path_given(
    what: str, path, cls: type[Exception], nothing: str, kind: str = "directory"
) -> Path:
    """``path`` as a Path; an empty one is refused: ``Path("")`` is the working directory, so
    ``save_checkpoint("")`` (an unset variable, say) wrote a checkpoint into it without a word,
    ``load_checkpoint("")`` read whatever was there, ``save_pretrained("")`` wrote the model's
    files among the working directory's, and ``export("")`` said only that '.' is a
    directory. ``kind`` says what is asked for: a directory, or a file."""
    if isinstance(path, (str, os.PathLike)):
        text = os.fspath(path)
        if isinstance(text, str) and not text.strip():
            here = " ('.' for the working directory)" if kind == "directory" else ""
            raise cls(
                f"{what}: {kind}: got {text!r}; allowed: a non-empty {kind} path{here}; {nothing}"
            )
    return Path(path)


def _check_keep_last(keep_last) -> None:
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(
            f"save_checkpoint: keep_last: got {keep_last!r}; allowed: an int >= 1, how many of "
            "the directory's checkpoints to keep, this one included (1, the default: only the "
            "new one); nothing was written"
        )


def _buffers_file(rank: int = 0, world: int = 1) -> str:
    """The file of the model's persistent buffers (BatchNorm's running statistics, say), by
    state-dict name, in the dtype the model holds them. Each rank's own with several ranks
    (they may differ, as under FSDP): a load at the same world size reads its rank's, at
    another rank 0's. A checkpoint written before they were kept has none: its load leaves the
    buffers as they are and says so."""
    return "buffers.safetensors" if world == 1 else f"buffers.rank_{rank:05d}.safetensors"


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(state-dict name, tensor)`` of every persistent buffer, in module order."""
    out = []
    for mname, module in model.named_modules():
        for bname, buf in module._buffers.items():
            if buf is not None and bname not in module._non_persistent_buffers_set:
                out.append((f"{mname}.{bname}" if mname else bname, buf))
    return out


def _buffer_entries(model: nn.Module) -> list[files.Entry]:
    """The buffers file's tensors; a dtype safetensors cannot hold is refused before anything
    is written."""
    entries = []
    for name, buf in persistent_buffers(model):
        if buf.dtype not in files.ST_DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in files.ST_DTYPES)
            raise TypeError(
                f"save_checkpoint: buffer {name} is {str(buf.dtype).removeprefix('torch.')}, "
                f"which a checkpoint cannot hold (it holds {allowed}); nothing was written"
            )
        produce = lambda b=buf: iter([b.detach().to("cpu").reshape(-1)])  # noqa: E731
        entries.append((name, buf.dtype, list(buf.shape), produce))
    return entries


def _buffer_tensors(model: nn.Module) -> dict[str, tuple[tuple[str, ...], list[int]]]:
    """What the buffers file must hold for ``model``: name -> (allowed dtype codes, shape);
    floating ones convert on load (a checkpoint of another compute dtype)."""
    floating = tuple(files.ST_DTYPES[d] for d in files.ST_DTYPES if d.is_floating_point)
    return {
        name: (floating if buf.is_floating_point() else (files.ST_DTYPES[buf.dtype],), [*buf.shape])
        for name, buf in persistent_buffers(model)
    }


def _buffers_listed(meta: dict, model: nn.Module, fname: str) -> bool:
    """Whether the checkpoint holds buffers; one written before they were kept, for a model
    that has some, is said (its load leaves them as they are)."""
    listed = fname in meta["files"]
    if not listed and persistent_buffers(model):
        logger.warning(
            "load_checkpoint: the checkpoint holds no buffers (written before offload kept "
            "them); the model's buffers (running statistics, say) are left as they are"
        )
    return listed


def _apply_buffers(ckpt: files.VerifiedCheckpoint, model: nn.Module, fname: str) -> None:
    with torch.no_grad():
        for name, buf in persistent_buffers(model):
            buf.copy_(ckpt.read(fname, name, 0, buf.numel()).view(buf.shape))


def _unit_entries(engine, unit: Unit) -> list[files.Entry]:
    """The tensors of one unit's file, each produced piece by piece from its owner."""
    values = engine.values
    (a, b), (c, d) = unit.layout.local_trainable, unit.layout.local_frozen  # this rank's share
    kinds = [(k, torch.float32, b - a) for k in (KINDS if b > a else ())]
    kinds += [(FROZEN, engine.dtype, d - c)] if d > c else []
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
    engine.check_readable("save_checkpoint")
    optimizer = _optimizer_of(engine, optimizer, "save_checkpoint")
    directory = path_given("save_checkpoint", directory, ValueError, "nothing was written")
    _check_keep_last(keep_last)
    extra = _to_json(extra)
    group = _param_groups(optimizer)
    buffers = _buffer_entries(model)
    name = files.checkpoint_name(engine.step_count, directory)
    if engine.comm.world > 1:
        return _save_ranks(directory, name, engine, optimizer, keep_last, extra, group, buffers)
    with files.CheckpointWriter(directory, name) as out:
        for unit in engine.units:
            out.add_file(_unit_file(unit), _unit_entries(engine, unit))
        if buffers:
            out.add_file(_buffers_file(), buffers)
        return out.commit(_meta(engine, optimizer, extra, group), keep_last)


def _param_groups(optimizer) -> list[dict]:
    """Each param group's hyperparameters as ``meta.json`` holds them (:func:`_param_group`)."""
    return [
        _param_group(g, f"save_checkpoint: optimizer.param_groups[{i}]")
        for i, g in enumerate(optimizer.param_groups)
    ]


def _param_group(group: dict, where: str) -> dict:
    """A param group's hyperparameters as ``meta.json`` holds them, checked before anything is
    written: what the update cannot take is refused (``optimizer.hyperparameter``), a
    one-element tensor (torch's optimizers take a tensor lr) is saved as its number, and a
    value JSON cannot hold, or a non-finite number (a load refuses it), is refused."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if key in HYPER_ALLOWED:
            hyperparameter(group, key, where)
        items = list(value) if isinstance(value, (tuple, list)) else [value]
        items = [x.item() if isinstance(x, torch.Tensor) and x.numel() == 1 else x for x in items]
        out[key] = items if isinstance(value, (tuple, list)) else items[0]
        try:
            json.dumps(out[key], allow_nan=False)
        except (TypeError, ValueError):
            raise ValueError(
                f"{where}[{key!r}]: got {value!r}; allowed: a finite number, a string, a bool, "
                "None or a list of them (what a checkpoint's meta.json holds); nothing was "
                "written"
            ) from None
    return out


def _meta(engine, optimizer, extra: dict, groups: list[dict]) -> dict:
    """``meta.json``'s counters. ``param_group`` holds the first param group's hyperparameters
    (the only one's, as every checkpoint before ``param_groups`` did); with several groups,
    ``param_groups`` holds each one's and the names of its parameters."""
    meta = {
        "dtype": str(engine.dtype).removeprefix("torch."),
        "world": engine.comm.world,
        "step_count": engine.step_count,
        "skipped_steps": optimizer.skipped_steps,
        "loss_scaler": optimizer.scaler.state_dict() if optimizer.scaler is not None else None,
        "param_group": groups[0],
        "units": [_unit_meta(u) for u in engine.units],
        "no_decay": [
            s.name
            for u in engine.units
            for s in u.layout.segments
            if s.trainable and s.param in engine.no_decay
        ],
        # the parameters whose own step count is not step_count (steps without a gradient)
        "param_steps": {
            s.name: engine.param_steps(s.param)
            for u in engine.units
            for s in u.layout.segments
            if s.trainable and s.param in engine.missed
        },
        "extra": extra,
    }
    if len(groups) > 1:
        name = {s.param: s.name for u in engine.units for s in u.layout.segments}
        meta["param_groups"] = [
            dict(h, params=[name[p] for p in g["params"]])
            for h, g in zip(groups, optimizer.param_groups, strict=True)
        ]
    return meta


def _saved_no_decay(path: Path, meta: dict, engine) -> frozenset | None:
    """The parameters the checkpoint's weight decay left alone (``optimizer.set_no_decay`` or
    the config's ``optimizer.no_decay``), by name; None for a checkpoint written before they
    were kept (its load leaves the optimizer's set as it is)."""
    names = meta.get("no_decay")
    if names is None:
        return None
    trainable = {s.name: s.param for u in engine.units for s in u.layout.segments if s.trainable}
    if not isinstance(names, list):
        raise files.meta_error(path, f"'no_decay' is {files.short_repr(names)}, not a list")
    for name in names:
        if not isinstance(name, str) or name not in trainable:
            raise files.meta_error(
                path,
                f"'no_decay' names {files.short_repr(name)}, which is no trainable parameter "
                "of the model",
            )
    return frozenset(trainable[n] for n in names)


def _saved_param_steps(path: Path, meta: dict, engine, step_count: int) -> dict:
    """The trainable parameters' own step counts where not ``step_count`` (the steps each got a
    gradient in), by name; none for a checkpoint written before they were kept."""
    saved = meta.get("param_steps", {})
    if not isinstance(saved, dict):
        raise files.meta_error(path, f"'param_steps' is {files.short_repr(saved)}, not a dict")
    trainable = {s.name: s.param for u in engine.units for s in u.layout.segments if s.trainable}
    out = {}
    for name, steps in saved.items():
        if name not in trainable:
            raise files.meta_error(
                path,
                f"'param_steps' names {files.short_repr(name)}, which is no trainable parameter "
                "of the model",
            )
        out[trainable[name]] = files.meta_int(path, steps, f"'param_steps'.{name!r}")
        if out[trainable[name]] > step_count:
            raise files.meta_error(
                path,
                f"'param_steps'.{name!r} is {steps}, above 'step_count' {step_count} (a "
                "parameter's steps with a gradient)",
            )
    return out


def _agree(comm, error: BaseException | None, what: str, payload=None, cls=RuntimeError) -> list:
    """Every rank says whether its part of ``what`` worked (and hands in ``payload``); raises
    on every rank if one failed (its own error on that rank, one naming it on the others);
    returns every rank's payload. A collective that failed is raised at once: the group cannot
    run another (each would wait the whole timeout again)."""
    if isinstance(error, CollectiveError):
        raise error
    said = comm.all_gather_object(
        (None if error is None else f"{type(error).__name__}: {error}", payload),
        f"every rank's outcome of {what}",
    )
    if error is not None:
        raise error
    for rank, (text, _) in enumerate(said):
        if text is not None:
            raise cls(f"{what}: rank {rank} failed ({text}); nothing was changed")
    return [p for _, p in said]


def _save_ranks(
    root: Path,
    name: str,
    engine,
    optimizer,
    keep_last: int,
    extra: dict,
    group: list[dict],
    buffers: list,
) -> Path:
    """The collective save (module Note on ranks): rank 0 owns the directory and commits once
    every rank's files are durable."""
    comm = engine.comm
    name = comm.all_gather_object(name, "the checkpoint's name")[0]  # rank 0's, for everyone
    owner = comm.rank == 0
    writer = error = None
    try:
        if owner:
            writer = files.CheckpointWriter(root, name)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        error = exc
    _agree(comm, error, "save_checkpoint")
    records: dict = {}
    try:
        if not owner:
            writer = files.CheckpointWriter(root, name, owner=False)
        for unit in engine.units:
            writer.add_file(_unit_file(unit, comm.rank, comm.world), _unit_entries(engine, unit))
        if buffers:
            writer.add_file(_buffers_file(comm.rank, comm.world), buffers)
        writer.sync()  # durable before this rank's records go to the owner
        records = {n: r.to_json() for n, r in writer.files.items()}
    except Exception as exc:  # noqa: BLE001
        error = exc
    final = None
    try:
        every = _agree(comm, error, "save_checkpoint", records)
        if owner:
            writer.files = {n: files.FileRecord.from_json(r) for rs in every for n, r in rs.items()}
            try:
                final = writer.commit(_meta(engine, optimizer, extra, group), keep_last)
            except Exception as exc:  # noqa: BLE001
                error = exc
        _agree(comm, error, "save_checkpoint (commit)")
    finally:
        if owner and writer is not None:
            writer.__exit__(None, None, None)  # removes the temp directory unless committed
    return final or root / name


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
    from offload.api.wrap import trim_host_heap  # noqa: PLC0415 (wrap imports this module)

    try:
        return _load_checkpoint(directory, model, optimizer)
    finally:
        # what it freed into glibc's heap stayed resident otherwise, up to 64 MiB (its trim
        # threshold, twice the dynamic mmap threshold): a resumed 325M LLaMA's run sat 51 MiB
        # higher in every later phase (module Note: what a load leaves in host memory)
        trim_host_heap()


def _load_checkpoint(directory: str | os.PathLike, model: nn.Module, optimizer) -> dict:
    engine = _engine(model)
    engine.check_idle("load_checkpoint", restoring=True)
    optimizer = _optimizer_of(engine, optimizer, "load_checkpoint")
    directory = path_given("load_checkpoint", directory, CheckpointError, "nothing was changed")
    if engine.comm.world > 1:
        return _load_ranks(directory, engine, optimizer)
    path = files.resolve(directory)
    if _saved_world(path, files.read_meta(path)) > 1:
        return _load_ranks(directory, engine, optimizer)
    with files.open_checkpoint(path) as ckpt:  # (1)
        tensors = {_unit_file(u): _unit_tensors(u) for u in engine.units}
        buffers = _buffers_listed(ckpt.meta, model, _buffers_file())
        if buffers:
            tensors[_buffers_file()] = _buffer_tensors(model)
        files.check_layout(ckpt, [_unit_meta(u) for u in engine.units], tensors)  # (2)
        counters = files.check_counters(
            ckpt, optimizer.param_groups, loss_scale=optimizer.scaler is not None
        )
        _check_group_members(ckpt.path, ckpt.meta, optimizer)
        counters["no_decay"] = _saved_no_decay(ckpt.path, ckpt.meta, engine)
        counters["param_steps"] = _saved_param_steps(
            ckpt.path, ckpt.meta, engine, counters["step_count"]
        )
        engine.restoring(f"load_checkpoint('{ckpt.path}')")  # until _apply_counters ends
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
        if buffers:
            _apply_buffers(ckpt, model, _buffers_file())
    return _apply_counters(engine, optimizer, counters)


def _apply_counters(engine, optimizer, counters: dict) -> dict:
    engine.set_param_steps(counters["step_count"], counters["param_steps"])
    optimizer.skipped_steps = counters["skipped_steps"]
    if counters["loss_scaler"] is not None:
        optimizer.scaler.load_state_dict(counters["loss_scaler"])
    for group, saved in zip(optimizer.param_groups, counters["param_groups"], strict=True):
        group.update(saved)
    engine.zero_grad()
    engine.state_restored()  # (a failed update's mixed state is replaced: set_no_decay may run)
    if counters["no_decay"] is not None:
        engine.set_no_decay(counters["no_decay"], "load_checkpoint")
    return counters["extra"]


def _check_group_members(path: Path, meta: dict, optimizer) -> None:
    """The checkpoint's param groups hold the parameters the optimizer's do (by name, in any
    order; one group: all of them), so each group's saved hyperparameters go to the same
    parameters."""
    saved = meta.get("param_groups")
    names = {s.param: s.name for u in optimizer._engine.units for s in u.layout.segments}
    mine = [sorted(names[p] for p in g["params"]) for g in optimizer.param_groups]
    theirs = None if saved is None else [sorted(map(str, g.get("params") or [])) for g in saved]
    if theirs is None and len(mine) == 1:
        return
    if theirs != mine:
        raise files.meta_error(
            path,
            f"its {1 if theirs is None else len(theirs)} param group(s) hold other parameters "
            f"than this optimizer's {len(mine)} (wrap's param_groups): load it into an "
            "optimizer wrapped with the same param_groups",
        )


def _saved_world(path: Path, meta: dict) -> int:
    """The world size a checkpoint was saved at (1 when it does not say)."""
    world = files.meta_int(path, meta.get("world", 1), "'world'")
    if world < 1:
        raise files.meta_error(path, f"'world' must be >= 1, got {world}")
    return world


def _regions(rec: dict) -> dict[str, tuple[int, int]]:
    """Kind -> the ``[begin, end)`` of its region in a unit record."""
    t, total = rec["trainable"], rec["total"]
    return {**dict.fromkeys(KINDS, (0, t)), FROZEN: (t, total)}


def _relative(rec: dict) -> dict:
    """A unit record with offsets relative to their region and no padded lengths: what must
    be equal between a checkpoint and a model at any world size (module Note on ranks)."""
    t = rec["trainable"]
    params = [
        [n, off - (0 if tr else t), numel, shape, tr] for n, off, numel, shape, tr in rec["params"]
    ]
    return {"name": rec["name"], "trainable": None, "total": None, "params": params}


class _Saved:
    """The layout a checkpoint was saved with (world size, each unit's padded regions), checked
    against the model's, and the reads that give this rank's pieces (module Note on ranks)."""

    def __init__(self, path: Path, meta: dict, engine) -> None:
        self.path = path
        self.world = _saved_world(path, meta)
        saved = meta.get("units")
        mine = [_unit_meta(u) for u in engine.units]
        if not isinstance(saved, list) or len(saved) != len(mine):
            n = len(saved) if isinstance(saved, list) else files.short_repr(saved)
            raise files.meta_error(
                path,
                f"the checkpoint has {n} units, the model has {len(mine)}; wrap the same model "
                "with the same wrap config",
            )
        self.units: list[dict] = []
        for i, (m, rec) in enumerate(zip(mine, saved)):
            self._check_unit(i, m, rec)
            self.units.append(rec)

    def _check_unit(self, i: int, mine: dict, rec) -> None:
        path, world = self.path, self.world
        ok = isinstance(rec, dict) and isinstance(rec.get("params"), list)
        ok = ok and all(
            isinstance(p, list) and len(p) == 5 and files._is_int(p[1]) and files._is_int(p[2])
            for p in rec["params"]
        )
        t, total = (rec.get("trainable"), rec.get("total")) if ok else (None, None)
        ok = ok and files._is_int(t) and files._is_int(total) and 0 <= t <= total
        ok = ok and t % world == 0 and (total - t) % world == 0
        if not ok:
            raise files.meta_error(
                path, f"the record of unit {i} is malformed for a world of {world} ranks"
            )
        for name, off, numel, shape, tr in rec["params"]:
            lo, hi = (0, t) if tr is True else (t, total)
            if not (isinstance(shape, list) and lo <= off and off + numel <= hi):
                raise files.meta_error(
                    path, f"parameter {files.short_repr(name)} lies outside its region"
                )
        if _relative(rec) != _relative(mine):
            files._unit_difference(path, i, _relative(mine), _relative(rec))

    def file(self, unit: int, rank: int) -> str:
        return _unit_file(unit, rank, self.world)

    def reads(self, unit: Unit, kind: str, lo: int, hi: int, mine_regions) -> list:
        """``(file, tensor, first, end, at)``: elements ``[first, end)`` of ``tensor`` in
        ``file`` go to element ``at`` of the model's piece ``[lo, hi)`` of ``kind``."""
        here = mine_regions[kind][0]
        begin, end = _regions(self.units[unit.index])[kind]
        a, b = lo - here, min(hi - here, end - begin)  # region-relative; beyond: zero padding
        share = (end - begin) // self.world
        out = []
        for r in range(a // share if share else 0, self.world):
            s0, s1 = r * share, (r + 1) * share
            x, y = max(a, s0), min(b, s1)
            if x >= y:
                break
            out.append((self.file(unit.index, r), kind, x - s0, y - s0, x - a))
        return out

    def tensors(self, unit: int) -> dict[str, tuple[tuple[str, ...], list[int]]]:
        """What each of the unit's saved files holds: name -> (allowed dtypes, shape)."""
        begin_end = _regions(self.units[unit])
        out = {}
        for kind in (*KINDS, FROZEN):
            begin, end = begin_end[kind]
            if end > begin:
                dtypes = ("F32",) if kind != FROZEN else ("F32", "BF16", "F16")
                out[kind] = (dtypes, [(end - begin) // self.world])
        return out


def _load_plan(engine, saved: _Saved) -> dict[tuple[int, str, int], list]:
    """(unit, kind, piece start) -> the reads of every piece this rank loads."""
    out = {}
    for unit in engine.units:
        mine = _regions(_unit_meta(unit))
        for kind in (*KINDS, FROZEN):
            for lo, hi in engine.values._load_pieces(unit, kind):
                out[(unit.index, kind, lo)] = saved.reads(unit, kind, lo, hi, mine)
    return out


def _needs(plan: dict) -> dict:
    """File -> a function giving the byte ranges this rank reads of it (from its header)."""
    spans: dict[str, list] = {}
    for reads in plan.values():
        for fname, tensor, first, end, _ in reads:
            spans.setdefault(fname, []).append((tensor, first, end))

    def ranges_of(fname, tensors):
        out = []
        for tensor, first, end in spans[fname]:
            info = tensors.get(tensor)
            if info is not None:
                size = info.dtype.itemsize
                out.append((info.begin + first * size, info.begin + end * size))
        return out

    return {f: ranges_of for f in spans}


def _check_files(ckpt: files.VerifiedCheckpoint, saved: _Saved, plan: dict) -> None:
    """Every file this rank reads holds what its unit's saved layout says."""
    by_file = {}
    for (index, _, _), reads in plan.items():
        for fname, *_ in reads:
            by_file[fname] = index
    for fname, index in sorted(by_file.items()):
        _check_holds(ckpt, fname, saved.tensors(index), "its saved layout")


def _check_holds(ckpt: files.VerifiedCheckpoint, fname: str, want: dict, who: str) -> None:
    """File ``fname`` holds exactly ``want``: name -> (allowed dtype codes, shape)."""
    have = {t: (files.ST_DTYPES[i.dtype], list(i.shape)) for t, i in ckpt.tensors(fname).items()}
    if set(have) != set(want) or any(
        have[t][1] != want[t][1] or have[t][0] not in want[t][0] for t in want
    ):
        held = {t: {"dtype": d, "shape": sh} for t, (d, sh) in have.items()}
        needed = {t: {"dtype": "|".join(d), "shape": sh} for t, (d, sh) in want.items()}
        raise files._fail(
            ckpt.path / fname,
            f"holds {files._describe(held)}; {who} needs {files._describe(needed)}",
        )


def _whole(fname: str, tensors: dict) -> list[tuple[int, int]]:
    """The byte ranges of every tensor of a file (``open_checkpoint``'s ``need``)."""
    return [(i.begin, i.begin + i.numel * i.dtype.itemsize) for i in tensors.values()]


class _Reads(ValueSource):
    """This rank's pieces, each read from the byte ranges of the saved ranks' files that
    hold it (zero where the saved layout has no element: padding)."""

    def __init__(self, ckpt: files.VerifiedCheckpoint, plan: dict) -> None:
        self.ckpt, self.plan = ckpt, plan

    def piece(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        reads = self.plan.get((unit.index, kind, lo))
        if reads is None:
            return None
        out = None
        for fname, tensor, first, end, at in reads:
            part = self.ckpt.read(fname, tensor, first, end)
            if out is None:
                out = torch.zeros(hi - lo, dtype=part.dtype)
            out[at : at + end - first].copy_(part)
        return out if out is not None else torch.zeros(hi - lo)


def _load_ranks(root: Path, engine, optimizer) -> dict:
    """The load at any world size (module Note on ranks); collective with several ranks."""
    comm = engine.comm
    ckpt = error = None
    counters = plan = buffers = None
    try:
        path = files.resolve(root)
        paths = comm.all_gather_object(str(path), "the checkpoint to load")
        if len(set(paths)) > 1:
            raise CheckpointError(
                f"load_checkpoint: the ranks found different checkpoints in '{root}' "
                f"({', '.join(sorted(set(paths)))}); is a save running?"
            )
        meta = files.read_meta(path)
        saved = _Saved(path, meta, engine)  # (2), the layout
        plan = _load_plan(engine, saved)
        need = _needs(plan)
        buffers = _buffers_file(comm.rank if saved.world == comm.world else 0, saved.world)
        if not _buffers_listed(meta, engine.model, buffers):
            buffers = None
        else:
            need[buffers] = _whole
        ckpt = files.open_checkpoint(path, need=need)  # (1), what this rank reads
        _check_files(ckpt, saved, plan)
        if buffers:
            _check_holds(ckpt, buffers, _buffer_tensors(engine.model), "the model")
        counters = files.check_counters(
            ckpt, optimizer.param_groups, loss_scale=optimizer.scaler is not None
        )
        _check_group_members(path, meta, optimizer)
        counters["no_decay"] = _saved_no_decay(path, meta, engine)
        counters["param_steps"] = _saved_param_steps(path, meta, engine, counters["step_count"])
    except Exception as exc:  # noqa: BLE001 - every rank hears of it before anything changes
        error = exc
    try:
        _agree(comm, error, "load_checkpoint", cls=CheckpointError)
    except BaseException:
        if ckpt is not None:
            ckpt.close()
        raise
    with ckpt:
        source = _Reads(ckpt, plan)
        engine.restoring(f"load_checkpoint('{ckpt.path}')")  # until _apply_counters ends
        for run in engine.runs:  # (3)
            try:
                engine.values.load(run.unit, source)
                run.release()
            except Exception as exc:
                raise RuntimeError(
                    f"load_checkpoint: writing unit '{run.unit.label}' from '{ckpt.path}' failed "
                    f"after the checkpoint was verified ({exc}); load a checkpoint again before "
                    "training"
                ) from exc
        if buffers:
            _apply_buffers(ckpt, engine.model, buffers)
    return _apply_counters(engine, optimizer, counters)


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


class UnitValues:
    """Each unit's whole current values for a file written by rank 0 (``export``,
    ``save_pretrained`` with ranks), one unit held at a time. With several ranks reading a unit
    is a collective: every rank reads every unit in unit order (:func:`written_by_rank0`)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._held: dict[int, dict] = {}
        self._read: list[int] = []  # units read so far, in order

    def of(self, param: nn.Parameter, unit: Unit) -> torch.Tensor:
        if unit.index not in self._held:
            if unit.index in self._read and self.engine.comm.world > 1:
                # the other ranks gather each unit once, in order: a second gather would not
                # match theirs (a writer must ask for the units' tensors in unit order)
                raise RuntimeError(f"{unit.label}'s values asked for again, out of unit order")
            self._held.clear()  # the previous unit goes before the next is gathered
            self._held[unit.index] = self.engine.full_values(unit)
            self._read.append(unit.index)
        return self._held[unit.index][param]

    def read_the_rest(self) -> None:
        """The reads rank 0 has not asked for (all of them on the other ranks)."""
        self._held.clear()
        for unit in self.engine.units:
            if unit.layout.segments and unit.index not in self._read:
                self.engine.full_values(unit)


def written_by_rank0(engine, what: str, write) -> None:
    """``write(values)`` on rank 0 with a :class:`UnitValues`; with several ranks the others
    take part in its gathers, and every rank raises if rank 0 failed."""
    comm = engine.comm
    values = UnitValues(engine)
    error = None
    if comm.rank == 0:
        try:
            write(values)
        except Exception as exc:  # noqa: BLE001 - with one rank it is raised as it is
            if comm.world == 1:
                raise
            error = exc
    if comm.world > 1:
        if isinstance(error, CollectiveError):
            raise error  # (as in _agree: no more gathers on a group that timed out)
        values.read_the_rest()
        _agree(comm, error, what)


def check_float_dtype(what: str, dtype, none: str = "") -> None:
    """``dtype`` is a floating dtype a safetensors file holds (or None where ``none`` says what
    it means): an integer one wrote every weight truncated without a word, a string failed
    with "'str' object has no attribute 'itemsize'"."""
    floating = [d for d in NAMES if d.is_floating_point]
    if (dtype is None and none) or (isinstance(dtype, torch.dtype) and dtype in floating):
        return
    allowed = ([f"None ({none})"] if none else []) + [str(d) for d in floating]
    raise ValueError(f"{what}: dtype={dtype!r}; allowed: {', '.join(allowed)}")


def _check_file_path(path: Path) -> None:
    """``path`` can take export's file (checked before anything is gathered or written: the
    rename at the end failed on a directory, after the whole model had streamed out)."""
    if path.is_dir():
        raise IsADirectoryError(
            errno.EISDIR,
            "is a directory; export writes one file: give its path, e.g. "
            f"'{path / 'model.safetensors'}' (nothing was written)",
            str(path),
        )
    if not path.parent.is_dir():
        raise FileNotFoundError(
            errno.ENOENT,
            f"the directory of '{path}' does not exist or is not a directory; create it first "
            "(nothing was written)",
            str(path.parent),
        )


def export(model: nn.Module, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes one consolidated safetensors file with every parameter (by its qualified name,
    tied ones under each name) and persistent buffer, usable without offload
    (``safetensors.torch.load_file`` then ``model.load_state_dict``). Written to a temp name,
    fsynced and renamed; streamed one unit at a time (RAM: the largest unit).

    With several ranks it is collective: every rank gathers each unit's values with the
    others, rank 0 writes the file (the others write nothing) and every rank returns ``path``
    once it is in place, or raises if rank 0 failed."""
    engine = _engine(model)
    engine.check_readable("export")
    check_float_dtype("export", dtype)
    engine.watch.check_in_model("export", pieces=True)
    for full, buf in persistent_buffers(model):  # (one safetensors cannot hold was dropped)
        if not buf.is_floating_point() and buf.dtype not in NAMES:
            allowed = ", ".join(
                str(d).removeprefix("torch.") for d in NAMES if not d.is_floating_point
            )
            raise TypeError(
                f"export: buffer {full} is {str(buf.dtype).removeprefix('torch.')}, which "
                f"safetensors cannot hold (it holds the floating dtypes and {allowed}); "
                "nothing was written"
            )
    path = path_given("export", path, ValueError, "nothing was written", kind="file")
    names: dict[nn.Parameter, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)

    def write(values: UnitValues) -> None:
        _check_file_path(path)
        entries = []
        for unit in engine.units:
            for seg in unit.layout.segments:
                for name in names[seg.param]:
                    produce = lambda p=seg.param, u=unit: iter([values.of(p, u).to(dtype)])  # noqa: E731
                    entries.append((name, dtype, list(seg.shape), produce))
        for full, buf in persistent_buffers(model):
            bdt = dtype if buf.is_floating_point() else buf.dtype
            entries.append((full, bdt, list(buf.shape), lambda b=buf, d=bdt: iter([b.to(d)])))
        write_file(path, entries, metadata={"format": "pt", "producer": "offload"})

    written_by_rank0(engine, "export", write)
    return path
