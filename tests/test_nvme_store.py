"""NvmeStore: round trips, private files, validity of incomplete writes, checksums, and the
errors users hit (ENOSPC on a tiny real filesystem, EIO by fault injection, EROFS, EACCES,
a path that cannot be created), over both IO backends."""

import errno
import os
import subprocess
import sys

import pytest
import torch

from offload import _native
from offload.io import AsyncIO, NvmeStore, OffloadIOError, faults


@pytest.fixture(params=["native", "fallback"])
def aio(request):
    if request.param == "native":
        mod = _native.get() if _native.available() else None
        if mod is None or not hasattr(mod, "AioEngine"):
            pytest.skip("native AioEngine not built")
        engine = AsyncIO(block_size=16384, queue_depth=4)
    else:
        with _native.force_fallback():
            engine = AsyncIO(block_size=16384, queue_depth=4)
    yield engine
    faults.clear()
    engine.close()


def test_round_trip_many_shards_with_checksum(aio, tmp_path):
    gen = torch.Generator().manual_seed(0)
    sizes = {"a": 1, "b": 7, "c": 1023, "d": 4096, "e": (1 << 20) + 3, "f": 0}
    with NvmeStore(tmp_path, aio=aio, checksum=True) as store:
        data = {}
        for k, n in sizes.items():
            store.allocate(k, n)
            data[k] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
        handles = [store.write(k, t) for k, t in data.items()]  # all in flight together
        for h in handles:
            h.wait()
        outs = {k: torch.zeros(n, dtype=torch.uint8) for k, n in sizes.items()}
        handles = [store.read(k, outs[k]) for k in sizes]
        for h in handles:
            h.wait()
        for k in sizes:
            assert torch.equal(outs[k], data[k]), k
            assert store.nbytes(k) == sizes[k] and store.contains(k) and store.written(k)
        assert store.keys() == list(sizes)
        st = store.stats()
        assert st["shards"] == 6 and st["checksum_failures"] == 0
        assert st["bytes_read"] == st["bytes_written"] == sum(sizes.values())


def test_private_permissions_and_cleanup(aio, tmp_path):
    store = NvmeStore(tmp_path, aio=aio)
    store.allocate("k", 10_000)
    store.write("k", torch.ones(2500)).wait()
    d = store.directory
    assert os.path.dirname(d) == str(tmp_path)
    assert os.stat(d).st_mode & 0o777 == 0o700
    files = os.listdir(d)
    assert files and all(os.stat(os.path.join(d, f)).st_mode & 0o777 == 0o600 for f in files)
    store.close()
    assert not os.path.exists(d)
    kept = NvmeStore(tmp_path, aio=aio, keep=True)
    kept.allocate("k", 4096)
    kept.close()
    assert os.path.isdir(kept.directory) and os.listdir(kept.directory)


def test_unwritten_and_partially_written_shards_are_not_readable(aio, tmp_path):
    with NvmeStore(tmp_path, aio=aio) as store:
        store.allocate("k", 3 * 4096)
        out = torch.empty(3 * 4096, dtype=torch.uint8)
        with pytest.raises(OffloadIOError) as info:
            store.read("k", out)
        assert info.value.errno == errno.ENODATA and "'k'" in str(info.value)
        half = torch.full((4096,), 9, dtype=torch.uint8)
        store.write("k", half, offset=4096).wait()
        store.read("k", out[:4096], offset=4096).wait()  # the written range is readable
        assert int(out[:4096].min()) == 9
        with pytest.raises(OffloadIOError, match=r"bytes \[0, 12288\) were never"):
            store.read("k", out)
        with pytest.raises(KeyError, match="unknown key 'zz'"):
            store.read("zz", out)
        with pytest.raises(ValueError, match="multiple of 4096"):
            store.write("k", half, offset=100)
        with pytest.raises(ValueError, match="pass the end"):
            store.write("k", out, offset=4096)


def test_read_after_unwaited_write_sees_the_data(aio, tmp_path):
    with NvmeStore(tmp_path, aio=aio) as store:
        store.allocate("k", 1 << 20)
        src = torch.randn(1 << 18)
        store.write("k", src)  # never waited by the writer
        out = torch.empty_like(src)
        store.read("k", out).wait()
        assert torch.equal(out, src)


def test_failed_write_leaves_shard_unreadable(aio, tmp_path):
    with NvmeStore(tmp_path, aio=aio) as store:
        store.allocate("k", 65536)
        good = torch.ones(16384)
        store.write("k", good).wait()
        faults.inject(errno.EIO, count=1, op="write")
        h = store.write("k", torch.zeros(16384))
        with pytest.raises(OSError) as info:
            h.wait()
        assert info.value.errno == errno.EIO
        assert info.value.filename.startswith(store.directory)
        with pytest.raises(OffloadIOError, match="never completely written.*last write failed"):
            store.read("k", torch.empty(16384))


def test_unwaited_failed_write_is_caught_by_the_read(aio, tmp_path):
    with NvmeStore(tmp_path, aio=aio) as store:
        store.allocate("k", 4096)
        faults.inject(errno.EIO, count=1, op="write")
        store.write("k", torch.ones(1024))
        with pytest.raises(OffloadIOError, match="Input/output error"):
            store.read("k", torch.empty(1024))


