"""A load restores everything or changes nothing: each kind of damage to a checkpoint is found
before anything is written, the error names the file (or the parameter and both shapes) and
says what is wrong, and every tensor of the model, the optimizer and the NVMe swap state is
bitwise what it was before the failed load.

The model is wrapped with params and optimizer state on NVMe, so the state compared includes
the swap files' bytes and the compute params that live only on NVMe.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from engine_models import DIM, batches, make_model, placement_config, train_wrapped

import offload
from offload.api.checkpoint_files import (
    CheckpointError,
    CheckpointNotFoundError,
    seal_meta,
)
from offload.api.wrap import engine_of
from offload.io import faults
from offload.runtime.phase import PhaseError


# --------------------------------------------------------------------------- state snapshot
def _swap_files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ("nvme_p" in p.parts or "nvme_o" in p.parts)
    }


def _engine_state(model) -> dict[str, torch.Tensor]:
    """Every piece of the engine's own state, read where it lives (the NVMe-resident compute
    params included, which model.state_dict() does not show: it reports the fp32 masters)."""
    engine = engine_of(model)
    out = {}
    for unit in engine.units:
        for lo, hi in engine.plan.pieces(unit):
            out[f"params.u{unit.index}.{lo}"] = engine.params.read(unit, lo, hi)
        for lo, hi in engine.optim.pieces(unit):
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                out[f"{kind}.u{unit.index}.{lo}"] = engine.optim.read(unit, kind, lo, hi)
    return out


def snapshot(model, opt, root: Path) -> dict:
    sd = opt.state_dict()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt_state": {
            (i, k): v.clone() for i, entry in sd["state"].items() for k, v in entry.items()
        },
        "opt_groups": sd["param_groups"],
        "opt_counters": sd["offload"],
        "engine": _engine_state(model),
        "grads": [p.grad for p in model.parameters()],
        "swap": _swap_files(root),
    }


def assert_same(before: dict, after: dict) -> None:
    assert set(before["model"]) == set(after["model"])
    for k, v in before["model"].items():
        assert torch.equal(v, after["model"][k]), f"model.state_dict()['{k}'] changed"
    assert set(before["opt_state"]) == set(after["opt_state"])
    for k, v in before["opt_state"].items():
        assert torch.equal(v, after["opt_state"][k]), f"optimizer state {k} changed"
    assert before["opt_groups"] == after["opt_groups"]
    assert before["opt_counters"] == after["opt_counters"]
    assert set(before["engine"]) == set(after["engine"])
    for k, v in before["engine"].items():
        assert torch.equal(v, after["engine"][k]), f"engine state '{k}' changed"
    assert all(g is None for g in after["grads"])
    assert before["swap"] == after["swap"], "swap files changed"


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A model trained past its checkpoint: every successful load would change its state."""
    root = tmp_path_factory.mktemp("faults")
    model, opt = offload.wrap(make_model(), placement_config("nvme", "nvme", root))
    data = batches(6)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train_wrapped(model, opt, data, 2, 1, 1.0, sched=sched)
    offload.save_checkpoint(root / "ck", model, opt, note="at step 2")
    train_wrapped(model, opt, data, 4, 1, 1.0, start=2, sched=sched)
    offload.save_checkpoint(root / "now", model, opt)  # puts the model back after a failure
    # a model with one parameter of another shape saves the checkpoint of the shape test
    other, other_opt = offload.wrap(
        make_model(huge_rows=2999), placement_config("none", "cpu", root / "other")
    )
    train_wrapped(other, other_opt, data, 1, 1, 0.0)
    offload.save_checkpoint(root / "other_ck", other, other_opt)
    other_opt.close()
    before = snapshot(model, opt, root)
    yield {"root": root, "model": model, "opt": opt, "before": before}
    opt.close()


def check_unchanged(world) -> None:
    assert_same(world["before"], snapshot(world["model"], world["opt"], world["root"]))


