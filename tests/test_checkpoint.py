"""Checkpoints: resume in a fresh process is bitwise identical; saves are atomic; export loads
into a plain model; optimizer.state_dict round-trips."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from engine_models import batches, lm_loss, make_model, placement_config, train_wrapped
from safetensors.torch import load_file

import offload
from offload.api import checkpoint_files as ckpt_files
from offload.api.wrap import engine_of
from offload.runtime.phase import PhaseError

HERE = Path(__file__).parent


def _run(mode: str, workdir: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    out = subprocess.run(
        [sys.executable, str(HERE / "_resume_worker.py"), mode, str(workdir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.heavy
def test_resume_in_fresh_process_is_bitwise_identical(tmp_path):
    for mode in ("full", "first", "second"):
        _run(mode, tmp_path)
    full = torch.load(tmp_path / "full.pt")
    resumed = torch.load(tmp_path / "second.pt")
    assert set(full) == set(resumed)
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    full_losses = json.loads((tmp_path / "full.json").read_text())
    assert json.loads((tmp_path / "second.json").read_text()) == full_losses[10:]


@pytest.mark.parametrize(
    "param_dev,opt_dev,dtype",
    [("none", "cpu", "fp32"), ("cpu", "nvme", "fp32"), ("nvme", "nvme", "bf16")],
)
def test_save_load_in_process_and_state_dict_roundtrip(tmp_path, param_dev, opt_dev, dtype):
    """In bf16 with params on NVMe the load writes the compute params from the fp32 master,
    converted as the home writes them (``ParamHome.load_shard``): the loss after the load is
    the loss of the run that saved."""
    data = batches(8)
    cfg = lambda d: placement_config(param_dev, opt_dev, tmp_path / d, dtype=dtype)  # noqa: E731
    model, opt = offload.wrap(make_model(), cfg("a"))
    train_wrapped(model, opt, data, 3, 1, 0.0)
    offload.save_checkpoint(tmp_path / "ck", model, opt)
    with torch.no_grad():
        saved_loss = lm_loss(model, data[0])
    sd_opt = opt.state_dict()
    sd_model = {k: v.clone() for k, v in model.state_dict().items()}
    train_wrapped(model, opt, data, 2, 1, 0.0)  # move away from the saved state
    offload.load_checkpoint(tmp_path / "ck", model, opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd_model[k]), k
    with torch.no_grad():
        assert torch.equal(lm_loss(model, data[0]), saved_loss)
    # the torch-format optimizer state (fp32 masters included) loads into a freshly wrapped
    # model; frozen parameters are not optimizer state, so model2 starts from the same seed
    model2, opt2 = offload.wrap(make_model(), cfg("b"))
    trainable = {n for n, p in make_model().named_parameters() if p.requires_grad}
    assert any(
        not torch.equal(v, sd_model[k]) for k, v in model2.state_dict().items() if k in trainable
    )
    opt2.load_state_dict(sd_opt)
    for p_name, p in model2.state_dict().items():
        assert torch.equal(p, sd_model[p_name]), p_name
    l1 = lm_loss(model, data[0])
    l2 = lm_loss(model2, data[0])
    assert torch.equal(l1, l2)
    l1.backward()
    l2.backward()
    opt.step()
    opt2.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k]), k
    opt.close()
    opt2.close()


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = offload.wrap(make_model(), placement_config("none", "cpu", tmp_path))
    data = batches(4)
    train_wrapped(model, opt, data, 1, 1, 0.0)
    offload.save_checkpoint(tmp_path / "ck", model, opt, note="first")
    good = {k: v.clone() for k, v in model.state_dict().items()}
    train_wrapped(model, opt, data, 2, 1, 0.0)

    real = ckpt_files.write_safetensors
    calls = {"n": 0}

    def dying(path, entries, metadata=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device (injected)")
        return real(path, entries, metadata)

    monkeypatch.setattr(ckpt_files, "write_safetensors", dying)
    with pytest.raises(OSError, match="No space left"):
        offload.save_checkpoint(tmp_path / "ck", model, opt, note="second")
    monkeypatch.setattr(ckpt_files, "write_safetensors", real)
    assert not [p for p in (tmp_path / "ck").iterdir() if p.name.endswith(".tmp")]
    extra = offload.load_checkpoint(tmp_path / "ck", model, opt)
    assert extra == {"note": "first"}
    for k, v in model.state_dict().items():
        assert torch.equal(v, good[k]), k
    opt.close()


def test_export_is_usable_without_offload(tmp_path):
    model, opt = offload.wrap(make_model(), placement_config("nvme", "nvme", tmp_path))
    train_wrapped(model, opt, batches(4), 2, 1, 0.0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    path = offload.export(model, tmp_path / "model.safetensors", dtype=torch.float32)
    plain = make_model(seed=3)
    plain.load_state_dict(load_file(str(path)))
    for k, v in plain.state_dict().items():
        assert torch.equal(v, expected[k]), k
    opt.close()


def test_extra_must_be_json(tmp_path):
    model, opt = offload.wrap(make_model(), placement_config("none", "cpu", tmp_path))
    with pytest.raises(TypeError, match="JSON-serializable"):
        offload.save_checkpoint(tmp_path / "ck", model, opt, bad=object())
    # the error named the type but not the value: which of a dozen? (a cycle: RecursionError)
    cycle: list = []
    cycle.append(cycle)
    for key, value in (("rng", torch.get_rng_state()), ("loop", {"x": cycle})):
        with pytest.raises(TypeError, match=rf"extra value '{key}' is not JSON-serializable"):
            offload.save_checkpoint(tmp_path / "ck", model, opt, step=3, **{key: value})
    assert not (tmp_path / "ck").exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        offload.load_checkpoint(tmp_path / "nothing", model, opt)
    opt.close()


def test_extra_values_come_back_as_saved(tmp_path):
    """JSON turned MultiStepLR's milestones (a Counter keyed by int steps) into a dict keyed by
    strings: the resumed scheduler never decayed (lr 0.01 where the run had 0.001 from its
    milestone on); tuples came back as lists. Now ``extra`` comes back with its keys and
    containers as saved."""
    extra = {
        "k": {3: "int", 2.5: "float", True: "bool", None: "none", (1, 2): "tuple"},
        "t": (1, [2, (3,)]),
        "c": Counter([5, 5, 7]),
        "__offload_extra__": "a user's key that looks like the tag",
        "s": {"plain": [1.5, "x", None]},
    }
    data = batches(6)

    def lrs(sched) -> list[float]:
        return [
            train_wrapped(model, opt, data, 1, 1, 0.0, sched=sched)[1].get_last_lr()[0]
            for _ in range(4)
        ]

    model, opt = offload.wrap(make_model(), placement_config("none", "cpu", tmp_path / "w"))
    try:
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [2, 4], 0.1)
        train_wrapped(model, opt, data, 1, 1, 0.0, sched=sched)
        offload.save_checkpoint(tmp_path / "ck", model, opt, sched=sched.state_dict(), **extra)
        want = lrs(sched)
        got = offload.load_checkpoint(tmp_path / "ck", model, opt)
        for k, v in extra.items():
            assert got[k] == v and type(got[k]) is type(v), k
        assert type(got["t"][1][1]) is tuple and got["c"][5] == 2
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, [2, 4], 0.1)
        sched.load_state_dict(got["sched"])
        assert lrs(sched) == want == pytest.approx([1e-3, 1e-3, 1e-4, 1e-4])
    finally:
        opt.close()


def test_the_param_group_is_checked_before_writing_and_a_tensor_lr_saves(tmp_path):
    """A tensor lr (torch's optimizers take one) trained, but its save wrote every file and
    then failed with a bare "Object of type Tensor is not JSON serializable"; a NaN lr saved a
    checkpoint that every load refused. Now the tensor is saved as its number and loads back
    into a group holding a tensor; what the update cannot take is refused before writing."""
    data = batches(4)
    model, opt = offload.wrap(make_model(), placement_config("none", "cpu", tmp_path / "w"))
    group = opt.param_groups[0]
    try:
        group["lr"] = torch.tensor(2.0**-8)
        train_wrapped(
            model, opt, data, 1, 1, 0.0, sched=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        )
        first = offload.save_checkpoint(tmp_path / "ck", model, opt)
        assert json.loads((first / "meta.json").read_text())["param_group"]["lr"] == 2.0**-8
        offload.load_checkpoint(tmp_path / "ck", model, opt)
        assert float(group["lr"]) == 2.0**-8
        for key, value in (("lr", float("nan")), ("eps", -1.0), ("custom", object())):
            saved = group.get(key)
            group[key] = value
            with pytest.raises(ValueError, match=rf"save_checkpoint: .*'{key}'\]: got"):
                offload.save_checkpoint(tmp_path / "ck", model, opt)
            group[key] = saved
            assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [first.name, "latest"]
    finally:
        opt.close()


def test_paths_that_cannot_hold_the_result_are_refused_before_writing(tmp_path, monkeypatch):
    """``export`` onto a directory streamed the whole model into a temp file, then failed
    renaming it ("Is a directory: '.adir.tmp' -> 'adir'"); into a missing directory it named
    only its temp file; ``save_checkpoint`` onto a file said "File exists", and
    ``save_pretrained`` streamed every shard first. Each is now refused naming the path and
    what it must be, before anything is read or written."""
    model, opt = offload.wrap(make_model(), placement_config("none", "cpu", tmp_path / "w"))
    gathered = []
    real = offload.api.checkpoint.UnitValues.of
    monkeypatch.setattr(
        offload.api.checkpoint.UnitValues, "of", lambda *a: gathered.append(1) or real(*a)
    )
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("mine")
    try:
        with pytest.raises(IsADirectoryError, match=r"is a directory; export writes one file"):
            offload.export(model, tmp_path / "adir")
        with pytest.raises(FileNotFoundError, match=r"nope/model\.safetensors' does not exist"):
            offload.export(model, tmp_path / "nope" / "model.safetensors")
        assert not gathered
        assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]
        with pytest.raises(NotADirectoryError, match=r"not a directory: a checkpoint goes.*afile'"):
            offload.save_checkpoint(tmp_path / "afile", model, opt)
        with pytest.raises(NotADirectoryError, match=r"not a directory: save_pretrained.*afile'"):
            offload.save_pretrained(model, tmp_path / "afile")
        assert not gathered and (tmp_path / "afile").read_text() == "mine"
    finally:
        opt.close()


def _count_gathers(monkeypatch) -> list:
    gathered = []
    real = offload.api.checkpoint.UnitValues.of
    monkeypatch.setattr(
        offload.api.checkpoint.UnitValues, "of", lambda *a: gathered.append(1) or real(*a)
    )
    return gathered


def test_a_directory_through_a_broken_link_is_refused_naming_the_link(tmp_path, monkeypatch):
    """A checkpoint directory that is a symbolic link to a missing target (a scratch disk not
    mounted), or under one, gave only "[Errno 17] File exists". Refused naming the link and
    its target, before anything is written, and the target is not created."""
    model, opt = offload.wrap(make_model(), placement_config("none", "cpu", tmp_path / "w"))
    gathered = _count_gathers(monkeypatch)
    (tmp_path / "ck").symlink_to(tmp_path / "mnt" / "ckpts")
    (tmp_path / "up").symlink_to(tmp_path / "mnt")
    try:
        for target, link in ((tmp_path / "ck", "ck"), (tmp_path / "up" / "run" / "ck", "up")):
            with pytest.raises(FileNotFoundError) as err:
                offload.save_checkpoint(target, model, opt)
            assert err.value.filename == str(tmp_path / link), err.value
            assert "symbolic link to '" + str(tmp_path / "mnt") in str(err.value)
            assert "nothing was written" in str(err.value)
        assert not gathered and sorted(p.name for p in tmp_path.iterdir()) == ["ck", "up"]
    finally:
        opt.close()


def test_a_latest_that_is_a_directory_is_refused_before_writing(tmp_path, monkeypatch):
    """A directory named 'latest' (or a link to one) where the save keeps its pointer: the
    whole checkpoint was written, then the rename 'latest.tmp' -> 'latest' failed with a raw
    IsADirectoryError, leaving 'latest.tmp' and a checkpoint nothing named. Refused first."""
    model, opt = offload.wrap(make_model(), placement_config("none", "cpu", tmp_path / "w"))
    gathered = _count_gathers(monkeypatch)
    (tmp_path / "a" / "latest").mkdir(parents=True)
    (tmp_path / "a" / "latest" / "mine").write_text("kept")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "latest").symlink_to(tmp_path / "a")
    try:
        for root, what in (("a", "is a directory,"), ("b", f"to the directory '{tmp_path}/a'")):
            with pytest.raises(IsADirectoryError, match="keeps its pointer") as err:
                offload.save_checkpoint(tmp_path / root, model, opt)
            assert err.value.filename == str(tmp_path / root / "latest")
            assert what in str(err.value) and "nothing was written" in str(err.value)
        assert not gathered
        assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["latest"]
        assert (tmp_path / "a" / "latest" / "mine").read_text() == "kept"
        assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["latest"]
    finally:
        opt.close()


def test_an_empty_directory_is_refused_not_taken_as_the_working_directory(tmp_path, monkeypatch):
    """``save_checkpoint("")`` (an unset variable) wrote a whole checkpoint into the working
    directory and then raised "FileNotFoundError: ''"; ``load_checkpoint("")`` loaded the
    working directory's; ``save_pretrained("")`` wrote the model among the working
    directory's files. All are refused, naming the value and what is allowed."""
    model, opt = offload.wrap(make_model(), placement_config("none", "cpu", tmp_path / "w"))
    gathered = _count_gathers(monkeypatch)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    try:
        lm_loss(model, batches(1)[0]).backward()
        opt.step()
        offload.save_checkpoint(".", model, opt)  # the working directory, said so
        gathered.clear()
        before = sorted(os.listdir("."))
        allowed = "allowed: a non-empty directory path ('.' for the working directory)"
        for empty in ("", " "):  # (Path("") is Path("."): nothing tells them apart)
            with pytest.raises(ValueError, match=rf"save_checkpoint: directory: got '{empty}'"):
                offload.save_checkpoint(empty, model, opt)
            with pytest.raises(offload.CheckpointError, match=re.escape(allowed)):
                offload.load_checkpoint(empty, model, opt)
            # save_pretrained("") wrote the model's files among the working directory's;
            # export("") said only that '.' is a directory
            with pytest.raises(ValueError, match=rf"save_pretrained: directory: got '{empty}'"):
                offload.save_pretrained(model, empty)
            with pytest.raises(ValueError, match=rf"export: file: got '{empty}'; allowed: a non"):
                offload.export(model, empty)
        assert not gathered and sorted(os.listdir(".")) == before
        assert offload.load_checkpoint(".", model, opt) == {}
    finally:
        opt.close()


def test_the_undecayed_set_is_saved_and_resumed(tmp_path):
    """``optimizer.set_no_decay``'s set was in no checkpoint: the resumed run decayed the
    biases again, 2.0e-3 off the uninterrupted run two steps later (torch refuses a state dict
    whose groups differ). Now it is saved by parameter name and loaded back, bitwise."""
    cfg = placement_config("none", "cpu", tmp_path / "w")
    data = batches(8)
    biases = {
        n for n, p in make_model().named_parameters() if n.endswith("bias") and p.requires_grad
    }
    model, opt = offload.wrap(make_model(), cfg)
    try:
        opt.set_no_decay(p for n, p in model.named_parameters() if n in biases)
        train_wrapped(model, opt, data, 2, 1, 0.0)
        offload.save_checkpoint(tmp_path / "ck", model, opt)
        train_wrapped(model, opt, data, 4, 1, 0.0, start=2)
        want = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        opt.close()
    model, opt = offload.wrap(make_model(), cfg)
    try:
        offload.load_checkpoint(tmp_path / "ck", model, opt)
        assert {n for n, p in model.named_parameters() if p in opt.no_decay} == biases
        train_wrapped(model, opt, data, 4, 1, 0.0, start=2)
        assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    finally:
        opt.close()


def test_an_export_dtype_that_is_not_floating_is_refused(tmp_path):
    """``export(dtype=torch.int8)`` (or int64) wrote every weight truncated to an integer
    without a word, ``save_pretrained`` too; ``dtype="bf16"`` and None failed with
    "'str' object has no attribute 'itemsize'"; complex64 with a bare KeyError."""
    model, opt = offload.wrap(make_model(), placement_config("none", "cpu", tmp_path / "w"))
    try:
        for bad in (torch.int8, torch.int64, torch.bool, torch.complex64, "bf16", None):
            with pytest.raises(ValueError, match=rf"export: dtype={bad!r}; allowed: torch\.float"):
                offload.export(model, tmp_path / "model.safetensors", dtype=bad)
        with pytest.raises(ValueError, match=r"save_pretrained: dtype=torch\.int8; allowed: None"):
            offload.save_pretrained(model, tmp_path / "hf", dtype=torch.int8)
        assert sorted(p.name for p in tmp_path.iterdir()) == []
        offload.export(model, tmp_path / "model.safetensors", dtype=torch.float16)
    finally:
        opt.close()


def test_an_optimizer_that_is_not_the_model_s_is_refused(tmp_path):
    """Another wrapped model's optimizer was taken: a save recorded its hyperparameters and
    loss scale with this model's state, a load set them on it and left the model's own
    optimizer as it was; a torch optimizer failed with "'SGD' object has no attribute
    'skipped_steps'". Now both are refused, naming the optimizer, before anything changes."""
    model, opt = offload.wrap(make_model(), placement_config("none", "cpu", tmp_path / "a"))
    other, other_opt = offload.wrap(make_model(), placement_config("none", "cpu", tmp_path / "b"))
    try:
        offload.save_checkpoint(tmp_path / "ck", model, opt)
        other_opt.param_groups[0]["lr"] = 0.5
        sgd = torch.optim.SGD(make_model().parameters(), lr=1.0)
        for wrong in (other_opt, sgd):
            name = type(wrong).__name__
            with pytest.raises(ValueError, match=rf"save_checkpoint: the optimizer \({name}\)"):
                offload.save_checkpoint(tmp_path / "ck2", model, wrong)
            with pytest.raises(ValueError, match=rf"load_checkpoint: the optimizer \({name}\)"):
                offload.load_checkpoint(tmp_path / "ck", model, wrong)
        assert not (tmp_path / "ck2").exists() and other_opt.param_groups[0]["lr"] == 0.5
    finally:
        opt.close()
        other_opt.close()


def test_a_bad_keep_last_is_refused_before_writing(tmp_path):
    """``keep_last`` 0, -1 and True were taken (as 1), 2.5 kept an extra checkpoint, and "2"
    or None raised a bare TypeError after the checkpoint had been committed, with the temp
    directories of killed saves left."""
    model, opt = offload.wrap(make_model(), placement_config("none", "cpu", tmp_path / "w"))
    try:
        first = offload.save_checkpoint(tmp_path / "ck", model, opt)
        for bad in (0, -1, 2.5, "2", None, True):
            with pytest.raises(ValueError, match=rf"keep_last: got {bad!r}; allowed: an int"):
                offload.save_checkpoint(tmp_path / "ck", model, opt, keep_last=bad)
        assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [first.name, "latest"]
    finally:
        opt.close()


class _NormBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.bn = torch.nn.BatchNorm1d(16)

    def forward(self, x):
        return self.bn(x + torch.tanh(self.fc(x)))


def _norm_model(shape: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(_NormBlock(), _NormBlock(), torch.nn.BatchNorm1d(shape))


def _norm_steps(model, opt, batches_) -> float:
    model.train()
    for x in batches_:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        return float(model(batches_[0]).square().mean())


@pytest.mark.parametrize("param_dev,opt_dev", [("none", "cpu"), ("nvme", "nvme")])
def test_buffers_are_saved_and_resumed(tmp_path, param_dev, opt_dev):
    """BatchNorm's running statistics (buffers, in units and in the root) were not in the
    checkpoint: the resumed model evaluated 0.7706 against the uninterrupted 0.8346 (the
    probe), running_var 3.1 off. Now they are, and the resume is bitwise."""
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 16, generator=g) * 3 + 1 for _ in range(6)]
    cfg = placement_config(
        param_dev, opt_dev, tmp_path / "w", wrap={"module_classes": ["_NormBlock"]}
    )
    model, opt = offload.wrap(_norm_model(), cfg)
    try:
        _norm_steps(model, opt, data[:3])
        offload.save_checkpoint(tmp_path / "ck", model, opt)
        want = _norm_steps(model, opt, data[3:])
        whole = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        opt.close()
    model, opt = offload.wrap(_norm_model(), cfg)
    try:
        offload.load_checkpoint(tmp_path / "ck", model, opt)
        assert _norm_steps(model, opt, data[3:]) == want
        for k, v in model.state_dict().items():
            assert torch.equal(v, whole[k]), k
    finally:
        opt.close()


