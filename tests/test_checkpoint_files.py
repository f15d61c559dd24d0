"""The checkpoint file layer on its own (no model): streaming in bounded memory both ways,
slices read back exactly, files written by it are ordinary safetensors, and the pointer and
directory rules of a commit."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from offload.api import checkpoint_files as cf

MIB = 1 << 20


def _pieces(total: int, piece: int, dtype=torch.float32):
    """``total`` elements as pieces of ``piece``; element i is i mod 1000 (cheap to check)."""

    def produce():
        for lo in range(0, total, piece):
            yield (torch.arange(lo, min(lo + piece, total)) % 1000).to(dtype)

    return produce


def _save(root: Path, name: str, numel: int, keep_last: int = 1) -> Path:
    with cf.CheckpointWriter(root, name) as out:
        out.add_file(
            "big.safetensors",
            [
                ("a", torch.float32, [numel], _pieces(numel, MIB // 4)),
                ("b", torch.bfloat16, [3, 5], _pieces(15, 15, torch.bfloat16)),
                ("empty", torch.float32, [0], lambda: iter(())),
            ],
        )
        return out.commit({"note": name}, keep_last)


def test_save_and_verify_stream_in_bounded_memory(tmp_path):
    numel = 24 * MIB  # a 96 MiB tensor, produced 1 MiB at a time
    tracemalloc.start()
    try:
        ckpt = _save(tmp_path, "ckpt-1", numel)
        _, save_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with cf.open_checkpoint(ckpt) as verified:
            _, verify_peak = tracemalloc.get_traced_memory()
            part = verified.read("big.safetensors", "a", numel - 7, numel).clone()
            b = verified.read("big.safetensors", "b", 0, 15)  # borrowed: valid until next read
    finally:
        tracemalloc.stop()
    size = (ckpt / "big.safetensors").stat().st_size
    assert size > 96 * MIB
    assert save_peak < 8 * MIB, save_peak
    assert verify_peak < cf.CHUNK + 4 * MIB, verify_peak
    assert torch.equal(part, (torch.arange(numel - 7, numel) % 1000).float())
    assert torch.equal(b, (torch.arange(15) % 1000).to(torch.bfloat16))
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["files"]["big.safetensors"]["size"] == size
    assert meta["version"] == cf.VERSION and meta["note"] == "ckpt-1"


def test_written_files_are_plain_safetensors(tmp_path):
    ckpt = _save(tmp_path, "ckpt-1", 1000)
    plain = load_file(str(ckpt / "big.safetensors"))
    assert torch.equal(plain["a"], (torch.arange(1000) % 1000).float())
    assert plain["b"].shape == (3, 5) and plain["empty"].numel() == 0


def test_commit_pointer_cleanup_and_resolve(tmp_path):
    first = _save(tmp_path, "ckpt-00000001-10", 10)
    (tmp_path / ".ckpt-00000000-5.tmp").mkdir()  # a save that was killed
    second = _save(tmp_path, "ckpt-00000002-20", 10, keep_last=2)
    assert cf.resolve(tmp_path) == second
    assert cf.resolve(first) == first  # a checkpoint directory is its own answer
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-00000001-10",
        "ckpt-00000002-20",
        "latest",
    ]
    _save(tmp_path, "ckpt-00000003-30", 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000003-30", "latest"]
    (tmp_path / "latest").write_text("ckpt-9\n")
    with pytest.raises(cf.CheckpointNotFoundError, match="names 'ckpt-9', which is incomplete"):
        cf.resolve(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        cf.resolve(tmp_path / "ckpt-00000003-30" / "nothing")


def test_keep_last_prunes_only_checkpoints_and_the_oldest_written(tmp_path):
    """The pruning removed every directory named ``ckpt-*`` (a user's ``ckpt-best`` with their
    own files) and kept the highest steps, not the last saves: after a resume from an earlier
    step it deleted the save just before the new one and kept the abandoned run's."""
    mine = tmp_path / "ckpt-best"
    mine.mkdir()
    (mine / "weights.pt").write_text("not offload's")
    (tmp_path / ".ckpt-old.tmp").mkdir()  # not a name a save gives its temp directory
    _save(tmp_path, "ckpt-00000010-100", 10, keep_last=2)  # the abandoned run's last
    _save(tmp_path, "ckpt-00000006-200", 10, keep_last=2)  # resumed at step 5
    _save(tmp_path, "ckpt-00000007-300", 10, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".ckpt-old.tmp",
        "ckpt-00000006-200",
        "ckpt-00000007-300",
        "ckpt-best",
        "latest",
    ]
    assert (mine / "weights.pt").read_text() == "not offload's"


