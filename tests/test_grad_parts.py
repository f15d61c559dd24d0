"""GradParts: a unit's gradient read in place from its parameters' grads must accumulate exactly
as the flat copy it replaces (zero in the gaps, old values kept where a grad is missing)."""

from __future__ import annotations

import pytest
import torch

from offload.homes.grads import GradParts
from offload.optim import accumulate_grad


def _flat(parts, n, dtype):
    flat = torch.zeros(n, dtype=dtype)
    for a, b, g in parts:
        if g is not None:
            flat[a:b] = g
    return flat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [(0, 96), (10, 70), (33, 34)])
def test_parts_match_flat_accumulation(dtype, window):
    torch.manual_seed(0)
    n = 96
    parts = [
        (0, 20, torch.randn(20).to(dtype)),
        (20, 32, None),  # alignment padding
        (32, 50, None),  # a parameter without a grad this micro-step
        (50, 90, torch.randn(40).to(dtype)),
        (90, 96, None),
    ]
    lo, hi = window
    flat = _flat(parts, n, dtype)
    old = torch.randn(n)
    for overwrite in (True, False):
        want = old[lo:hi].clone()
        w_inf, w_ss = accumulate_grad(want, flat[lo:hi], overwrite=overwrite)
        got = old[lo:hi].clone()
        rec = GradParts(parts).accumulate(got, lo, overwrite)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert rec.found_inf == w_inf
        assert rec.sumsq == pytest.approx(w_ss, rel=1e-12)


def test_missing_grad_keeps_an_inf_visible():
    acc = torch.tensor([1.0, float("inf"), 2.0, 3.0])
    rec = GradParts([(0, 2, None), (2, 4, torch.ones(2))]).accumulate(acc, 0, overwrite=False)
    assert rec.found_inf
    assert acc.tolist() == [1.0, float("inf"), 3.0, 4.0]