def test_buffers_that_differ_are_refused_and_an_older_checkpoint_says_it_has_none(
    tmp_path, monkeypatch, caplog
):
    cfg = placement_config("none", "cpu", tmp_path / "w", wrap={"module_classes": ["_NormBlock"]})
    model, opt = offload.wrap(_norm_model(), cfg)
    offload.save_checkpoint(tmp_path / "ck", model, opt)
    opt.close()
    other, opt = offload.wrap(_norm_model(), cfg)  # the root's norm held as another dtype
    other[2].num_batches_tracked = other[2].num_batches_tracked.to(torch.int32)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    try:
        with pytest.raises(ckpt_files.CheckpointError, match=r"buffers\.safetensors.*I64.*I32"):
            offload.load_checkpoint(tmp_path / "ck", other, opt)
        assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    finally:
        opt.close()
    # a checkpoint written before buffers were kept: loaded, with a word on the buffers
    monkeypatch.setattr(offload.api.checkpoint, "_buffer_entries", lambda model: [])
    model, opt = offload.wrap(_norm_model(), cfg)
    try:
        offload.save_checkpoint(tmp_path / "old", model, opt)
        with caplog.at_level("WARNING", logger="offload.checkpoint"):
            offload.load_checkpoint(tmp_path / "old", model, opt)
        assert "holds no buffers" in caplog.text
    finally:
        opt.close()


