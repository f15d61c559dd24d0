"""offload tune-io: a tiny sweep prints a table and a valid aio section, leaves no scratch."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from children import ROOT, default_sigint

from offload import _native
from offload.cli.main import main


@pytest.mark.parametrize("backend", ["native", "fallback"])
def test_tiny_sweep_prints_table_and_best_section(tmp_path, capsys, backend):
    out_file = tmp_path / "aio.json"
    disk = tmp_path / "disk"
    disk.mkdir()
    argv = [
        "tune-io", "--path", str(disk), "--size", "8MiB", "--block-sizes", "1MiB,256KiB",
        "--queue-depths", "2", "--threads", "1", "--output", str(out_file),
    ]  # fmt: skip
    if backend == "fallback":
        with _native.force_fallback():
            rc = main(argv)
    else:
        rc = main(argv)
    assert rc == 0
    text = capsys.readouterr().out
    rows = [
        line.split() for line in text.splitlines() if line.split()[:1] in (["1048576"], ["262144"])
    ]
    assert len(rows) == 2 and all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
    section = json.loads(out_file.read_text())["aio"]
    assert section["block_size"] in (1 << 20, 256 << 10)
    assert section["queue_depth"] == 2 and section["thread_count"] == 1
    assert section["direct_io"] is True
    assert json.loads(text[text.index("{") :]) == {"aio": section}
    assert os.listdir(disk) == []  # scratch removed


def test_bad_path_and_bad_sizes(tmp_path, capsys):
    assert main(["tune-io", "--path", str(tmp_path / "missing"), "--size", "8MiB"]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tune-io", "--path", str(tmp_path), "--block-sizes", "1000"])


@pytest.mark.parametrize(
    "flag, value, key",
    [("--block-sizes", "2GiB", "aio.block_size"), ("--queue-depths", "5000", "aio.queue_depth")],
)
def test_a_grid_value_the_aio_section_refuses_is_refused(tmp_path, capsys, flag, value, key):
    """The best point is printed as a config section: a value outside the section's range was
    measured and recommended, then refused by `offload config` and `wrap`."""
    argv = ["tune-io", "--path", str(tmp_path), "--size", "64KiB", "--queue-depths", "1"]
    argv += ["--threads", "1", "--block-sizes", "4KiB", flag, value]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert key in err and "allowed" in err
    assert os.listdir(tmp_path) == []  # nothing measured


@pytest.mark.parametrize("size", ["0", "8KiB"])
def test_a_file_smaller_than_a_block_is_refused_before_the_sweep(tmp_path, capsys, size):
    """--size 0 swept a 4 KiB file and printed a "best" aio section of it, status 0; a block
    larger than the file measured nothing either."""
    argv = ["tune-io", "--path", str(tmp_path), "--size", size, "--block-sizes", "4KiB,16KiB"]
    argv += ["--queue-depths", "1", "--threads", "1"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "--size" in captured.err and "--block-sizes (16384)" in captured.err
    assert "allowed: at least 16384 bytes" in captured.err and "block_size" not in captured.out
    assert os.listdir(tmp_path) == []


def test_output_is_checked_before_the_sweep_and_a_config_there_is_kept(tmp_path, capsys):
    """A missing directory or a directory as --output was a traceback after the whole sweep; a
    config file of the user's as --output was replaced by the aio section alone. A file where
    its directory should be was said not to exist."""
    disk = tmp_path / "disk"
    disk.mkdir()
    argv = ["tune-io", "--path", str(disk), "--size", "64KiB", "--block-sizes", "4KiB"]
    argv += ["--queue-depths", "1", "--threads", "1", "--output"]
    config = tmp_path / "offload.json"
    config.write_text('{"optimizer": {"lr": 0.0001}, "aio": {"queue_depth": 4}}\n')
    for out, says in [
        (tmp_path / "missing" / "aio.json", "does not exist"),
        (config / "aio.json", f"its directory '{config}' is not a directory"),
        (disk, "is a directory"),
        (config, "nothing was changed"),
    ]:
        assert main([*argv, str(out)]) == 2
        captured = capsys.readouterr()
        assert says in captured.err and "block_size" not in captured.out  # nothing measured
    assert config.read_text() == '{"optimizer": {"lr": 0.0001}, "aio": {"queue_depth": 4}}\n'
    own = tmp_path / "aio.json"
    own.write_text('{"aio": {"queue_depth": 64}}')  # an earlier tune-io's: replaced
    assert main([*argv, str(own)]) == 0
    assert json.loads(own.read_text())["aio"]["queue_depth"] == 1
    assert os.listdir(disk) == []


def test_a_file_larger_than_the_buffer_is_swept_in_pieces(tmp_path, monkeypatch):
    """The sweep held the whole --size in one host buffer: --size 64GiB (larger than a drive's
    cache, as a disk benchmark wants it) was 64 GiB of RAM."""
    from offload.io import _tune
    from offload.io.async_io import AsyncIO

    monkeypatch.setattr(_tune, "MAX_BUFFER", 64 << 10)
    held, written = [], []
    real_empty, real_write = _tune.aligned_empty, AsyncIO.write

    def empty(nbytes, **kw):
        held.append(nbytes)
        return real_empty(nbytes, **kw)

    def write(self, tensor, path, offset=0, label=""):
        written.append((offset, tensor.numel()))
        return real_write(self, tensor, path, offset, label)

    monkeypatch.setattr(_tune, "aligned_empty", empty)
    monkeypatch.setattr(AsyncIO, "write", write)
    size = (1 << 20) + 4096  # 16 pieces and a 4 KiB tail
    points, _ = _tune.sweep(str(tmp_path), size, [16 << 10], [2], [1])
    assert held == [64 << 10] and points[0].write_gbps > 0 and points[0].read_gbps > 0
    passes = [written[i : i + 17] for i in range(0, len(written), 17)]
    assert len(passes) == 2  # the layout pass and the measured one, each the whole file
    assert all(sorted(p) == [(i * (64 << 10), 64 << 10) for i in range(16)] + [(1 << 20, 4096)]
               for p in passes)  # fmt: skip
    assert os.listdir(tmp_path) == []


def test_ctrl_c_stops_the_sweep_with_one_line(tmp_path):
    """Ctrl-C in a sweep (minutes on a real disk) printed a KeyboardInterrupt traceback."""
    argv = ["--path", str(tmp_path), "--size", "16MiB", "--block-sizes", "4KiB", "--threads", "1"]
    argv += ["--queue-depths", ",".join(str(q) for q in range(1, 41))]
    proc = subprocess.Popen(
        [sys.executable, "-m", "offload", "tune-io", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)), preexec_fn=default_sigint,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not os.listdir(tmp_path):
            time.sleep(0.05)  # the scratch directory is made: the sweep has started
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130 and err.strip().endswith("offload tune-io: interrupted"), err
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == []  # the scratch file is removed


@pytest.mark.parametrize("value", ["0", "-2"])
def test_repeats_below_one_is_refused_not_run_once(tmp_path, capsys, value):
    """`--repeats 0` swept once unsaid: a median over runs the user did not ask for."""
    argv = ["tune-io", "--path", str(tmp_path), "--size", "64KiB", "--queue-depths", "1"]
    argv += ["--threads", "1", "--block-sizes", "4KiB", "--repeats", value]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--repeats" in err and value in err and ">= 1" in err
    assert os.listdir(tmp_path) == []  # nothing measured