@pytest.fixture
def world(shared):
    """The shared model; put back after a test that changed it, so that one broken check
    fails one test, not every test after it."""
    yield shared
    try:
        check_unchanged(shared)
    except AssertionError:
        offload.load_checkpoint(shared["root"] / "now", shared["model"], shared["opt"])
        check_unchanged(shared)


def _copy(world, tmp_path: Path, src: str = "ck") -> tuple[Path, Path]:
    """A private copy of a saved checkpoint root; returns (root, the checkpoint directory)."""
    dst = tmp_path / "ck"
    shutil.copytree(world["root"] / src, dst)
    return dst, dst / (dst / "latest").read_text().strip()


def _reseal(ckpt: Path, edit) -> None:
    """Edits meta.json and seals it again, as a writer with a bug would: only the checks
    behind the seal can catch it."""
    meta = json.loads((ckpt / "meta.json").read_text())
    edit(meta)
    (ckpt / "meta.json").write_text(json.dumps(seal_meta(meta)))


def _header_len(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))


UNIT = "unit_00004.safetensors"  # the largest file
CORRUPT = "SHA-256 is .*: the file is corrupt or not the one saved"
V1 = r"format version 1 \(written before checkpoints carried checksums"


def _truncate(ck):
    p = ck / UNIT
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip_data(ck):
    p = ck / "unit_00002.safetensors"
    _flip(p, 8 + _header_len(p) + 1000)


def _flip_last_byte(ck):
    p = ck / UNIT
    _flip(p, p.stat().st_size - 1)


def _break_header_json(ck):
    p = ck / UNIT
    raw = bytearray(p.read_bytes())
    raw[8 + 20 : 8 + 24] = b"\x00}\x00{"
    p.write_bytes(bytes(raw))


def _break_header_length(ck):
    p = ck / UNIT
    raw = bytearray(p.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 40)
    p.write_bytes(bytes(raw))


def _header_names_other_shape(ck):
    # a consistent but different header of the same length: "[96256]" -> "[96255]"
    p = ck / UNIT
    raw = p.read_bytes()
    n = _header_len(p)
    header = raw[8 : 8 + n].replace(b"[96256]", b"[96255]", 1)
    p.write_bytes(raw[:8] + header + raw[8 + n :])


def _swap_files_same_size(ck):
    a, b = ck / "unit_00002.safetensors", ck / "unit_00003.safetensors"
    ra, rb = a.read_bytes(), b.read_bytes()
    assert len(ra) == len(rb)
    a.write_bytes(rb)
    b.write_bytes(ra)


def _extra_file(ck):
    (ck / "notes.txt").write_text("hello")


def _meta_truncated(ck):
    p = ck / "meta.json"
    p.write_bytes(p.read_bytes()[:-40])


def _meta_edited(ck):
    meta = json.loads((ck / "meta.json").read_text())
    meta["step_count"] = 1  # plausible, and wrong: only the seal tells
    (ck / "meta.json").write_text(json.dumps(meta, indent=1))


def _meta_not_object(ck):
    (ck / "meta.json").write_text("[1, 2, 3]")


def _meta_wrong_checksum(ck):
    def edit(m):
        m["files"][UNIT]["sha256"] = "0" * 64

    _reseal(ck, edit)


def _meta_wrong_size(ck):
    def edit(m):
        m["files"][UNIT]["size"] += 8

    _reseal(ck, edit)


def _meta_step_count_string(ck):
    _reseal(ck, lambda m: m.update(step_count="2"))


def _meta_huge_lr(ck):
    _reseal(ck, lambda m: m["param_group"].update(lr=10**400))


def _meta_lists_missing_file(ck):
    def edit(m):
        m["files"]["unit_00099.safetensors"] = dict(m["files"][UNIT])

    _reseal(ck, edit)


