"""AsyncIO: round trips at any size/offset/alignment, many requests in flight, buffered fallback,
errors with errno and path (fault injection at the syscall boundary), both backends."""

import ctypes
import errno
import logging
import mmap
import os
import random
import subprocess
import threading
import time

import pytest
import torch

from offload import _native
from offload.io import AsyncIO, aligned_empty, faults
from offload.io.async_io import probe_direct_io

ODD_SIZES = [1, 7, 1023, 4096, 4097, 65536, (1 << 20) + 3]


@pytest.fixture(params=["native", "fallback"])
def backend(request):
    if request.param == "native":
        mod = _native.get() if _native.available() else None
        if mod is None or not hasattr(mod, "AioEngine"):
            pytest.skip("native AioEngine not built")
        yield "native"
    else:
        with _native.force_fallback():
            yield "threads"
    faults.clear()


def _random_bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def _at_misalignment(n: int, shift: int) -> torch.Tensor:
    """A uint8 tensor of n bytes starting `shift` bytes past a 4096 boundary."""
    return aligned_empty(n + shift, pin=False)[shift:]


def test_backend_is_the_one_asked_for(backend):
    with AsyncIO() as aio:
        assert aio.backend == backend


@pytest.mark.parametrize("n", ODD_SIZES)
def test_round_trip_odd_sizes_offsets_and_alignments(backend, tmp_path, n):
    gen = torch.Generator().manual_seed(n)
    path = tmp_path / "f.bin"
    with AsyncIO(block_size=8192, queue_depth=4, thread_count=2) as aio:
        for shift, offset in [(0, 0), (0, 4096), (1, 1), (100, 4196), (3, 12289), (4095, 0)]:
            src = _at_misalignment(n, shift)
            src.copy_(_random_bytes(n, gen))
            aio.write(src, path, offset).wait()
            dst = _at_misalignment(n, (shift * 7) % 4096)
            dst.fill_(0)
            aio.read(dst, path, offset).wait()
            assert torch.equal(src, dst), (n, shift, offset)
            # the bytes really are at that file offset
            with open(path, "rb") as f:
                f.seek(offset)
                assert f.read(n) == bytes(src.numpy())


def test_many_handles_in_flight_random_extents(backend, tmp_path):
    rng = random.Random(4)
    gen = torch.Generator().manual_seed(4)
    path = tmp_path / "many.bin"
    # non-overlapping random extents of random sizes (some not multiples of 4096)
    extents, pos = [], 0
    for _ in range(40):
        pos += rng.choice([0, 4096, rng.randrange(1, 9000)])
        n = rng.choice([1, 4096, 8192 * 3, rng.randrange(1, 300_000)])
        extents.append((pos, n))
        pos += n
    srcs = [_random_bytes(n, gen) for _, n in extents]
    with AsyncIO(block_size=16384, queue_depth=8, thread_count=3) as aio:
        handles = [aio.write(s, path, off) for s, (off, _) in zip(srcs, extents)]
        for h in handles:
            h.wait()
        dsts = [torch.zeros(n, dtype=torch.uint8) for _, n in extents]
        handles = [aio.read(d, path, off) for d, (off, _) in zip(dsts, extents)]
        assert all(isinstance(h.done(), bool) for h in handles)
        for h in handles:
            h.wait(timeout=60)
            assert h.done()
        for s, d in zip(srcs, dsts):
            assert torch.equal(s, d)
        st = aio.stats()
    total = sum(n for _, n in extents)
    assert st["bytes_written"] == total and st["bytes_read"] == total
    assert st["writes"] == 40 and st["reads"] == 40
    assert st["read_seconds"] > 0 and st["write_seconds"] > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_any_dtype_is_its_bytes(backend, tmp_path, dtype):
    src = torch.randn(1023, dtype=torch.float32).to(dtype) if dtype.is_floating_point else None
    if src is None:
        src = torch.randint(-(2**40), 2**40, (1023,), dtype=dtype)
    dst = torch.empty_like(src)
    with AsyncIO(block_size=4096) as aio:
        aio.write(src, tmp_path / "d.bin", 8192).wait()
        aio.read(dst, tmp_path / "d.bin", 8192).wait()
    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))


