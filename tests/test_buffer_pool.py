"""aligned_empty and BufferPool: alignment, sizes known before allocation, exhaustion."""

import ctypes
import gc
import sys
import threading
import time

import pytest
import torch
from smaps import mapping_field

from offload.io import BufferPool, OffloadIOError, aligned, aligned_empty
from offload.io.errors import PoolExhaustedError

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux mappings")


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, total) 4 KiB pages of ``t``'s bytes, by mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() // 4096 * 4096
    n = t.data_ptr() + t.numel() * t.element_size() - start
    pages = (n + 4095) // 4096
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n), vec) == 0
    return sum(v & 1 for v in vec), pages


@pytest.mark.parametrize("nbytes", [0, 1, 7, 1023, 4096, (1 << 20) + 3])
def test_aligned_empty_is_aligned_and_sized(nbytes):
    t = aligned_empty(nbytes, pin=False)
    assert t.dtype == torch.uint8 and t.numel() == nbytes and t.is_contiguous()
    if nbytes:
        assert t.data_ptr() % 4096 == 0
        t.fill_(5)  # the whole range is writable memory
        assert int(t.sum()) == 5 * nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_aligned_empty_dtypes(dtype):
    t = aligned_empty(4096 * 3, dtype=dtype, pin=False)
    assert t.dtype == dtype and t.data_ptr() % 4096 == 0
    assert t.numel() * t.element_size() == 4096 * 3
    with pytest.raises(ValueError, match="multiple of"):
        aligned_empty(6, dtype=torch.float32)
    with pytest.raises(ValueError, match="nbytes"):
        aligned_empty(-1)


@linux_only
@pytest.mark.parametrize("nbytes", [2 << 20, (2 << 20) + 4, (5 << 20) + 4096 + 12])
def test_large_buffers_are_populated_huge_page_mappings(nbytes):
    """See the Note on huge pages in offload/io/aligned.py: 2 MiB-aligned, advised for huge
    pages over their whole huge pages, every page resident on return, all of it writable."""
    t = aligned_empty(nbytes, dtype=torch.uint8 if nbytes % 4 else torch.float32)
    assert t.numel() * t.element_size() == nbytes
    assert t.data_ptr() % aligned.HUGE_PAGE == 0
    assert "hg" in mapping_field(t.data_ptr(), "VmFlags:")  # MADV_HUGEPAGE
    resident, pages = _resident_pages(t)
    assert resident == pages
    t.view(torch.uint8).fill_(7)
    assert int(t.view(torch.uint8)[-1]) == 7 and int(t.view(torch.uint8)[0]) == 7


@linux_only
def test_huge_page_mapping_lives_as_long_as_any_view():
    t = aligned_empty(4 << 20)
    tail = t[3 << 20 :]
    del t
    gc.collect()
    tail.fill_(9)  # still mapped: the view holds the mapping
    assert int(tail.sum()) == 9 * (1 << 20)


def test_small_or_opted_out_buffers_use_torch_memory():
    for t in (aligned_empty(64 << 10), aligned_empty(4 << 20, huge_pages=False)):
        assert t.data_ptr() % 4096 == 0
        assert t.untyped_storage().nbytes() < t.numel() + 4096  # torch's slab, not a mapping
        t.fill_(1)


@linux_only
def test_huge_page_buffer_without_populate_advice_is_touched_instead(monkeypatch):
    """Kernels before 5.14 refuse MADV_POPULATE_WRITE with EINVAL: the pages are written."""
    monkeypatch.setattr(aligned, "_MADV_POPULATE_WRITE", 0x7FFF)  # no such advice: EINVAL
    t = aligned_empty(4 << 20)
    assert _resident_pages(t)[0] == _resident_pages(t)[1]
    assert int(t.sum()) == 0


