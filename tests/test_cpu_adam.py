"""CPU Adam/AdamW: the flat-buffer step and the CPUAdam optimizer against torch.optim.

Parity is checked step by step against ``torch.optim.AdamW`` / ``torch.optim.Adam``
(``foreach=False``) with an LR scheduler that also moves beta1 (OneCycleLR), for every gradient
dtype, both modes, on odd sizes (SIMD tails), through the native kernel and the torch fallback.
fp32 results must agree within a relative 1e-6 per step (torch's own float sqrt is not correctly
rounded, so bit equality with torch is not expected; see offload/optim/kernels.py); the bf16
copy-out must equal ``param.to(torch.bfloat16)`` bit for bit; the native SIMD levels and the
fallback must agree with each other bit for bit.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from kernel_paths import kernel_path, simd_level, simd_levels

from offload import _native
from offload.optim import CPUAdam, adam_step

ODD_SIZES = [1, 7, 1023, 4096]
BIG = 2**20 + 3
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
RTOL, ATOL = 1e-6, 1e-7  # per element, per step: |ours - torch| <= ATOL + RTOL * |torch|


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    bad = (ours - ref).abs() > ATOL + RTOL * ref.abs()
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements off, worst |diff| "
        f"{(ours - ref).abs().max().item():.3g} at |ref| {ref.abs()[bad].min().item():.3g}"
    )


def _run_parity(
    n: int, grad_dtype: torch.dtype, adamw: bool, path: str, steps: int, check_every: int = 1
) -> None:
    gen = torch.Generator().manual_seed(n * 7 + int(adamw))
    p0 = torch.randn(n, generator=gen)
    ref = p0.clone().requires_grad_()
    opt_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    wd = 0.1 if adamw else 0.01
    ref_opt = opt_cls([ref], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, foreach=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=1e-2, total_steps=steps + 1)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    scale = 1.0 / 64
    with kernel_path(path):
        for step in range(1, steps + 1):
            g = (torch.randn(n, generator=gen) * 64).to(grad_dtype)
            group = ref_opt.param_groups[0]
            lr, betas = group["lr"], group["betas"]
            ref.grad = g.float() * scale
            ref_opt.step()
            sched.step()
            adam_step(
                p,
                g,
                m,
                v,
                step=step,
                lr=lr,
                betas=betas,
                eps=1e-8,
                weight_decay=wd,
                adamw_mode=adamw,
                grad_scale=scale,
                out=out,
            )
            if step % check_every and step != steps:
                continue
            state = ref_opt.state[ref]
            _assert_close(p, ref.detach(), f"param at step {step}")
            _assert_close(m, state["exp_avg"], f"exp_avg at step {step}")
            _assert_close(v, state["exp_avg_sq"], f"exp_avg_sq at step {step}")
            assert torch.equal(_bits(out), _bits(p.to(torch.bfloat16))), f"bf16 copy, step {step}"


@pytest.mark.parametrize("path", ["native", "fallback"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", ODD_SIZES)
def test_adam_step_matches_torch_100_steps(n, grad_dtype, adamw, path):
    _run_parity(n, grad_dtype, adamw, path, steps=100)


def test_adam_step_matches_torch_large_bf16_adamw():
    """2**20 + 3 elements (several threads, a SIMD tail): the engine's case, checked every 10th step."""
    _run_parity(BIG, torch.bfloat16, True, "native", steps=100, check_every=10)


