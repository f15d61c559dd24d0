"""AdamGroup (several tensors, one native dispatch) equals adam_step tensor by tensor."""

from __future__ import annotations

import pytest
import torch

from offload import _native
from offload.optim import adam_step
from offload.optim.kernels import AdamGroup

SIZES = [1, 7, 1023, 4096, 70001, 2**17 + 3]
HYPER = dict(step=3, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, grad_scale=0.5)


@pytest.mark.parametrize("native", [True, False], ids=["native", "fallback"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_group_matches_per_tensor(native, grad_dtype, out_dtype):
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(n, generator=g) for n in SIZES]
    ms = [torch.randn(n, generator=g) * 0.1 for n in SIZES]
    vs = [torch.rand(n, generator=g) * 0.01 for n in SIZES]
    grads = [torch.randn(n, generator=g).to(grad_dtype) for n in SIZES]
    ref = [[t.clone() for t in ts] for ts in (ps, ms, vs)]
    outs = [torch.empty(n, dtype=out_dtype) for n in SIZES] if out_dtype else None
    ref_outs = [torch.empty(n, dtype=out_dtype) for n in SIZES] if out_dtype else None
    ctx = _native.force_fallback() if not native else torch.no_grad()
    with ctx:
        for i in range(len(SIZES)):
            adam_step(
                ref[0][i],
                grads[i],
                ref[1][i],
                ref[2][i],
                **HYPER,
                out=ref_outs[i] if ref_outs else None,
            )
        AdamGroup(ps, ms, vs, outs).step(grads, **HYPER)
    for got, want in zip((ps, ms, vs), ref):
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    if outs:
        for a, b in zip(outs, ref_outs):
            assert torch.equal(a, b)


def test_group_checks_grads():
    p, m, v = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    group = AdamGroup([p], [m], [v])
    with pytest.raises(ValueError, match="grad has 7 elements"):
        group.step([torch.zeros(7)], **HYPER)
    with pytest.raises(ValueError, match="1 grads for 1 params|grads for"):
        group.step([], **HYPER)
