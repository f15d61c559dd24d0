"""SIGKILL during save_checkpoint: whatever line the save had reached, a fresh process loads
the latest complete checkpoint and resumes bitwise identically to an uninterrupted run.

A worker (tests/_save_worker.py) trains, saves checkpoint A, trains one more step and saves B,
killing itself with SIGKILL just before the K-th line that B's save runs (in checkpoint.py or
checkpoint_files.py). A calibration run lists every line of such a save, so the kill points
can be spread over all of it and aimed at each phase: the unit files, meta.json, the window
between the rename and the ``latest`` pointer, and the cleanup after it. After each kill a
fresh process loads ``latest`` (A if the pointer had not been replaced yet, B after), trains to
the end and is compared with the uninterrupted run: model, optimizer state, counters, learning
rate and every loss. It then saves once more, which must leave exactly ``latest`` and that one
checkpoint (the killed save's temp directory and pointer file are gone).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _save_worker
import pytest
import torch

A_STEP, STEPS = 2, 4  # as in _save_worker.py


def _forkserver():
    ctx = multiprocessing.get_context("forkserver")
    # children fork from a server that imported torch once (seconds per child); each imports
    # offload itself, from the parent's sys.path
    ctx.set_forkserver_preload(["torch", "torch._dynamo"])
    return ctx


# Two threads start and join workers. multiprocessing's start() polls every child it has
# started (``multiprocessing.process._cleanup``), and a forkserver child's poll reads its exit
# status from a pipe the server writes once: a thread joining its worker while another starts
# one could both read it, and the loser took EOF for exit code 255 (a CI failure). Every start
# and join holds this lock; waiting for a worker to end does not.
_PROCESSES = threading.Lock()


def _worker(*args) -> int:
    """Runs ``_save_worker.run(args)`` in a new process; returns its exit code (-9: SIGKILL)."""
    proc = _forkserver().Process(target=_save_worker.run, args=([str(a) for a in args],))
    with _PROCESSES:
        proc.start()
    ended = multiprocessing.connection.wait([proc.sentinel], 300)
    with _PROCESSES:
        if not ended:
            proc.kill()
        proc.join()
    if not ended:
        pytest.fail(f"_save_worker {args} did not finish in 300 s")
    return proc.exitcode


def _ok(code: int, workdir: Path) -> None:
    err = workdir / "error.txt"
    assert code == 0, err.read_text()[-3000:] if err.exists() else f"exit code {code}"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The uninterrupted run and the list of lines a save runs, in two processes at once."""
    root = tmp_path_factory.mktemp("kill_baseline")
    with ThreadPoolExecutor(2) as pool:
        codes = list(pool.map(lambda m: _worker(m, root), ("full", "calibrate")))
    for code in codes:
        _ok(code, root)
    events = json.loads((root / "events.json").read_text())
    tested = Path(json.loads((root / "offload_file.json").read_text()))
    assert tested.parent.parent == Path(__file__).parent.parent  # this checkout's offload
    return {
        "full": torch.load(root / "full.pt"),
        "losses": json.loads((root / "full.json").read_text()),
        "events": events,
        "bounds": _bounds(events),
    }


def _bounds(events: list) -> dict[str, int]:
    """1-based indices of the lines that separate the save's phases."""

    def first(pred, after: int = 0) -> int:
        return next(i + 1 for i, e in enumerate(events) if i + 1 > after and pred(e))

    rename = first(lambda e: "os.rename(" in e[3])
    return {
        "commit": first(lambda e: e[1] == "commit"),
        "meta_write": first(lambda e: e[1] == "_write_text" and e[3].startswith("f.write")),
        "rename": rename,
        "latest_write": first(
            lambda e: e[1] == "_write_text" and e[3].startswith("f.write"), rename
        ),
        "replace": first(lambda e: "os.replace(pointer" in e[3]),
        "cleanup": first(lambda e: "os.rename(p, gone)" in e[3]),
        "end": len(events),
    }