def test_a_latest_pointer_of_another_tool_is_not_replaced(tmp_path):
    """A DeepSpeed output directory holds its own ``latest`` ("global_step100"): a save there
    replaced it, and DeepSpeed's load of the directory no longer found its checkpoint. Now
    the save is refused before writing, naming the pointer; offload's own pointer (also one
    naming a checkpoint since removed) is replaced as before."""
    (tmp_path / "global_step100").mkdir()
    (tmp_path / "global_step100" / "mp_rank_00_model_states.pt").write_bytes(b"deepspeed")
    (tmp_path / "latest").write_text("global_step100")
    with pytest.raises(FileExistsError, match=r"latest' names 'global_step100'.*not an offload"):
        _save(tmp_path, "ckpt-00000001-10", 10)
    assert (tmp_path / "latest").read_text() == "global_step100"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step100", "latest"]
    (tmp_path / "latest").write_text("ckpt-00000000-5\n")  # a checkpoint since removed
    assert cf.resolve(_save(tmp_path, "ckpt-00000001-10", 10)) == tmp_path / "ckpt-00000001-10"


def test_a_failed_write_leaves_no_temp_directory(tmp_path):
    def broken():
        yield torch.zeros(4)
        raise OSError(28, "No space left on device (injected)")

    with pytest.raises(OSError, match="No space left"):
        with cf.CheckpointWriter(tmp_path, "ckpt-1") as out:
            out.add_file("x.safetensors", [("x", torch.float32, [8], broken)])
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_disk(tmpfs):
    """A tmpfs of 2,560 KiB (skipped where mounting is not permitted)."""
    return tmpfs("disk", "size=2560k")


def test_a_killed_save_does_not_keep_its_space_from_the_next(small_disk, caplog):
    """A save killed after writing its files left its temp directory, removed only by the
    next save's commit: on a disk that holds two checkpoints (the old one and the new one
    while it is written) the next save needed a third and failed with ENOSPC, and so did
    every save after it. The temp directories of killed saves are now removed before a save
    writes (one process saves into a directory at a time: Note: commit), with a warning."""
    numel = 256 * 1024  # 1 MiB of float32
    first = _save(small_disk, "ckpt-00000001-10", numel)
    killed = small_disk / ".ckpt-00000002-15.tmp"
    killed.mkdir()
    (killed / "big.safetensors").write_bytes(first.joinpath("big.safetensors").read_bytes())
    with caplog.at_level("WARNING", logger="offload.checkpoint"):
        second = _save(small_disk, "ckpt-00000002-20", numel)
    assert sorted(p.name for p in small_disk.iterdir()) == ["ckpt-00000002-20", "latest"]
    assert cf.resolve(small_disk) == second
    assert f"removed '{killed}'" in caplog.text and "a save that did not finish" in caplog.text


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs."""


def test_a_save_killed_while_removing_an_old_checkpoint_leaves_no_half_of_it(
    small_disk, monkeypatch
):
    """A save killed while its commit deleted the checkpoint before it (``keep_last``) left
    that one half deleted under its own name: a ``ckpt-*`` directory with files missing,
    removed by no later save until one committed, so on a disk that holds two checkpoints
    every later save failed with ENOSPC. The commit now renames a checkpoint out of the way
    before deleting it, and a save removes what a killed one left half deleted first."""
    numel = 256 * 1024  # 1 MiB of float32
    _save(small_disk, "ckpt-00000001-10", numel)

    def killed_half_way(path, ignore_errors=False):
        (Path(path) / "meta.json").unlink()  # the data file stays: most of the bytes
        raise _Killed

    monkeypatch.setattr(cf.shutil, "rmtree", killed_half_way)
    with pytest.raises(_Killed):
        _save(small_disk, "ckpt-00000002-20", numel)
    monkeypatch.undo()
    assert cf.resolve(small_disk).name == "ckpt-00000002-20"
    assert "ckpt-00000001-10" not in [p.name for p in small_disk.iterdir()]
    third = _save(small_disk, "ckpt-00000003-30", numel)
    assert sorted(p.name for p in small_disk.iterdir()) == ["ckpt-00000003-30", "latest"]
    assert cf.resolve(small_disk) == third


def test_meta_seal_round_trips_awkward_values(tmp_path):
    extra = {"t": (1, 2.5), "k": {3: "int key"}, "nan": float("nan"), "s": "\u00e9\ud800"}
    with cf.CheckpointWriter(tmp_path, "ckpt-1") as out:
        ckpt = out.commit({"extra": extra})
    with cf.open_checkpoint(ckpt) as verified:
        assert verified.meta["extra"]["t"] == [1, 2.5]
        assert verified.meta["extra"]["k"] == {"3": "int key"}