def test_aligned_empty_pins_only_when_asked():
    assert not aligned_empty(8192).is_pinned()  # the device's policy decides, not this
    if torch.cuda.is_available():
        assert aligned_empty(8192, pin=True).is_pinned()
    else:  # asking for pinned memory really asks for it: without a GPU that is an error
        with pytest.raises(MemoryError, match="page-locking 8192 bytes"):
            aligned_empty(8192, pin=True)


def test_required_bytes_before_allocating():
    assert BufferPool.required_bytes(4, 4096) == 4 * 4096 + 4095
    assert BufferPool.required_bytes(3, 5000) == 3 * 8192 + 4095
    with pytest.raises(ValueError, match="buffer_count"):
        BufferPool.required_bytes(0, 4096)
    with pytest.raises(ValueError, match="buffer_size"):
        BufferPool(2, 0)


def test_acquire_release_cycle():
    with BufferPool(3, 5000, pin=False) as pool:
        assert (pool.buffer_count, pool.buffer_size, pool.free_count) == (3, 5000, 3)
        bufs = [pool.acquire() for _ in range(3)]
        assert pool.free_count == 0
        ptrs = {b.data_ptr() for b in bufs}
        assert len(ptrs) == 3 and all(p % 4096 == 0 for p in ptrs)
        for b in bufs:
            assert b.dtype == torch.uint8 and b.numel() == 5000
        # buffers do not overlap: writing one leaves the others intact
        for i, b in enumerate(bufs):
            b.fill_(i)
        for i, b in enumerate(bufs):
            assert int(b.min()) == int(b.max()) == i
        pool.release(bufs[1])
        assert pool.free_count == 1
        assert pool.acquire().data_ptr() == bufs[1].data_ptr()


def test_exhaustion_times_out_with_a_clear_error():
    pool = BufferPool(2, 4096, pin=False, timeout=0.05)
    pool.acquire()
    pool.acquire()
    t0 = time.perf_counter()
    with pytest.raises(PoolExhaustedError) as info:
        pool.acquire()
    assert time.perf_counter() - t0 >= 0.04
    msg = str(info.value)
    assert "buffer_count=2" in msg and "buffer_size=4096" in msg
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, OffloadIOError)
    with pytest.raises(PoolExhaustedError):
        pool.acquire(timeout=0)


def test_blocked_acquire_wakes_on_release():
    pool = BufferPool(1, 4096, pin=False)
    held = pool.acquire()
    got = []

    def waiter():
        got.append(pool.acquire(timeout=10))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    assert not got  # still blocked
    pool.release(held)
    t.join(timeout=10)
    assert got and got[0].data_ptr() == held.data_ptr()


def test_release_rejects_foreign_and_double():
    pool = BufferPool(2, 4096, pin=False)
    b = pool.acquire()
    with pytest.raises(ValueError, match="not a buffer of this pool"):
        pool.release(torch.empty(4096, dtype=torch.uint8))
    pool.release(b)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(b)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire()


def test_a_ctrl_c_as_the_pool_s_lock_is_taken_does_not_leave_it_held(monkeypatch):
    """``with condition:`` runs ``Condition.__enter__``, Python code: a Ctrl-C landing on the
    main thread after it acquired the lock and before the block began left the lock held for
    good, and the update's thread hung in ``release`` (the pin-leak probe saw it once). The
    pool enters its C lock directly; a Condition's ``__enter__`` that is interrupted so is
    never run."""
    pool = BufferPool(2, 4096)
    buf = pool.acquire()

    def interrupted_enter(self):
        self._lock.acquire()
        raise KeyboardInterrupt  # the Ctrl-C at the line after the acquire

    monkeypatch.setattr(threading.Condition, "__enter__", interrupted_enter)
    pool.release(buf)
    monkeypatch.undo()
    other = threading.Thread(target=lambda: pool.release(pool.acquire(timeout=1.0)))
    other.start()
    other.join(timeout=5.0)
    assert not other.is_alive()  # the lock was free
    pool.close()