def test_a_buffer_a_checkpoint_cannot_hold_is_refused_before_writing(tmp_path):
    cfg = placement_config("none", "cpu", tmp_path / "w", wrap={"module_classes": ["_NormBlock"]})
    model, opt = offload.wrap(_norm_model(), cfg)
    model.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
    try:
        with pytest.raises(TypeError, match="buffer phase is complex64"):
            offload.save_checkpoint(tmp_path / "ck", model, opt)
        assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
    finally:
        opt.close()


def test_int8_int16_and_float64_buffers_are_saved_exported_and_loaded(tmp_path):
    """Packed int8 weights kept as buffers (as the README advises for what does not train),
    int16 and float64 ones: ``save_checkpoint`` refused them (its files held fewer dtypes
    than safetensors), and ``export`` dropped them without a word. Both write them now, and
    a load puts them back, bit for bit; a buffer safetensors cannot hold is refused by the
    export before it writes, as by the save."""
    cfg = placement_config("nvme", "cpu", tmp_path / "w", wrap={"module_classes": ["_NormBlock"]})
    gen = torch.Generator().manual_seed(0)
    extra = {
        "qweight": torch.randint(-128, 127, (4, 4), dtype=torch.int8, generator=gen),
        "codes": torch.randint(-3000, 3000, (5,), dtype=torch.int16, generator=gen),
        "table": torch.randn(3, dtype=torch.float64, generator=gen),
    }

    def with_buffers(values):
        model = _norm_model()
        for name, value in values.items():
            model.register_buffer(name, value.clone())
        return model

    model, opt = offload.wrap(with_buffers(extra), cfg)
    try:
        offload.save_checkpoint(tmp_path / "ck", model, opt)
        offload.export(model, tmp_path / "m.safetensors", dtype=torch.float32)
    finally:
        opt.close()
    exported = load_file(tmp_path / "m.safetensors")
    for name in ("qweight", "codes"):
        assert exported[name].dtype == extra[name].dtype and torch.equal(
            exported[name], extra[name]
        )
    assert torch.equal(exported["table"], extra["table"].float())  # floats in the export's dtype
    zeros = {k: torch.zeros_like(v) for k, v in extra.items()}
    other, opt = offload.wrap(with_buffers(zeros), cfg | {"offload_optimizer": {"device": "cpu"}})
    try:
        offload.load_checkpoint(tmp_path / "ck", other, opt)
        for name, want in extra.items():  # (a float buffer held in the compute dtype)
            got = getattr(other, name)
            assert got.dtype == (torch.float32 if name == "table" else want.dtype), name
            assert torch.equal(got, want.to(got.dtype)), name
        other.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
        with pytest.raises(TypeError, match="export: buffer phase is complex64"):
            offload.export(other, tmp_path / "c.safetensors", dtype=torch.float32)
        assert not (tmp_path / "c.safetensors").exists()
    finally:
        opt.close()