def _random_step_inputs(n: int, grad_dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    g = (torch.randn(n, generator=gen) * 8).to(grad_dtype)
    return p, g, m, v


CONFIGS = [
    dict(adamw_mode=True, bias_correction=True, weight_decay=0.1, betas=(0.9, 0.999)),
    dict(adamw_mode=False, bias_correction=True, weight_decay=0.05, betas=(0.9, 0.99)),
    dict(adamw_mode=True, bias_correction=False, weight_decay=0.0, betas=(0.8, 0.999)),
    dict(adamw_mode=False, bias_correction=False, weight_decay=0.0, betas=(0.3, 0.9)),  # lerp hi
]


def _step_all(bufs, cfg, out_dtype, steps=3, offset=0):
    """Runs `steps` steps on views starting `offset` elements in (misaligned for offset > 0)."""
    p, g, m, v = (t[offset:] for t in bufs)
    out = None if out_dtype is None else torch.empty(p.numel() + offset, dtype=out_dtype)[offset:]
    for step in range(1, steps + 1):
        adam_step(p, g, m, v, step=step, lr=3e-3, eps=1e-8, grad_scale=0.25, out=out, **cfg)
    return [t.clone() for t in (p, m, v)] + ([] if out is None else [out.clone()])


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_simd_levels_and_fallback_agree_bit_for_bit(grad_dtype, out_dtype):
    if not _native.available():
        pytest.skip("native extension unavailable")
    for ci, cfg in enumerate(CONFIGS):
        for n, offset in ((1, 0), (7, 1), (1023, 3), (4096 + 13, 0), (BIG, 1)):
            if n == BIG and (ci > 0 or grad_dtype != torch.bfloat16):
                continue  # one big case is enough for the threaded split and the tail
            seed = n + ci
            with simd_level("scalar"):
                want = _step_all(
                    _random_step_inputs(n + offset, grad_dtype, seed), cfg, out_dtype, offset=offset
                )
            results = {}
            for level in simd_levels():
                with simd_level(level):
                    results[level] = _step_all(
                        _random_step_inputs(n + offset, grad_dtype, seed),
                        cfg,
                        out_dtype,
                        offset=offset,
                    )
            with _native.force_fallback():
                results["fallback"] = _step_all(
                    _random_step_inputs(n + offset, grad_dtype, seed),
                    cfg,
                    out_dtype,
                    offset=offset,
                )
            for name, got in results.items():
                for k, (a, b) in enumerate(zip(got, want)):
                    assert torch.equal(_bits(a), _bits(b)), (
                        f"{name} vs scalar: buffer {k}, n={n}, offset={offset}, config {cfg}"
                    )


@pytest.mark.parametrize("path", ["native", "fallback"])
@pytest.mark.parametrize("beta1", [0.9, 0.3], ids=["lerp-small-weight", "lerp-large-weight"])
def test_adam_mode_and_small_beta1_match_torch(path, beta1):
    n = 4096 + 5
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen)
    ref = p0.clone().requires_grad_()
    ref_opt = torch.optim.Adam(
        [ref], lr=1e-2, betas=(beta1, 0.99), weight_decay=0.05, foreach=False
    )
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    with kernel_path(path):
        for step in range(1, 21):
            g = torch.randn(n, generator=gen)
            ref.grad = g.clone()
            ref_opt.step()
            adam_step(
                p,
                g,
                m,
                v,
                step=step,
                lr=1e-2,
                betas=(beta1, 0.99),
                eps=1e-8,
                weight_decay=0.05,
                adamw_mode=False,
            )
            _assert_close(p, ref.detach(), f"param at step {step}")


@pytest.mark.parametrize("path", ["native", "fallback"])
def test_copy_out_rounds_like_torch_on_special_values(path):
    """bf16/fp16 copy-out == param.to(dtype) bit for bit: ties, subnormals, inf, every NaN."""
    gen = torch.Generator().manual_seed(11)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=gen, dtype=torch.int64)
    special = [
        0x7FC00000,
        0xFFC00000,
        0x7F800001,
        0xFF800001,
        0x7FFFFFFF,
        0x7FA00000,
        0x7F800000,
        0xFF800000,
        0x00000001,
        0x80000001,
        0x007FFFFF,
        0x7F7FFFFF,
        0x7F7F8000,
        0x3F808000,
        0x3F818000,
        0x3F808001,
        0x477FF000,
        0x477FEFFF,
        0x33000000,
        0x33000001,
        0x387FE000,
        0x38800000,
        0x00000000,
        0x80000000,
    ]
    bits = torch.cat([torch.tensor(special, dtype=torch.int64), bits])
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    levels = simd_levels() if path == "native" else ["fallback"]
    for level in levels:
        for n in (1, 7, 1023, bits.numel()):
            p = bits[:n].clone().view(torch.float32)
            g = torch.zeros(n)
            m, v = torch.zeros(n), torch.zeros(n)
            outs = {dt: torch.empty(n, dtype=dt) for dt in (torch.bfloat16, torch.float16)}
            ctx = contextlib.nullcontext() if level == "fallback" else simd_level(level)
            with kernel_path(path), ctx:
                for dt, out in outs.items():
                    # lr = 0, no decay: the update adds -0.0, so param keeps its value
                    adam_step(
                        p,
                        g,
                        m,
                        v,
                        step=1,
                        lr=0.0,
                        betas=(0.9, 0.999),
                        eps=1e-8,
                        weight_decay=0.0,
                        out=out,
                    )
                    assert torch.equal(_bits(out), _bits(p.to(dt))), (
                        f"{dt} copy-out, {level}, n={n}"
                    )
            finite = torch.isfinite(bits[:n].view(torch.float32))
            assert torch.equal(p[finite], bits[:n].view(torch.float32)[finite])