def phase_of(k: int, b: dict[str, int]) -> str:
    if k < b["commit"]:
        return "unit files"
    if k <= b["rename"]:
        return "meta.json"
    if k <= b["replace"]:
        return "renamed, latest not yet"
    return "after latest"


def spread_points(b: dict[str, int], n: int = 20) -> list[int]:
    """``n`` kill points: the edges of every phase, and the rest spread evenly over the save."""
    aimed = {
        b["meta_write"] - 1,  # every unit file done, meta.json not created
        b["meta_write"],  # meta.json created empty
        b["meta_write"] + 1,  # written into Python's buffer, not flushed
        b["meta_write"] + 2,  # flushed, not fsynced
        b["rename"],  # complete temp directory, not renamed
        b["rename"] + 1,  # renamed, root not fsynced
        b["latest_write"],  # latest.tmp created empty
        b["replace"],  # latest.tmp complete, latest still names A
        b["replace"] + 1,  # latest names B, root not fsynced
        b["cleanup"],  # deleting A
    }
    m = n - len(aimed)
    even = {1 + round(i * (b["end"] - 1) / (m - 1)) for i in range(m)} - aimed
    while len(even) < m:  # an even point fell on an aimed one: take a midpoint instead
        pts = sorted(aimed | even)
        gap = max(range(len(pts) - 1), key=lambda i: pts[i + 1] - pts[i])
        even.add((pts[gap] + pts[gap + 1]) // 2)
    return sorted(aimed | even)


def _kill_and_resume(root: Path, k: int) -> dict:
    root.mkdir()
    code = _worker("kill", root, k)
    assert code == -signal.SIGKILL, (k, code, (root / "error.txt").exists())
    _ok(_worker("resume", root), root)
    report = json.loads((root / "resume_report.json").read_text())
    report["state"] = torch.load(root / "resume.pt")
    report["losses"] = json.loads((root / "resume.json").read_text())
    return report


def check_resumes(baseline, tmp_path: Path, points: list[int]) -> list[tuple]:
    b = baseline["bounds"]
    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(lambda k: _kill_and_resume(tmp_path / f"k{k:05d}", k), points))
    full = baseline["full"]
    table = []
    for k, rep in zip(points, reports):
        phase = phase_of(k, b)
        where = baseline["events"][k - 1]
        expect_step = A_STEP + 1 if k > b["replace"] else A_STEP
        assert rep["loaded_step"] == expect_step, (k, phase, where, rep["loaded_step"])
        assert rep["losses"] == baseline["losses"][expect_step:], (k, phase, where)
        state = rep["state"]
        for part in ("model", "opt"):
            assert set(state[part]) == set(full[part])
            for name, v in full[part].items():
                assert torch.equal(v, state[part][name]), (k, phase, where, part, name)
        assert state["offload"] == full["offload"] and state["lr"] == full["lr"]
        assert rep["after_save"] == sorted(["latest", rep["saved"]]), (k, rep["after_save"])
        table.append((k, phase, f"{where[0]}:{where[2]} {where[3][:50]}", rep["loaded_step"]))
    print(f"\n{len(table)} SIGKILL points (save of B = {b['end']} lines), all resumed bitwise:")
    for row in table:
        k, phase, where, step = row
        print(f"  line {k:5d}  {phase:24s}  {where:66s}  resumed from step {step}")
    return table


@pytest.mark.heavy  # (siblings in the default suite: test_swap_reclaim, test_checkpoint_faults)
def test_sigkill_at_three_points_of_a_save_resumes_bitwise(baseline, tmp_path):
    b = baseline["bounds"]
    points = [b["commit"] // 2, b["replace"], b["cleanup"]]
    table = check_resumes(baseline, tmp_path, points)
    assert [row[1] for row in table] == ["unit files", "renamed, latest not yet", "after latest"]


@pytest.mark.slow
def test_sigkill_at_twenty_points_of_a_save_resumes_bitwise(baseline, tmp_path):
    points = spread_points(baseline["bounds"])
    assert len(points) == 20
    table = check_resumes(baseline, tmp_path, points)
    phases = {row[1] for row in table}
    assert phases == {"unit files", "meta.json", "renamed, latest not yet", "after latest"}