def test_new_files_are_private(backend, tmp_path):
    with AsyncIO() as aio:
        aio.write(torch.ones(10), tmp_path / "p.bin").wait()
    assert os.stat(tmp_path / "p.bin").st_mode & 0o777 == 0o600


@pytest.fixture
def ramfs_dir(tmp_path):
    """A directory on ramfs, a filesystem that refuses O_DIRECT (EINVAL); skipped if not root."""
    d = tmp_path / "ramfs"
    d.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount ramfs here (needs root)")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_direct_io_probe(tmp_path, ramfs_dir):
    assert probe_direct_io(str(tmp_path)) is True  # ext4 under /tmp on these machines
    assert probe_direct_io(str(tmp_path / "not-yet")) is True
    assert probe_direct_io(str(ramfs_dir)) is False
    with AsyncIO(direct_io=False) as aio:
        assert aio.direct_io_active(tmp_path) is False
    with AsyncIO() as aio:
        assert aio.direct_io_active(tmp_path) is True
        assert aio.direct_io_active(ramfs_dir) is False


def _fallback_round_trips(aio, path, gen):
    for n in (1, 4096, 70000):
        src = aligned_empty(n, pin=False)
        src.copy_(_random_bytes(n, gen))
        aio.write(src, path, 4096).wait()
        dst = aligned_empty(n, pin=False)
        aio.read(dst, path, 4096).wait()
        assert torch.equal(src, dst)


def _refusals(caplog):
    return [r.getMessage() for r in caplog.records if "O_DIRECT refused" in r.getMessage()]


def test_buffered_fallback_on_ramfs_logs_once(backend, ramfs_dir, caplog):
    gen = torch.Generator().manual_seed(1)
    with caplog.at_level(logging.WARNING, logger="offload.io"):
        with AsyncIO(block_size=4096) as aio:
            _fallback_round_trips(aio, ramfs_dir / "f.bin", gen)
    assert len(_refusals(caplog)) == 1 and str(ramfs_dir) in _refusals(caplog)[0]


def test_buffered_fallback_when_open_refuses_o_direct(backend, tmp_path, caplog):
    gen = torch.Generator().manual_seed(2)
    faults.inject(errno.EINVAL, count=1000, op="open_direct")  # as a filesystem without O_DIRECT
    with caplog.at_level(logging.WARNING, logger="offload.io"):
        with AsyncIO(block_size=4096) as aio:
            _fallback_round_trips(aio, tmp_path / "f.bin", gen)
    faults.clear()
    assert len(_refusals(caplog)) == 1 and str(tmp_path) in _refusals(caplog)[0]


def test_buffered_mode_round_trip(backend, tmp_path):
    src = torch.randn(12345)
    dst = torch.empty_like(src)
    with AsyncIO(direct_io=False, block_size=4096) as aio:
        aio.write(src, tmp_path / "b.bin", 5).wait()
        aio.read(dst, tmp_path / "b.bin", 5).wait()
    assert torch.equal(src, dst)


def test_missing_file_raises_with_errno_and_path(backend, tmp_path):
    path = tmp_path / "nope.bin"
    with AsyncIO() as aio:
        h = aio.read(torch.empty(4096, dtype=torch.uint8), path)
        with pytest.raises(FileNotFoundError) as info:
            h.wait()
    assert info.value.errno == errno.ENOENT and info.value.filename == str(path)


def test_read_past_end_of_file_raises(backend, tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 5000)
    with AsyncIO(block_size=4096) as aio:
        with pytest.raises(OSError) as info:
            aio.read(aligned_empty(8192, pin=False), path).wait()
    assert info.value.errno == errno.ENODATA and info.value.filename == str(path)


