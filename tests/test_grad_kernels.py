"""The gradient path: accumulate_grad (one pass: acc += grad*scale, inf/NaN flag, sum of squares),
the on-the-fly bf16/fp16 -> fp32 conversion, and the 4-read/3-write streaming kernel."""

from __future__ import annotations

import pytest
import torch
from kernel_paths import kernel_path, simd_level, simd_levels

from offload import _native
from offload.optim import accumulate_grad

SIZES = [1, 7, 1023, 2**20 + 3]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _torch_reference(acc: torch.Tensor, grad: torch.Tensor, scale: float, overwrite: bool):
    if overwrite:
        want = grad.float() * scale
    else:
        want = acc.clone().add_(grad, alpha=scale)
    d = want.double()
    return want, float((d * d).sum())


@pytest.mark.parametrize("path", ["native", "fallback"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["accumulate", "overwrite"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_accumulate_matches_torch(n, grad_dtype, overwrite, path):
    gen = torch.Generator().manual_seed(n)
    acc = torch.randn(n, generator=gen)
    grad = (torch.randn(n, generator=gen) * 3).to(grad_dtype)
    scale = 0.375 if n % 2 else 1.0 / 3
    want, want_sumsq = _torch_reference(acc, grad, scale, overwrite)
    with kernel_path(path):
        found, sumsq = accumulate_grad(acc, grad, scale=scale, overwrite=overwrite)
    assert found is False
    assert isinstance(sumsq, float)
    assert torch.equal(acc, want)  # same fused multiply-add as torch's add_(alpha=)
    assert sumsq == pytest.approx(want_sumsq, rel=1e-12)


@pytest.mark.parametrize("path", ["native", "fallback"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 1023, 70001])
def test_accumulate_flags_inf_and_nan_anywhere(n, grad_dtype, path):
    with kernel_path(path):
        for bad in (float("inf"), float("-inf"), float("nan")):
            for pos in sorted({0, n // 2, n - 1}):  # first, middle, last (in the SIMD tail)
                acc = torch.ones(n)
                grad = torch.ones(n, dtype=grad_dtype)
                grad[pos] = bad
                found, sumsq = accumulate_grad(acc, grad)
                assert found is True, (bad, pos)
                assert not torch.isfinite(acc[pos])
                # a clean pass over the same buffer with overwrite clears the flag
                found, sumsq = accumulate_grad(acc, torch.ones(n, dtype=grad_dtype), overwrite=True)
                assert found is False and sumsq == float(n)
        # overflow created by the scale itself is caught too (finite grad, finite scale)
        acc = torch.zeros(n)
        grad = torch.full((n,), 60000.0).to(grad_dtype)
        found, _ = accumulate_grad(acc, grad, scale=1e36)
        assert found is True
        # an inf already in acc stays inf and is reported
        acc = torch.zeros(n)
        acc[-1] = float("inf")
        found, _ = accumulate_grad(acc, torch.zeros(n, dtype=grad_dtype))
        assert found is True


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_16_bit_pattern_converts_exactly(grad_dtype):
    """All 65536 bf16/fp16 values widen exactly (subnormals, inf, NaN) at every SIMD level."""
    grad = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    want = grad.float()
    nan = torch.isnan(want)
    levels = simd_levels() + ["fallback"]
    for level in levels:
        acc = torch.full((grad.numel(),), 123.0)
        ctx = _native.force_fallback() if level == "fallback" else simd_level(level)
        with ctx:
            found, _ = accumulate_grad(acc, grad, overwrite=True)
        assert found is True  # the set contains inf and NaN
        assert torch.equal(torch.isnan(acc), nan), level
        assert torch.equal(acc[~nan].view(torch.int32), want[~nan].view(torch.int32)), level


def test_simd_levels_agree_on_accumulate():
    if not _native.available():
        pytest.skip("native extension unavailable")
    n = 2**20 + 3
    gen = torch.Generator().manual_seed(5)
    acc0 = torch.randn(n + 1, generator=gen)
    grads = {dt: (torch.randn(n + 1, generator=gen) * 5).to(dt) for dt in GRAD_DTYPES}
    for dt, grad in grads.items():
        results = {}
        for level in _native.get().supported_simd_levels():
            acc = acc0.clone()
            with simd_level(level):  # misaligned views: one element in
                results[level] = (accumulate_grad(acc[1:], grad[1:], scale=0.7), acc)
        (flag0, sq0), acc_ref = results["scalar"]
        for level, ((flag, sq), acc) in results.items():
            assert flag == flag0 and sq == pytest.approx(sq0, rel=1e-12), (dt, level)
            assert torch.equal(acc, acc_ref), (dt, level)


def test_accumulate_sum_of_squares_is_double_precision():
    """1e8 copies of 1.0 would stall a float accumulator at 2**24; the double one is exact."""
    if not _native.available():
        pytest.skip("native extension unavailable")
    n = 2**25 + 7  # 128 MiB fp32 acc plus a 64 MiB bf16 grad
    acc = torch.empty(n)
    grad = torch.ones(n, dtype=torch.bfloat16)
    found, sumsq = accumulate_grad(acc, grad, overwrite=True)
    assert found is False and sumsq == float(n)


@pytest.mark.parametrize("path", ["native", "fallback"])
def test_accumulate_rejects_bad_inputs(path):
    acc = torch.zeros(5)
    with kernel_path(path):
        with pytest.raises(ValueError, match=r"acc has dtype torch.bfloat16"):
            accumulate_grad(acc.bfloat16(), torch.zeros(5))
        with pytest.raises(ValueError, match=r"grad has 4 elements; expected 5"):
            accumulate_grad(acc, torch.zeros(4))
        with pytest.raises(ValueError, match=r"grad must be contiguous"):
            accumulate_grad(acc, torch.zeros(5, 2)[:, 1])


@pytest.mark.parametrize("n", [70001, (1 << 20) + 3, (5 << 20) + 65])
def test_accumulate_sum_does_not_depend_on_thread_count(n):
    """The call is cut into tasks by its size alone and the per-task double sums are added in
    task order (csrc/cpu_adam.cpp, Note on threading): the same bits for any thread count."""
    if not _native.available():
        pytest.skip("native extension unavailable")
    gen = torch.Generator().manual_seed(n)
    grad = torch.randn(n, generator=gen).bfloat16()
    acc0 = torch.randn(n, generator=gen)
    before = _native.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3, 5):
            _native.set_num_threads(threads)
            acc = acc0.clone()
            found, sumsq = accumulate_grad(acc, grad, scale=0.5)
            results.append((acc, found, sumsq))
    finally:
        _native.set_num_threads(before)
    for acc, found, sumsq in results[1:]:
        assert torch.equal(acc, results[0][0])
        assert (found, sumsq) == results[0][1:]


def test_stream_kernel_reads_four_and_writes_three():
    if not _native.available():
        pytest.skip("native extension unavailable")
    mod = _native.get()
    for level in mod.supported_simd_levels():
        for n in (1, 7, 1023, 70001):  # 70001: split over two threads, with a tail
            gen = torch.Generator().manual_seed(n)
            a, b, c, d = (torch.randn(n, generator=gen) for _ in range(4))
            a0, b0, c0, d0 = a.clone(), b.clone(), c.clone(), d.clone()
            with simd_level(level):
                mod.stream_4r3w(a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), n, 0.5)
            torch.testing.assert_close(a, a0 + b0 * 0.5)
            torch.testing.assert_close(c, c0 * 0.5 + b0)
            torch.testing.assert_close(d, d0 * 0.5 + b0)
            assert torch.equal(b, b0)


def test_native_rejects_bad_dtype_codes_and_null_pointers():
    if not _native.available():
        pytest.skip("native extension unavailable")
    mod = _native.get()
    x = torch.zeros(4)
    with pytest.raises(ValueError, match=r"grad dtype code 7 is not supported; allowed: 0"):
        mod.accumulate_grad(x.data_ptr(), x.data_ptr(), 4, 7, 1.0, False)
    with pytest.raises(ValueError, match=r"acc is a null pointer"):
        mod.accumulate_grad(0, x.data_ptr(), 4, 0, 1.0, False)
    ptr = x.data_ptr()
    args = [ptr, ptr, ptr, ptr, 4, 0, 0, 5] + [1.0] * 9
    with pytest.raises(ValueError, match=r"out dtype code 5 .*-1 \(none\)"):
        mod.adam_step(*args)