def test_a_save_from_a_signal_handler_in_the_middle_of_a_forward(tmp_path):
    """A signal handler that saves a checkpoint (preemption: Slurm's ``--signal``) runs on the
    training thread between two of its lines, here in the middle of the model's forward. The
    save took the forward still running for one stopped by Ctrl-C and dropped it, letting its
    units go: the forward then raised that a layer ran outside its unit's forward, and the
    run was over. Now the save leaves the running forward alone, it holds the state of the
    step boundary before it, and training goes on as if it had not come (the hook below
    stands for the handler)."""
    data = batches(4)
    ref_model, ref_opt = offload.wrap(
        make_model(), placement_config("nvme", "nvme", tmp_path / "r")
    )
    ref_losses, sched = train_wrapped(ref_model, ref_opt, data, 1, 2, 1.0)
    after_one = offload.save_checkpoint(tmp_path / "between_steps", ref_model, ref_opt)
    ref_losses += train_wrapped(ref_model, ref_opt, data, 4, 2, 1.0, start=1, sched=sched)[0]
    reference = ref_model.state_dict()
    ref_opt.close()

    model, opt = offload.wrap(make_model(), placement_config("nvme", "nvme", tmp_path / "a"))
    calls, saves = [], []

    def handler(module, args):  # blocks[1] runs twice a forward: calls 0 and 4 are in the
        calls.append(len(calls))  # forwards of steps 0 and 1, each the first of its step
        if calls[-1] in (0, 4):
            saves.append(offload.save_checkpoint(tmp_path / f"ck{calls[-1]}", model, opt))

    model.blocks[1].register_forward_pre_hook(handler)
    losses, _ = train_wrapped(model, opt, data, 4, 2, 1.0)
    assert losses == ref_losses
    for name, value in reference.items():
        assert torch.equal(model.state_dict()[name], value), name
    opt.close()
    fresh, fresh_opt = offload.wrap(make_model(), placement_config("cpu", "cpu", tmp_path / "f"))
    try:
        initial = fresh.state_dict()
        for saved, expected in ((saves[0], None), (saves[1], after_one)):
            state = {}
            if expected is not None:
                offload.load_checkpoint(expected, fresh, fresh_opt)
                state = fresh.state_dict()
            offload.load_checkpoint(saved, fresh, fresh_opt)
            assert fresh_opt.state_dict()["offload"]["step_count"] == (expected is not None)
            for name, value in (state or initial).items():
                assert torch.equal(fresh.state_dict()[name], value), name
    finally:
        fresh_opt.close()