@pytest.mark.parametrize("op", ["write", "read"])
def test_injected_eio_is_reported_with_path(backend, tmp_path, op):
    path = tmp_path / "eio.bin"
    buf = aligned_empty(1 << 16, pin=False)
    buf.fill_(3)
    with AsyncIO(block_size=4096) as aio:
        aio.write(buf, path).wait()
        faults.inject(errno.EIO, count=1, op=op)
        h = (aio.write if op == "write" else aio.read)(buf, path)
        with pytest.raises(OSError) as info:
            h.wait()
        assert info.value.errno == errno.EIO
        assert info.value.filename == str(path)
        assert op in str(info.value)
        # the fault was consumed: the engine keeps working
        aio.write(buf, path).wait()
        out = aligned_empty(1 << 16, pin=False)
        aio.read(out, path).wait()
        assert torch.equal(out, buf)


def test_wait_timeout_and_close_waits_for_in_flight(backend, tmp_path):
    n = 8 << 20
    src = aligned_empty(n, pin=False)
    src.fill_(7)
    aio = AsyncIO(block_size=1 << 16, queue_depth=2, thread_count=1)
    handles = [aio.write(src, tmp_path / f"c{i}.bin") for i in range(4)]
    aio.close()  # must wait, not cancel
    assert all(h.done() for h in handles)
    for h in handles:
        h.wait(timeout=0)
    for i in range(4):
        assert os.path.getsize(tmp_path / f"c{i}.bin") == n
    with pytest.raises(RuntimeError, match="closed"):
        aio.write(src, tmp_path / "x.bin")


def test_an_urgent_read_goes_ahead_of_queued_writes(backend, tmp_path):
    """One thread, one request in flight: a read marked urgent is served before the writes
    queued ahead of it (all of them would be done first in submission order); a plain read
    queues behind them."""
    block = 1 << 20
    src = aligned_empty(block, pin=False)
    src.fill_(5)
    aio = AsyncIO(block_size=block, queue_depth=1, thread_count=1)
    aio.write(src, tmp_path / "r.bin").wait()
    writes = [aio.write(src, tmp_path / "w.bin", offset=i * block) for i in range(64)]
    out = aligned_empty(block, pin=False)
    aio.read(out, tmp_path / "r.bin", urgent=True).wait()
    done_before_urgent = sum(h.done() for h in writes)
    assert torch.equal(out, src)
    aio.read(out, tmp_path / "r.bin").wait()
    done_before_plain = sum(h.done() for h in writes)
    aio.close()
    assert done_before_urgent < len(writes) // 2, done_before_urgent
    assert done_before_plain == len(writes)


def test_waiting_releases_the_gil(backend, tmp_path):
    n = 32 << 20
    buf = aligned_empty(n, pin=False)
    buf.fill_(1)
    ticks = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.0005)

    t = threading.Thread(target=spin)
    with AsyncIO(block_size=1 << 20, thread_count=1, queue_depth=1) as aio:
        t.start()
        t0 = time.perf_counter()
        for _ in range(3):
            aio.write(buf, tmp_path / "g.bin").wait()
        elapsed = time.perf_counter() - t0
        stop.set()
        t.join()
    # a thread that needs the GIL kept running while we waited (it ticks every ~0.5 ms)
    assert elapsed > 0 and ticks >= 5


