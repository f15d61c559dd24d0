"""aligned_empty and BufferPool: alignment, sizes known before allocation, exhaustion."""

import threading
import time

import pytest
import torch

from offload.io import BufferPool, OffloadIOError, aligned_empty
from offload.io.errors import PoolExhaustedError


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


def test_aligned_empty_pins_only_when_asked():
    assert not aligned_empty(8192).is_pinned()  # the device's policy decides, not this
    if torch.cuda.is_available():
        assert aligned_empty(8192, pin=True).is_pinned()
    else:  # asking for pinned memory really asks for it: without a GPU that is an error
        with pytest.raises(RuntimeError, match="pin"):
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