def test_checksum_mismatch_is_detected(aio, tmp_path):
    with NvmeStore(tmp_path, aio=aio, checksum=True) as store:
        store.allocate("a", 8192)
        store.allocate("b", 8192)
        src = torch.arange(2048, dtype=torch.float32)
        store.write("a", src).wait()
        store.write("b", src).wait()
        path = os.path.join(store.directory, os.listdir(store.directory)[0])
        fd = os.open(path, os.O_WRONLY)
        os.pwrite(fd, b"\xff", 8192 + 100)  # flip a byte of shard "b" behind the store's back
        os.close(fd)
        out = torch.empty_like(src)
        store.read("a", out).wait()
        assert torch.equal(out, src)
        with pytest.raises(OffloadIOError) as info:
            store.read("b", out).wait()
        assert info.value.errno == errno.EBADMSG and "'b'" in str(info.value)
        assert store.stats()["checksum_failures"] == 1


def test_free_reuses_extents(aio, tmp_path):
    with NvmeStore(tmp_path, aio=aio) as store:
        store.allocate("a", 8192)
        store.allocate("b", 4096)
        reserved = store.stats()["reserved_bytes"]
        store.free("a")
        store.allocate("c", 5000)  # fits a's old extent
        assert store.stats()["reserved_bytes"] == reserved
        assert not store.contains("a") and store.contains("c")
        with pytest.raises(ValueError, match="exceeds its extent"):
            store.allocate("c", 100_000)


def test_enospc_on_a_tiny_filesystem(aio, tmpfs):
    d = tmpfs("tiny", "size=1m")
    with NvmeStore(d, aio=aio) as store:
        store.allocate("fits", 256 * 1024)
        with pytest.raises(OSError) as info:
            store.allocate("too-big", 4 << 20)
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename.startswith(str(d))
        assert "'too-big'" in str(info.value)
        # the store still works after the failure
        store.write("fits", torch.ones(65536)).wait()
        out = torch.empty(65536)
        store.read("fits", out).wait()
        assert torch.equal(out, torch.ones(65536))


def test_read_only_path(tmpfs):
    d = tmpfs("ro", "size=1m", "ro")
    with pytest.raises(OSError) as info:
        NvmeStore(d)
    assert info.value.errno == errno.EROFS and info.value.filename == str(d)
    assert "writable" in str(info.value)


def test_missing_path_is_created_private_and_a_file_is_refused(tmp_path):
    missing = tmp_path / "a" / "b" / "swap"
    with NvmeStore(missing) as store:
        assert os.path.dirname(store.directory) == str(missing)
        for level in (tmp_path / "a", tmp_path / "a" / "b", missing):
            assert os.stat(level).st_mode & 0o777 == 0o700, level
    assert os.listdir(missing) == []  # the private directory went with close(); the path stays
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError) as info:
        NvmeStore(tmp_path / "file")
    assert info.value.filename == str(tmp_path / "file") and "nvme_path" in str(info.value)
    # a path that cannot be created: the error names it, the level that failed and the errno
    below_a_file = tmp_path / "file" / "swap"
    with pytest.raises(OSError) as info:
        NvmeStore(below_a_file)
    assert info.value.errno == errno.ENOTDIR and info.value.filename == str(below_a_file)
    assert "cannot be created" in str(info.value) and "ENOTDIR" in str(info.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to an unprivileged user")
def test_permission_denied_names_the_path(tmp_path):
    d = tmp_path / "locked"
    d.mkdir(mode=0o500)
    for parent in [tmp_path, *tmp_path.parents]:  # let the unprivileged user reach d
        if parent != parent.parent:
            os.chmod(parent, os.stat(parent).st_mode | 0o005)
    code = (
        "import os, sys, errno\n"
        "from offload.io import NvmeStore\n"  # import as root, then drop privileges
        "os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        f"    NvmeStore({str(d)!r})\n"
        "except PermissionError as e:\n"
        "    print('errno', e.errno, 'file', e.filename); sys.exit(0)\n"
        "sys.exit(3)\n"
    )
    env = dict(os.environ, OFFLOAD_NATIVE="0", PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert f"errno {errno.EACCES} file {d}" in out.stdout


def test_failed_write_does_not_block_a_later_write_of_the_same_range(tmp_path):
    """A write that fails leaves the range invalid, and the next successful write of that range
    makes it readable again (the failed write's record must not count as a newer write)."""
    with AsyncIO() as aio, NvmeStore(tmp_path, aio=aio) as store:
        store.allocate("k", 8192)
        data = torch.arange(2048, dtype=torch.float32)
        faults.inject(5, count=1, op="write")  # EIO
        try:
            with pytest.raises(OSError):
                store.write("k", data).wait()
        finally:
            faults.clear()
        store.write("k", data).wait()
        out = torch.empty_like(data)
        store.read("k", out).wait()
        assert torch.equal(out, data)
