"""Swap space survives crashes (issue 13, part 2; part 4's SIGKILL during training).

A process killed by SIGKILL cannot clean up, so each swap directory records its owner and the
next store on the same ``nvme_path`` removes the directories of owners that are provably gone,
logs what it freed, and never touches a live process's directory. The decision itself
(``offload.io._owner.judge``) is tested on records: dead pid, reused pid, zombie, reboot, other
host or pid namespace, ``keep``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from children import ROOT, TIMEOUT, default_sigint, start_worker, wait_for_step
from engine_models import batches, lm_loss, make_model, placement_config

import offload
from offload.io import NvmeStore, _owner, nvme_store

LIVE_OWNER = """
import sys
from offload.io import NvmeStore
store = NvmeStore(sys.argv[1])
store.allocate("k", 1 << 20)
print(store.directory, flush=True)
sys.stdin.read()  # alive until the test closes our stdin
store.close()
"""


def swap_dirs(path: Path) -> set[str]:
    return {str(p) for p in path.glob(_owner.PREFIX + "*")}


def test_sigkilled_run_is_reclaimed_and_resumed_and_a_live_dir_is_left_alone(tmp_path, caplog):
    # a live process owns a directory on the path the runs below share
    (tmp_path / "nvme_o").mkdir()
    live = subprocess.Popen(
        [sys.executable, "-c", LIVE_OWNER, str(tmp_path / "nvme_o")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=str(tmp_path),
        preexec_fn=default_sigint,
    )
    try:
        live_dir = live.stdout.readline().strip()
        assert os.path.isdir(live_dir), live_dir
        live_files = sorted(os.listdir(live_dir))
        # a training run saves a checkpoint at step 2, then dies by SIGKILL mid-training
        proc = start_worker(tmp_path, "checkpoint")
        wait_for_step(proc, 3)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == -signal.SIGKILL
        dead = (swap_dirs(tmp_path / "nvme_p") | swap_dirs(tmp_path / "nvme_o")) - {live_dir}
        assert len(dead) == 2 and all(_owner.disk_bytes(d) > 0 for d in dead)
        # the next run on the same paths starts, reclaims the dead run's space, and resumes
        with caplog.at_level(logging.INFO, logger="offload.io"):
            model, opt = offload.wrap(make_model(), placement_config("nvme", "nvme", tmp_path))
        try:
            for d in dead:
                assert not os.path.exists(d), d
                logged = [r for r in caplog.records if d in r.getMessage()]
                assert len(logged) == 1 and logged[0].levelno == logging.WARNING
                assert "reclaimed" in logged[0].getMessage() and "bytes" in logged[0].getMessage()
                assert f"process {proc.pid} " in logged[0].getMessage()
            assert os.path.isdir(live_dir) and sorted(os.listdir(live_dir)) == live_files
            offload.load_checkpoint(tmp_path / "ckpt", model, opt)
            expected = torch.load(tmp_path / "at_step2.pt")
            got = model.state_dict()
            assert all(torch.equal(got[k], v) for k, v in expected.items())
            lm_loss(model, batches(1)[0]).backward()
            opt.step()
        finally:
            opt.close()
    finally:
        live.stdin.close()
        live.wait(timeout=TIMEOUT)
    assert live.returncode == 0 and not os.path.exists(live_dir)


def test_reclaim_leaves_alone_what_it_cannot_prove_dead(tmp_path):
    path = tmp_path / "swap"
    path.mkdir()
    keep = NvmeStore(path, keep=True)  # kept on purpose: never reclaimed, even when its owner dies
    keep.allocate("k", 4096)
    keep.close()
    record = json.loads((Path(keep.directory) / _owner.RECORD).read_text())
    assert record["keep"] is True and record["pid"] == os.getpid()
    _rewrite(Path(keep.directory), pid=_dead_pid())
    no_record = path / "offload-norecord"  # e.g. a crash between mkdtemp and the record
    no_record.mkdir()
    (no_record / "shards-000.bin").write_bytes(b"x" * 4096)
    other_tool = path / "mine"
    other_tool.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _owner.write_record(str(elsewhere), keep=False)
    _rewrite(elsewhere, pid=_dead_pid())
    (path / "offload-link").symlink_to(elsewhere)  # a link is never followed
    half_done = path / (_owner.RECLAIMING + "offload-abc")  # a reclaimer died half way
    half_done.mkdir()
    (half_done / "shards-000.bin").write_bytes(b"x")
    freed = _owner.reclaim(str(path))
    assert freed == []
    assert not half_done.exists()
    for survivor in (Path(keep.directory), no_record, other_tool, path / "offload-link", elsewhere):
        assert survivor.exists(), survivor


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs."""


def test_a_store_killed_while_removing_its_files_is_reclaimed(tmp_path, monkeypatch):
    """A process killed while its store removed the swap directory (SIGTERM's cleanup cut
    short by the SIGKILL that follows it, a large file's unlink taking seconds) could have
    deleted ``owner.json`` and not the data file: a directory without a record is never
    reclaimed, so its bytes stayed on the disk for good. The store now renames its directory
    to the reclaiming name before deleting it, which the next store on the path removes."""
    path = tmp_path / "swap"
    store = NvmeStore(path)
    store.allocate("k", 1 << 20)
    store.write("k", torch.ones(1 << 18)).wait()
    directory = Path(store.directory)

    def killed_half_way(tree, ignore_errors=False):
        (Path(tree) / _owner.RECORD).unlink()  # the record first, the data file not yet
        raise _Killed

    monkeypatch.setattr(nvme_store.shutil, "rmtree", killed_half_way)
    with pytest.raises(_Killed):
        store.close()
    monkeypatch.undo()
    left = [p for p in path.iterdir()]
    assert len(left) == 1 and _owner.disk_bytes(str(left[0])) >= 1 << 20, left
    assert not directory.exists()  # nothing that looks like a swap directory without an owner
    NvmeStore(path).close()  # the next store on the path
    assert list(path.iterdir()) == []


