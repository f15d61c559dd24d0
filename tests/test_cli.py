"""`offload report` and `offload config` from a subprocess, as a user runs them."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from offload import _native
from offload.cli import report
from offload.cli.main import main
from offload.config import OffloadConfig, load_config


def offload_cli(*args: str, native: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("OFFLOAD_NATIVE", None)
    if not native:
        env["OFFLOAD_NATIVE"] = "0"
    return subprocess.run(
        [sys.executable, "-m", "offload", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_rank_variable_that_is_no_number_stops_no_command_that_uses_none(tmp_path, capsys):
    """``RANK=abc offload config FILE`` was int()'s traceback before any command ran (the check
    that quiets the notes of ranks beyond 0); the commands that join a group name it
    (``offload.dist.env_int``, tests/test_engine_api.py's WORLD_SIZE test)."""
    (tmp_path / "c.yaml").write_text("device: cpu\n")
    env = {**os.environ, "RANK": "abc"}
    run = subprocess.run(
        [sys.executable, "-m", "offload.cli.main", "config", str(tmp_path / "c.yaml")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "valid offload config" in run.stdout


def test_help_lists_the_commands():
    out = offload_cli("--help")
    assert out.returncode == 0, out.stderr
    for name in ("report", "config"):
        assert name in out.stdout


def test_report_text(tmp_path: Path):
    out = offload_cli("report", "--path", str(tmp_path))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"disk at {tmp_path}" in text
    assert torch.__version__ in text
    status = next(line for line in text.splitlines() if line.strip().startswith("status"))
    assert "loaded (" in status and _native.get().__file__ in status
    simd = next(line for line in text.splitlines() if line.strip().startswith("simd level"))
    assert simd.split()[2] == _native.simd_level()
    for label in (
        "compute threads",
        "cuda available",
        "pinned memory",
        "total RAM",
        "available RAM",
        "free",
        "O_DIRECT",
    ):
        assert f"  {label} " in text, label


def test_report_json_matches_the_machine(tmp_path: Path):
    out = offload_cli("report", "--json", "--path", str(tmp_path))
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    n = r["native"]
    assert n["loaded"] is True and n["reason"] == ""
    assert n["simd_level"] in n["supported_simd_levels"] and "scalar" in n["supported_simd_levels"]
    assert n["compute_threads"] == _native.get_num_threads()
    assert n["compute_backend"] == _native.compute_backend()  # this process has torch loaded too
    assert {"simd_level", "set_num_threads"} <= set(n["entry_points"])
    t = r["torch"]
    assert t["version"] == torch.__version__
    assert t["cuda_available"] == torch.cuda.is_available()
    assert t["cuda_device_count"] == (torch.cuda.device_count() if t["cuda_available"] else 0)
    assert t["pinned_memory"]["works"] is _pinning_works()
    m = r["memory"]
    assert 0 < m["available_bytes"] <= m["total_bytes"]
    d = r["disk"]
    assert d["path"] == str(tmp_path) and d["exists"] is True
    assert 0 < d["free_bytes"] <= d["total_bytes"]
    assert d["o_direct"]["works"] == _o_direct_opens(tmp_path)
    assert d["filesystem"]["type"]
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def _pinning_works() -> bool:
    """Independent check: can this process page-lock a host tensor? (Never without CUDA, so on
    a CPU-only machine the report must say False; an ``isinstance(..., bool)`` check would pass
    whatever it said.)"""
    if not torch.cuda.is_available():
        return False
    try:
        return bool(torch.empty(4096, dtype=torch.uint8).pin_memory().is_pinned())
    except RuntimeError:
        return False


def _o_direct_opens(directory: Path) -> bool:
    """Independent check: can a file in ``directory`` be opened with O_DIRECT at all?"""
    path = directory / "independent-check"
    path.write_bytes(b"")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    finally:
        path.unlink()
    os.close(fd)
    return True


@pytest.mark.heavy  # (a child process; test_report_text stays in the default suite)
def test_report_says_fallback_when_native_is_off(tmp_path: Path):
    out = offload_cli("report", "--path", str(tmp_path), native=False)
    assert out.returncode == 0, out.stderr
    assert "fallback" in out.stdout and "disabled by OFFLOAD_NATIVE=0" in out.stdout
    assert "simd level       none (fallback)" in out.stdout
    js = json.loads(offload_cli("report", "--json", native=False).stdout)
    assert js["native"]["loaded"] is False
    assert js["native"]["reason"] == "disabled by OFFLOAD_NATIVE=0"


def test_report_on_a_missing_directory_still_exits_0(tmp_path: Path, capsys):
    assert main(["report", "--path", str(tmp_path / "nope")]) == 0
    assert "not an existing directory" in capsys.readouterr().out


def test_o_direct_probe_reports_the_errno(tmp_path: Path, monkeypatch):
    real_open = os.open

    def refuse_o_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_o_direct)
    result = report.probe_o_direct(str(tmp_path))
    assert result == {"works": False, "detail": "open(O_DIRECT) failed: EINVAL (Invalid argument)"}
    assert list(tmp_path.iterdir()) == []


def test_config_prints_normalized_yaml_that_loads_back(tmp_path: Path):
    src = tmp_path / "c.yaml"
    src.write_text(
        "dtype: fp16\noptimizer: {lr: 1e-4}\noffload_param:\n  device: cpu\n  buffer_size: 64MiB\n"
    )
    out = offload_cli("config", str(src))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"# {src}: valid offload config")
    assert "buffer_size: 67108864  # 64 MiB" in out.stdout
    again = tmp_path / "normalized.yaml"
    again.write_text(out.stdout)
    assert load_config(again) == load_config(src)
    # defaults are filled in
    assert (
        yaml.safe_load(out.stdout)["offload_optimizer"]
        == OffloadConfig().to_dict()["offload_optimizer"]
    )


def test_config_yaml_loads_back_strings_beyond_the_basic_plane(tmp_path: Path, capsys):
    """JSON's surrogate pair for U+1F4BE read back in YAML as two lone surrogates: the printed
    config named another nvme_path (and no_decay pattern) than the file's."""
    src = tmp_path / "c.json"
    data = {
        "offload_optimizer": {"device": "nvme", "nvme_path": '/mnt/\U0001f4be disk/é "q" \\x'},
        "optimizer": {"no_decay": ["^\U00020000", "bias$"]},
    }
    src.write_text(json.dumps(data))
    assert main(["config", str(src)]) == 0
    again = tmp_path / "normalized.yaml"
    again.write_text(capsys.readouterr().out)
    assert load_config(again) == load_config(src)


def test_config_shows_rounded_sizes_and_auto(tmp_path: Path):
    src = tmp_path / "c.yaml"
    src.write_text("offload_param:\n  buffer_size: 16MB\naio:\n  block_size: 1e6\n")
    out = offload_cli("config", str(src))
    assert out.returncode == 0, out.stderr
    assert "  buffer_size: 16003072  # 15.26 MiB\n" in out.stdout  # 16,000,000 rounded up
    assert "  block_size: 1003520  # 980 KiB\n" in out.stdout
    assert '  buffer_size: "auto"  # the largest unit\'s size, at most 256 MiB' in out.stdout
    assert "offload_param.buffer_size: '16MB' is 16000000 bytes, rounded up to 16003072" in (
        out.stderr
    )
    printed = yaml.safe_load(out.stdout)
    assert printed["offload_param"]["buffer_size"] == 16_003_072
    assert printed["offload_optimizer"]["buffer_size"] == "auto"
    again = tmp_path / "normalized.yaml"
    again.write_text(out.stdout)
    assert load_config(again) == load_config(src)


def test_config_json(tmp_path: Path, capsys):
    src = tmp_path / "c.json"
    src.write_text(json.dumps({"aio": {"block_size": "4k"}}))
    assert main(["config", str(src), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == load_config(src).to_dict() and printed["aio"]["block_size"] == 4096


def test_config_maps_a_deepspeed_file(tmp_path: Path):
    src = tmp_path / "ds.json"
    src.write_text(
        json.dumps(
            {
                "train_batch_size": 16,
                "bf16": {"enabled": True},
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                },
            }
        )
    )
    out = offload_cli("config", str(src))
    assert out.returncode == 0, out.stderr
    assert "DeepSpeed config mapped to offload's format" in out.stdout
    assert "not supported by offload are ignored: train_batch_size" in out.stderr
    converted = tmp_path / "converted.yaml"
    converted.write_text(out.stdout)
    assert load_config(converted) == load_config(src)


@pytest.mark.parametrize(
    "name, text, expected",
    [
        (
            "bad.json",
            json.dumps({"optimizer": {"lr": -1}}),
            "optimizer.lr: got -1; allowed: a finite number > 0",
        ),
        (
            "typo.yaml",
            "offload_optimzer: {device: cpu}\n",
            "offload_optimzer: unknown key; did you mean 'offload_optimizer'?",
        ),
        ("missing.yaml", None, "config file not found"),
        ("broken.json", "{", "not valid JSON"),
    ],
)
def test_config_bad_file_exits_nonzero_with_one_line(tmp_path: Path, capsys, name, text, expected):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    assert main(["config", str(path)]) == 1  # in-process; one subprocess run is below
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert lines[0].startswith("offload config: error: ") and expected in lines[0]
    assert str(path) in lines[0]


@pytest.mark.parametrize("argv", [["estimate", "--params", "7B"], ["config", "{cfg}"]])
def test_a_closed_stdout_pipe_is_not_a_traceback(tmp_path: Path, argv):
    """`offload estimate ... | head -1` printed a BrokenPipeError traceback when head had
    exited before the table was written."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("aio:\n  queue_depth: 4\n")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes
    try:
        out = subprocess.run(
            [sys.executable, "-m", "offload", *(a.format(cfg=cfg) for a in argv)],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write)
    assert out.returncode == 141 and "Traceback" not in out.stderr, out.stderr


def test_config_bad_file_from_a_subprocess(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    path.write_text("aio:\n  direct_io: maybe\n")
    out = offload_cli("config", str(path))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (
        f"offload config: error: aio.direct_io: got 'maybe'; allowed: true or false (a boolean, "
        f"not a string) (in {path})\n"
    )