def test_a_save_from_a_signal_handler_inside_optimizer_step_is_refused(tmp_path):
    """A signal handler that saves runs wherever the training thread is, also inside
    ``optimizer.step()``: after the step count had moved on and before the update was
    launched, the save wrote a checkpoint whose step count was the new one and whose values
    were the step's before (found by handlers landing at random: 3 of 20 such checkpoints
    resumed to other weights than the run's). Now a save (or any call that checks where the
    step is) from inside ``step()`` is refused, naming it; the step and training go on."""
    model, opt = offload.wrap(make_model(), placement_config("nvme", "nvme", tmp_path))
    data = batches(4)
    engine = engine_of(model)
    end_step, refused = engine.telemetry.end_step, []

    def handler(*args):  # stands for a signal handler landing inside step()
        try:
            offload.save_checkpoint(tmp_path / "ck", model, opt)
        except PhaseError as exc:
            refused.append(str(exc))
        return end_step(*args)

    engine.telemetry.end_step = handler
    losses, _ = train_wrapped(model, opt, data, 2, 1, 1.0)
    engine.telemetry.end_step = end_step
    assert len(refused) == 2 and not (tmp_path / "ck").exists(), refused
    assert "save_checkpoint called inside optimizer.step()" in refused[0]
    assert "set a flag" in refused[0]
    reference, ref_opt = offload.wrap(make_model(), placement_config("cpu", "cpu", tmp_path / "r"))
    assert train_wrapped(reference, ref_opt, data, 2, 1, 1.0)[0] == losses
    ref_opt.close()
    opt.close()