def _cached_fraction(path) -> float:
    """Fraction of the file's pages in the page cache (mincore on a shared read mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    size = os.path.getsize(path)
    pages = (size + 4095) // 4096
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) / pages


@pytest.mark.parametrize("shift", [0, 1, 100])
def test_aligned_file_range_bypasses_the_page_cache(backend, tmp_path, shift):
    # any buffer address: aligned buffers go direct, misaligned ones through a bounce buffer
    n = 4 << 20
    src = _at_misalignment(n, shift)
    src.copy_(_random_bytes(n, torch.Generator().manual_seed(shift)))
    with AsyncIO(block_size=1 << 20) as aio:
        aio.write(src, tmp_path / "direct.bin").wait()
        assert _cached_fraction(tmp_path / "direct.bin") < 0.05
        dst = _at_misalignment(n, (shift * 3) % 4096)
        aio.read(dst, tmp_path / "direct.bin").wait()
        assert torch.equal(src, dst)
        assert _cached_fraction(tmp_path / "direct.bin") < 0.05
    with AsyncIO(block_size=1 << 20, direct_io=False) as aio:  # the measurement sees caching
        aio.write(src, tmp_path / "cached.bin").wait()
        assert _cached_fraction(tmp_path / "cached.bin") > 0.95


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        AsyncIO(block_size=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        AsyncIO(queue_depth=0)
    with AsyncIO() as aio:
        with pytest.raises(ValueError, match="contiguous"):
            aio.write(torch.ones(4, 4).t(), tmp_path / "x.bin")
        with pytest.raises(ValueError, match="offset"):
            aio.write(torch.ones(4), tmp_path / "x.bin", -1)


def _native_kernel_aio():
    mod = _native.get() if _native.available() else None
    if mod is None or not hasattr(mod, "aio_contexts_made"):
        pytest.skip("native AioEngine not built")
    with AsyncIO() as aio:
        if not aio._engine.uses_kernel_aio:
            pytest.skip("no Linux AIO here (the engine reads and writes with pread/pwrite)")
    return mod


def _round_trip(aio: AsyncIO, path, seed: int) -> bool:
    src = aligned_empty(3 * 8192, pin=False)
    src.copy_(_random_bytes(src.numel(), torch.Generator().manual_seed(seed)))
    aio.write(src, path, 4096).wait()
    dst = aligned_empty(src.numel(), pin=False)
    aio.read(dst, path, 4096).wait()
    return torch.equal(src, dst)


def test_an_engine_takes_the_kernel_contexts_a_closed_one_left(tmp_path):
    """io_destroy waits for an RCU grace period (34 ms to open and 38 ms to close an engine
    here, 2026-12-06): closed engines leave their contexts to the next ones, which move data
    through them as through fresh ones."""
    mod = _native_kernel_aio()
    with AsyncIO(block_size=8192, queue_depth=4, thread_count=2):
        pass  # its two contexts are left for the next engines
    made = mod.aio_contexts_made()
    for i in range(6):
        with AsyncIO(block_size=8192, queue_depth=4 - i % 2, thread_count=2) as aio:
            assert aio._engine.uses_kernel_aio
            assert _round_trip(aio, tmp_path / "f.bin", i)
    assert mod.aio_contexts_made() == made


def test_a_forked_child_sets_up_contexts_of_its_own(tmp_path):
    """The contexts a closed engine left belong to the parent's address space: a forked child
    sets up its own, and its IO is right."""
    mod = _native_kernel_aio()
    with AsyncIO(block_size=8192, queue_depth=4, thread_count=2):
        pass
    assert mod.aio_contexts_made() > 0
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only when its IO was right through new contexts
        ok = False
        try:
            with AsyncIO(block_size=8192, queue_depth=4, thread_count=2) as aio:
                ok = _round_trip(aio, tmp_path / "child.bin", 7)
            ok = ok and mod.aio_contexts_made() == 2  # (no probe: the parent's result holds)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    made = mod.aio_contexts_made()
    with AsyncIO(block_size=8192, queue_depth=4, thread_count=2) as aio:  # the parent's are kept
        assert _round_trip(aio, tmp_path / "parent.bin", 8)
    assert mod.aio_contexts_made() == made


def test_a_full_list_of_idle_contexts_keeps_the_larger_ones(tmp_path):
    """At most 4 idle contexts are kept: a closing engine's larger context takes the place of
    a smaller idle one (it serves every depth the smaller one does), so the next engine of
    that depth sets up none."""
    mod = _native_kernel_aio()
    small = [AsyncIO(block_size=8192, queue_depth=1, thread_count=1) for _ in range(6)]
    big = AsyncIO(block_size=8192, queue_depth=4, thread_count=1)
    for aio in small:
        aio.close()  # the idle list fills up with contexts of one event
    big.close()
    made = mod.aio_contexts_made()
    with AsyncIO(block_size=8192, queue_depth=4, thread_count=1) as aio:
        assert _round_trip(aio, tmp_path / "f.bin", 9)
    assert mod.aio_contexts_made() == made