def _meta_version_1(ck):
    meta = json.loads((ck / "meta.json").read_text())
    meta["version"] = 1
    (ck / "meta.json").write_text(json.dumps(meta))


def _meta_path_escape(ck):
    def edit(m):
        m["files"]["../x.safetensors"] = m["files"].pop(UNIT)

    _reseal(ck, edit)


CASES = {
    "truncated unit file": (_truncate, UNIT, r"bytes, meta.json records \d+ \(truncated"),
    "deleted unit file": (lambda ck: (ck / UNIT).unlink(), UNIT, "is missing"),
    "extra file": (_extra_file, "notes.txt", "not listed in meta.json"),
    "flipped data byte": (_flip_data, "unit_00002", CORRUPT),
    "flipped last byte": (_flip_last_byte, UNIT, CORRUPT),
    "two files swapped": (_swap_files_same_size, "unit_00002", CORRUPT),
    "corrupt header JSON": (_break_header_json, UNIT, "safetensors header is not valid JSON"),
    "corrupt header length": (_break_header_length, UNIT, "header: length 1099511627776"),
    "header shape edited": (_header_names_other_shape, UNIT, "tensor 'master' spans bytes"),
    "meta.json truncated": (_meta_truncated, "meta.json", "the file is not valid JSON"),
    "meta.json not an object": (_meta_not_object, "meta.json", "is not an offload checkpoint"),
    "meta.json edited": (_meta_edited, "meta.json", "meta_sha256.* was modified or is corrupt"),
    "meta.json wrong checksum": (_meta_wrong_checksum, UNIT, "SHA-256 is .* records 0000"),
    "meta.json wrong size": (_meta_wrong_size, UNIT, "bytes, meta.json records"),
    "meta.json bad type": (_meta_step_count_string, "meta.json", "'step_count' must be an int"),
    "meta.json huge number": (_meta_huge_lr, "meta.json", "'lr' must be a finite number"),
    "meta.json lists a missing file": (_meta_lists_missing_file, "unit_00099", "is missing"),
    "meta.json version 1": (_meta_version_1, "meta.json", V1),
    "meta.json escapes": (_meta_path_escape, "meta.json", "'../x.safetensors', which is not"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_checkpoint_changes_nothing(world, tmp_path, case):
    damage, names, what = CASES[case]
    root, ck = _copy(world, tmp_path)
    damage(ck)
    with pytest.raises(CheckpointError, match=f"'[^']*{names}[^']*'.*{what}") as err:
        offload.load_checkpoint(root, world["model"], world["opt"])
    assert str(ck) in str(err.value) or str(root) in str(err.value)
    check_unchanged(world)


def test_missing_meta_and_bad_pointer_change_nothing(world, tmp_path):
    root, ck = _copy(world, tmp_path)
    (ck / "meta.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"names 'ckpt-.*incomplete or missing"):
        offload.load_checkpoint(root, world["model"], world["opt"])
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in .*no 'latest' file"):
        offload.load_checkpoint(ck, world["model"], world["opt"])
    (root / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match=r"latest': names '../../etc', which is not"):
        offload.load_checkpoint(root, world["model"], world["opt"])
    check_unchanged(world)


def test_shape_mismatch_names_parameter_and_both_shapes(world, tmp_path):
    root, _ = _copy(world, tmp_path, src="other_ck")
    with pytest.raises(
        CheckpointError,
        match=r"meta.json': parameter 'huge.table' has shape \[2999, 32\] in the checkpoint "
        r"and \[3000, 32\] in the model",
    ):
        offload.load_checkpoint(root, world["model"], world["opt"])
    check_unchanged(world)


def test_intact_copy_loads_and_the_snapshot_sees_it(world, tmp_path):
    """The control: the same comparison does see a load (so the tests above can fail), and
    every loaded tensor is the saved one (the `world` fixture puts the model back)."""
    root, _ = _copy(world, tmp_path)
    model, opt = world["model"], world["opt"]
    fresh, fresh_opt = offload.wrap(make_model(), placement_config("nvme", "nvme", tmp_path))
    try:
        assert offload.load_checkpoint(root, fresh, fresh_opt) == {"note": "at step 2"}
        expected = snapshot(fresh, fresh_opt, tmp_path)
    finally:
        fresh_opt.close()
    assert offload.load_checkpoint(root, model, opt) == {"note": "at step 2"}
    after = snapshot(model, opt, world["root"])
    with pytest.raises(AssertionError):
        assert_same(world["before"], after)
    for part in ("model", "engine"):
        for k, v in expected[part].items():
            assert torch.equal(v, after[part][k]), (part, k)
    assert after["opt_counters"] == {
        "param_order": "model.parameters",
        "step_count": 2,
        "skipped_steps": 0,
        "no_decay": [],
    }
    assert after["opt_groups"] == expected["opt_groups"]


def test_swap_write_error_during_apply_is_reported(tmp_path):
    """What verification cannot rule out: the swap device failing while values are written.
    The error says so and names the unit; the counters are untouched; a second load, once the
    device works, restores everything. (Whether the store then refuses the shard whose write
    failed depends on whether the failed write was the load's own or the write-back of a
    dirty cached copy that it superseded.)"""
    model, opt = offload.wrap(make_model(), placement_config("nvme", "nvme", tmp_path))
    data = batches(4)
    train_wrapped(model, opt, data, 1, 1, 0.0)
    offload.save_checkpoint(tmp_path / "ck", model, opt)
    saved = snapshot(model, opt, tmp_path)
    train_wrapped(model, opt, data, 3, 1, 0.0, start=1)
    opt.synchronize()  # the last step's background writes are done: the fault hits the load
    faults.inject(errno.EIO, count=1, op="write")
    try:
        with pytest.raises(
            RuntimeError, match=r"writing unit '[^']+' from .* failed after the checkpoint was "
        ) as err:
            offload.load_checkpoint(tmp_path / "ck", model, opt)
    finally:
        faults.clear()
    assert isinstance(err.value.__cause__, OSError)
    assert engine_of(model).step_count == 3
    for refused in (opt.step, lambda: offload.save_checkpoint(tmp_path / "ck2", model, opt)):
        with pytest.raises(PhaseError, match=r"load_checkpoint\('.*ck.*'\) stopped part way"):
            refused()  # the units hold a mix of the checkpoint's values and their own
    offload.load_checkpoint(tmp_path / "ck", model, opt)
    after = snapshot(model, opt, tmp_path)
    for part in ("model", "engine", "opt_state"):
        for k, v in saved[part].items():
            assert torch.equal(v, after[part][k]), (part, k)
    assert after["opt_counters"] == saved["opt_counters"]
    opt.close()


@pytest.mark.parametrize("kind", ["load_checkpoint", "optimizer.load_state_dict", "model"])
def test_a_load_stopped_part_way_refuses_steps_and_saves_until_a_whole_one(tmp_path, kind):
    """A load writes the units' state one unit after another. Stopped part way (a Ctrl-C in
    a notebook; an error, which ``load_checkpoint`` names), the units held a mix of the loaded
    values and their own, and the next cell's steps trained on it, its saves wrote it. Now a
    step and a save say which load stopped, until a whole load ends; the whole load then
    gives the loaded values back and training goes on. Forwards (an evaluation) and
    ``state_dict()`` read the mix as well, and are refused too (they ran until 2026-12-07)."""
    from offload.runtime.values import Values

    model, opt = offload.wrap(make_model(), placement_config("nvme", "nvme", tmp_path))
    data = batches(4)
    try:
        train_wrapped(model, opt, data, 1, 1, 0.0)
        offload.save_checkpoint(tmp_path / "ck", model, opt)
        saved_model = {k: v.clone() for k, v in model.state_dict().items()}
        saved_opt = opt.state_dict()
        train_wrapped(model, opt, data, 2, 1, 0.0, start=1)

        def load() -> None:
            if kind == "load_checkpoint":
                offload.load_checkpoint(tmp_path / "ck", model, opt)
            elif kind == "optimizer.load_state_dict":
                opt.load_state_dict(saved_opt)
            else:
                model.load_state_dict(saved_model)

        real, calls = Values.load, []

        def stopped(self, unit, source):
            calls.append(unit.index)
            if len(calls) == 2:  # the first unit is written, the second not
                raise KeyboardInterrupt
            return real(self, unit, source)

        Values.load = stopped
        try:
            with pytest.raises(KeyboardInterrupt):
                load()
        finally:
            Values.load = real
        what = {"model": r"model\.load_state_dict\(\)", "load_checkpoint": r"load_checkpoint\("}
        match = what.get(kind, r"optimizer\.load_state_dict\(\)") + ".* stopped part way"
        block = model.blocks[0]
        reads = (
            lambda: model(data[0][:, :-1]),  # an evaluation's forward
            lambda: block(torch.zeros(1, 4, DIM)),  # a part's, called outside the model
            model.state_dict,
            block.state_dict,
        )
        saves = (opt.step, lambda: offload.save_checkpoint(tmp_path / "ck2", model, opt))
        for refused in (*saves, *reads):
            with pytest.raises(PhaseError, match=match):
                refused()
        assert not (tmp_path / "ck2").exists()
        load()  # whole this time
        now = model.state_dict()
        if kind != "optimizer.load_state_dict":
            assert all(torch.equal(now[k], v) for k, v in saved_model.items())
        train_wrapped(model, opt, data, 1, 1, 0.0, start=3)  # trains again
        offload.save_checkpoint(tmp_path / "ck2", model, opt)
    finally:
        opt.close()


def test_a_full_disk_during_a_save_names_the_file(tmp_path, monkeypatch):
    """A full disk raised a bare "[Errno 28] No space left on device": no path in the error,
    unlike offload's other IO errors. It now names the file and what to do; the previous
    checkpoint stays the latest."""
    from offload.api import checkpoint_files  # noqa: PLC0415

    model, opt = offload.wrap(make_model(), placement_config("cpu", "cpu", tmp_path))
    first = offload.save_checkpoint(tmp_path / "ck", model, opt)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_files.os, "fsync", full)
    with pytest.raises(OSError) as err:
        offload.save_checkpoint(tmp_path / "ck", model, opt)
    monkeypatch.undo()
    assert err.value.errno == errno.ENOSPC and err.value.filename, err.value
    assert str(tmp_path / "ck") in str(err.value) and "free space there" in str(err.value)
    assert (tmp_path / "ck" / "latest").read_text().strip() == first.name
    offload.load_checkpoint(tmp_path / "ck", model, opt)
    opt.close()


@pytest.mark.parametrize("writer", ["export", "save_pretrained"])
def test_a_full_disk_during_an_export_names_the_file(tmp_path, monkeypatch, writer):
    """As the checkpoint's: ``export`` and ``save_pretrained`` said only "[Errno 28] No space
    left on device". They name the file now; nothing is left under its name."""
    from offload.runtime import safetensors  # noqa: PLC0415

    model, opt = offload.wrap(make_model(), placement_config("cpu", "cpu", tmp_path))

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / ("m.safetensors" if writer == "export" else "hf")
    monkeypatch.setattr(safetensors.os, "fsync", full)
    try:
        with pytest.raises(OSError) as err:
            if writer == "export":
                offload.export(model, out, dtype=torch.float32)
            else:
                offload.save_pretrained(model, out)
    finally:
        monkeypatch.undo()
        opt.close()
    assert err.value.errno == errno.ENOSPC and err.value.filename, err.value
    assert str(tmp_path) in str(err.value) and "free space there" in str(err.value)
    assert not out.exists()