def test_two_stores_starting_at_once_reclaim_a_dead_dir_once(tmp_path):
    dead = tmp_path / "offload-dead"
    dead.mkdir()
    _owner.write_record(str(dead), keep=False)
    _rewrite(dead, pid=_dead_pid())
    (dead / "shards-000.bin").write_bytes(b"x" * 8192)
    first = _owner.reclaim(str(tmp_path))
    second = _owner.reclaim(str(tmp_path))
    assert [d for d, _ in first] == [str(dead)] and first[0][1] >= 8192 and second == []


# ---- the verdict on an owner record -------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _rewrite(directory: Path, **changes) -> None:
    path = directory / _owner.RECORD
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_verdicts():
    me = _owner.this_process(keep=False)
    assert _owner.judge(me) == _owner.Verdict(False, f"process {os.getpid()} is running")
    reused = dict(me, start_ticks=me["start_ticks"] - 1)  # same pid, an earlier process
    assert _owner.judge(reused).gone and "newer process" in _owner.judge(reused).why
    dead = dict(me, pid=_dead_pid())
    assert _owner.judge(dead).gone and "no longer exists" in _owner.judge(dead).why
    assert _owner.judge(dict(dead, boot_id="another-boot")).gone
    for uncertain in (
        dict(dead, host="another-host"),
        dict(dead, pid_namespace="pid:[1]"),
        dict(dead, keep=True),
        dict(dead, start_ticks=None),
        {"pid": "x"},
        {},
    ):
        assert not _owner.judge(uncertain).gone, uncertain


def test_a_zombie_owner_is_gone():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        record = dict(_owner.this_process(keep=False), pid=proc.pid)
        record["start_ticks"] = _owner._proc_stat(proc.pid)[1]
        assert not _owner.judge(record).gone  # running
        proc.kill()  # not reaped yet: a zombie that still holds its pid and start time
        deadline = time.monotonic() + 10
        while _owner._proc_stat(proc.pid)[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _owner.judge(record).gone and "zombie" in _owner.judge(record).why
    finally:
        proc.wait()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_start_time_is_field_22_of_proc_stat():
    with open("/proc/self/stat") as f:
        expected = int(f.read().rsplit(")", 1)[1].split()[19])
    assert _owner._proc_stat(os.getpid()) == ("R", expected)


def _dead_store(path: Path) -> Path:
    """A swap directory (with a file) whose owner was killed, as a SIGKILL leaves one."""
    store = NvmeStore(path, keep=True)  # keep: its close leaves the directory and its file
    store.allocate("k", 1 << 20)
    store.close()
    _rewrite(Path(store.directory), pid=_dead_pid(), keep=False)
    return Path(store.directory)


@pytest.mark.parametrize("killed_world", [1, 2], ids=["killed-1-rank", "killed-2-ranks"])
def test_a_run_at_another_rank_count_reclaims_the_killed_run_s_swap(tmp_path, killed_world):
    """A two-rank run killed by SIGKILL leaves its swap in ``nvme_path/rank-00000`` and
    ``rank-00001``; the run resumed on one process (a checkpoint reshards to any rank count)
    swaps in ``nvme_path`` itself and reclaimed only there: the killed run's files stayed for
    good (4.1 MB of a TinyLM's 8.3 here, all of a 7B run's params and Adam state on a real
    one), and a one-rank run's were never reclaimed by two ranks. Every store now reclaims
    ``nvme_path`` and each ``rank-NNNNN`` under it."""
    from offload.api.wrap import swap_dirs  # noqa: PLC0415

    nvme = tmp_path / "nvme"
    if killed_world == 1:
        dead = [_dead_store(nvme)]
        (nvme / "rank-00001").mkdir()
        here = swap_dirs(str(nvme))  # what a rank of a two-rank run reclaims
        assert str(nvme) in here
        for d in here:
            _owner.reclaim(d)
    else:
        dead = [_dead_store(nvme / f"rank-{r:05d}") for r in range(2)]
        cfg = placement_config("nvme", "cpu", tmp_path)
        cfg["offload_param"]["nvme_path"] = str(nvme)
        model, opt = offload.wrap(make_model(), cfg)
        opt.close()
    assert [d for d in dead if d.exists()] == []


@pytest.mark.parametrize("where", ["record", "engine"])
def test_a_ctrl_c_while_a_store_is_made_leaves_no_directory(
    tmp_path, monkeypatch, python_ctrl_c, where
):
    """A Ctrl-C while ``NvmeStore`` wrote its owner record left the private directory with an
    ``owner.json.tmp`` (``_ctrl_c_points.py``, PHASE wrap), and one after the record, before
    the store was tracked, the directory alone: neither is ever reclaimed (an owner record it
    cannot read is never judged gone). Now the directory goes with the error."""
    real_record = _owner.this_process

    def record(keep):
        os.kill(os.getpid(), signal.SIGINT)  # delivered as the record's write goes on
        return real_record(keep)

    def aio(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "record":
        monkeypatch.setattr(_owner, "this_process", record)
    else:
        monkeypatch.setattr(nvme_store, "AsyncIO", aio)
    with pytest.raises(KeyboardInterrupt):
        NvmeStore(tmp_path)
    assert list(tmp_path.iterdir()) == []