def test_result_does_not_depend_on_thread_count():
    if not _native.available():
        pytest.skip("native extension unavailable")
    before = _native.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            _native.set_num_threads(threads)
            p, g, m, v = _random_step_inputs(BIG, torch.bfloat16, 5)
            out = torch.empty(BIG, dtype=torch.bfloat16)
            adam_step(
                p,
                g,
                m,
                v,
                step=4,
                lr=1e-3,
                betas=(0.9, 0.999),
                eps=1e-8,
                weight_decay=0.01,
                out=out,
            )
            results.append((p, m, v, out))
    finally:
        _native.set_num_threads(before)
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("path", ["native", "fallback"])
def test_adam_step_rejects_bad_inputs(path):
    n = 9
    p, g, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    kw = dict(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with kernel_path(path):
        with pytest.raises(ValueError, match=r"param has dtype torch.float64; allowed"):
            adam_step(p.double(), g, m, v, **kw)
        with pytest.raises(ValueError, match=r"grad has 8 elements; expected 9"):
            adam_step(p, g[:8], m, v, **kw)
        with pytest.raises(ValueError, match=r"grad has dtype torch.int32"):
            adam_step(p, g.int(), m, v, **kw)
        with pytest.raises(ValueError, match=r"exp_avg_sq must be contiguous"):
            adam_step(p, g, m, torch.zeros(n, 2)[:, 0], **kw)
        with pytest.raises(ValueError, match=r"out has dtype torch.int8"):
            adam_step(p, g, m, v, out=torch.zeros(n, dtype=torch.int8), **kw)
        with pytest.raises(ValueError, match=r"step must be >= 1"):
            adam_step(p, g, m, v, **{**kw, "step": 0})
        with pytest.raises(TypeError, match=r"exp_avg must be a torch.Tensor"):
            adam_step(p, g, [0.0] * n, v, **kw)
        adam_step(p, g, m, v, **{**kw, "step": 0}, bias_correction=False)  # fine without it


# ---------------------------------------------------------------- CPUAdam (the Optimizer)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.GELU(), torch.nn.Linear(65, 7))


def _groups(model: torch.nn.Module) -> list[dict]:
    return [
        {"params": model[0].parameters(), "lr": 3e-3},
        {"params": model[2].parameters(), "weight_decay": 0.05, "betas": (0.8, 0.99)},
    ]


def _train(model, opt, sched, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 33, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        sched.step()


@pytest.mark.parametrize("path", ["native", "fallback"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_cpu_adam_param_groups_and_scheduler_match_torch(path, adamw):
    model, ref = _model(0), _model(0)
    opt = CPUAdam(_groups(model), lr=1e-3, weight_decay=0.01, adamw_mode=adamw)
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref_opt = ref_cls(_groups(ref), lr=1e-3, weight_decay=0.01, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=5, gamma=0.5)
    with kernel_path(path):
        for chunk in range(4):
            _train(model, opt, sched, 5, seed=chunk)
            _train(ref, ref_opt, ref_sched, 5, seed=chunk)
            for a, b in zip(model.parameters(), ref.parameters()):
                _assert_close(a.detach(), b.detach(), f"after {5 * (chunk + 1)} steps")
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 3e-3 * 0.5**4


@pytest.mark.parametrize("path", ["native", "fallback"])
def test_cpu_adam_state_dict_round_trip_into_fresh_optimizer(path, tmp_path):
    model = _model(1)
    opt = CPUAdam(_groups(model), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    with kernel_path(path):
        _train(model, opt, sched, 7, seed=1)
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
            tmp_path / "ckpt.pt",
        )
        ckpt = torch.load(tmp_path / "ckpt.pt")
        fresh = _model(99)
        fresh.load_state_dict(ckpt["model"])
        fresh_opt = CPUAdam(_groups(fresh), lr=1.0)  # hyperparameters come from the state dict
        fresh_opt.load_state_dict(ckpt["opt"])
        fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=3, gamma=0.5)
        fresh_sched.load_state_dict(ckpt["sched"])
        assert fresh_opt.param_groups[1]["weight_decay"] == 0.05
        assert fresh_opt.state[next(fresh.parameters())]["step"].item() == 7
        _train(model, opt, sched, 5, seed=2)
        _train(fresh, fresh_opt, fresh_sched, 5, seed=2)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_cpu_adam_loads_a_torch_adamw_state():
    model, ref = _model(2), _model(2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0)
    _train(ref, ref_opt, sched, 4, seed=3)
    model.load_state_dict(ref.state_dict())
    opt = CPUAdam(model.parameters())
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # its tensors must not be shared
    _train(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), 4, seed=4)
    _train(ref, ref_opt, sched, 4, seed=4)
    for a, b in zip(model.parameters(), ref.parameters()):
        _assert_close(a.detach(), b.detach(), "after loading torch's AdamW state")


def test_cpu_adam_zero_grad_closure_and_params_without_grad():
    model = _model(3)
    frozen = torch.nn.Parameter(torch.ones(5))
    opt = CPUAdam([{"params": model.parameters()}, {"params": [frozen]}], lr=1e-2)

    def closure():
        opt.zero_grad()
        loss = model(torch.ones(2, 33)).sum()
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(frozen, torch.ones(5)) and len(opt.state[frozen]) == 0
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_cpu_adam_non_contiguous_param_matches_torch():
    base = torch.randn(16, 9)
    p = torch.nn.Parameter(base.t())  # a transposed (non-contiguous) leaf
    ref = torch.nn.Parameter(base.t().clone())
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(5):
        g = torch.randn(9, 16)
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    _assert_close(p.detach(), ref.detach(), "non-contiguous param")


def test_cpu_adam_rejects_bad_hyperparameters_and_params():
    w = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"param_groups\[0\]\.lr=-1\.0"):
        CPUAdam([w], lr=-1.0)
    with pytest.raises(ValueError, match=r"betas=\(0\.9, 1\.0\).*\[0, 1\)"):
        CPUAdam([w], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"eps=-1e-08"):
        CPUAdam([w], eps=-1e-8)
    with pytest.raises(ValueError, match=r"params\[0\] is torch.bfloat16.*allowed: torch.float32"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    opt = CPUAdam([w])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\.weight_decay=-0\.1"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "weight_decay": -0.1})


def test_cpu_adam_deepcopy_and_repr():
    model = _model(4)
    opt = CPUAdam(model.parameters(), lr=1e-3, adamw_mode=False)
    clone = copy.deepcopy(opt)
    assert clone.param_groups[0]["adamw_mode"] is False
    assert "CPUAdam" in repr(opt)


@pytest.mark.parametrize("path", ["native", "fallback"])
def test_cpu_adam_params_of_one_group_at_different_steps_match_torch(path):
    """A group's tensors go to the kernel together, batched by their own step count: a
    parameter that missed steps (no gradient) must keep its own bias correction."""
    model, ref = _model(4), _model(4)
    opt = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    gen = torch.Generator().manual_seed(5)
    with kernel_path(path):
        for i in range(6):
            x = torch.randn(8, 33, generator=gen)
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                m(x).pow(2).mean().backward()
                if i < 3:
                    m[2].bias.grad = None  # the last layer's bias skips the first three steps
                o.step()
    assert opt.state[model[2].bias]["step"].item() == 3
    assert opt.state[model[0].weight]["step"].item() == 6
    for a, b in zip(model.parameters(), ref.parameters()):
        _assert_close(a.detach(), b.detach(), "params whose step counts differ")


@pytest.mark.parametrize("adamw_mode,wd,wd_after", [(True, 0.1, 0.3), (False, 0.05, 0.05)])
@pytest.mark.parametrize("n", [1, 37, 100_003])
@pytest.mark.parametrize("path", ["native", "fallback"])
def test_params_from_moments_are_the_step_with_another_step_size(adamw_mode, wd, wd_after, n, path):
    """``adam_params_from_moments``: from the params before a step and the moments it wrote,
    the params of that step with another lr, eps and (AdamW) weight decay, bit for bit, as
    ``adam_step`` with those values makes them (the moments do not depend on them), on the
    native path and on the torch fallback."""
    g = torch.Generator().manual_seed(n)
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m0, v0 = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
    hyper = dict(step=3, betas=(0.9, 0.999), adamw_mode=adamw_mode)
    with kernel_path(path):
        _check_params_from_moments(p0, grad, m0, v0, wd, wd_after, hyper)


def _check_params_from_moments(p0, grad, m0, v0, wd, wd_after, hyper) -> None:
    from offload.optim.kernels import adam_params_from_moments  # noqa: PLC0415

    p1, m1, v1 = p0.clone(), m0.clone(), v0.clone()
    adam_step(p1, grad, m1, v1, lr=1e-2, eps=1e-8, weight_decay=wd, **hyper)
    p2, m2, v2 = p0.clone(), m0.clone(), v0.clone()
    adam_step(p2, grad, m2, v2, lr=3e-3, eps=1e-6, weight_decay=wd_after, **hyper)
    assert torch.equal(m1, m2) and torch.equal(v1, v2)
    redone = p0.clone()
    adam_params_from_moments(
        redone, m1.clone(), v1.clone(), lr=3e-3, eps=1e-6, weight_decay=wd_after, **hyper
    )
    assert torch.equal(redone, p2)
    assert not torch.equal(p1, p2)
