"""Checkpoints: resume in a fresh process is bitwise identical; saves are atomic; export loads
into a plain model; optimizer.state_dict round-trips."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_models import batches, lm_loss, make_model, placement_config, train_wrapped
from safetensors.torch import load_file

import offload
from offload.api import checkpoint_files as ckpt_files

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


@pytest.mark.parametrize("param_dev,opt_dev", [("none", "cpu"), ("cpu", "nvme")])
def test_save_load_in_process_and_state_dict_roundtrip(tmp_path, param_dev, opt_dev):
    data = batches(8)
    model, opt = offload.wrap(make_model(), placement_config(param_dev, opt_dev, tmp_path / "a"))
    train_wrapped(model, opt, data, 3, 1, 0.0)
    offload.save_checkpoint(tmp_path / "ck", model, opt)
    sd_opt = opt.state_dict()
    sd_model = {k: v.clone() for k, v in model.state_dict().items()}
    train_wrapped(model, opt, data, 2, 1, 0.0)  # move away from the saved state
    offload.load_checkpoint(tmp_path / "ck", model, opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd_model[k]), k
    # the torch-format optimizer state (fp32 masters included) loads into a freshly wrapped
    # model; frozen parameters are not optimizer state, so model2 starts from the same seed
    model2, opt2 = offload.wrap(make_model(), placement_config(param_dev, opt_dev, tmp_path / "b"))
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
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        offload.load_checkpoint(tmp_path / "nothing", model, opt)
    opt.close()