def test_keep_last_keeps_this_run_s_saves_after_a_machine_whose_clock_was_ahead(tmp_path):
    """``keep_last`` orders checkpoints by when they were written, a time in their names. A
    run resumed on a machine whose clock is behind the one that wrote the checkpoint (a
    preempted job on another node) named its saves "older": keep_last=2 kept the other
    machine's checkpoint at every save and removed this run's previous one. A new name now
    comes after every checkpoint already there."""
    model, opt = offload.wrap(make_model(), placement_config("cpu", "cpu", tmp_path))
    first = offload.save_checkpoint(tmp_path / "ck", model, opt)
    ahead = first.with_name(f"ckpt-00000000-{time.time_ns() + 600 * 10**9}")  # 10 min ahead
    first.rename(ahead)
    (tmp_path / "ck" / "latest").write_text(ahead.name + "\n")
    a = offload.save_checkpoint(tmp_path / "ck", model, opt, keep_last=2)
    b = offload.save_checkpoint(tmp_path / "ck", model, opt, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == sorted([a.name, b.name, "latest"])
    opt.close()


class _Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class _Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.extra = _Inner(), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.extra(self.inner(x))


def test_a_checkpoint_of_units_cut_otherwise_says_so(tmp_path):
    """Loaded into the same model wrapped with another ``wrap.module_classes``, a checkpoint
    was refused as not holding a parameter it holds ("parameter '0.extra.weight' of unit 0
    ('<root>') is not in the checkpoint"): in another unit. It says so now, and what to do."""

    def wrapped(classes, where):
        torch.manual_seed(0)
        cfg = placement_config("cpu", "cpu", tmp_path / where, wrap={"module_classes": classes})
        return offload.wrap(torch.nn.Sequential(_Pair(), _Pair()), cfg)

    model, opt = wrapped(["_Pair"], "a")
    offload.save_checkpoint(tmp_path / "ck", model, opt)
    opt.close()
    model, opt = wrapped(["_Inner"], "b")
    try:
        with pytest.raises(ckpt_files.CheckpointError) as err:
            offload.load_checkpoint(tmp_path / "ck", model, opt)
    finally:
        opt.close()
    assert "parameter '0.extra.weight' is in unit 0 ('<root>') in the model and in unit 1" in str(
        err.value
    )
    assert "the units are cut otherwise" in str(err.value) and "module_classes" in str(err.value)
