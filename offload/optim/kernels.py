"""Flat-buffer optimizer kernels: one Adam/AdamW step and one gradient accumulation per call.

These are what the engine drives over whole shards (and what :class:`CPUAdam` drives per
parameter). Each runs the native kernel (``offload._C``: SIMD, multi-threaded, one pass over
memory) or, when the extension is off, a torch fallback with the same results.

Note: arithmetic order.
    The per-element sequence is the one ``torch.optim.Adam``/``AdamW`` (``foreach=False``) runs
    on CPU, including the places where torch's vectorised kernels fuse a multiply-add (``lerp_``,
    ``addcmul_``, ``add(alpha=)``); the scalar coefficients (bias corrections, step size, decay
    factor) are computed here in double exactly as torch computes them, then rounded to float by
    the kernel as torch rounds a Python scalar. So the native step agrees with torch to the last
    bit or two, and the fallback below *is* that torch sequence. ``csrc/cpu_adam.h`` lists it.

Note: sqrt.
    The kernels use the IEEE, correctly rounded square root. torch's float ``Tensor.sqrt`` on
    CPU is not correctly rounded for tensors longer than a vector (about 0.7% of elements come
    out one ulp off in torch 2.13 with AVX-512), so against ``torch.optim`` the result agrees to
    within an ulp of the update per step rather than bit for bit. The fallback takes the square
    root in double and rounds once to float, which is provably the correctly rounded float
    result (a float's square root is never within 2**-50 relative of a float rounding
    midpoint), so native and fallback agree bit for bit.

Note: copy-out.
    ``out`` receives the updated parameters rounded to nearest even, bit-identical to
    ``param.to(out.dtype)`` (for bfloat16 every NaN becomes 0xFFFF, as torch does); this is the
    buffer that goes back to the compute device, written in the same pass as the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from offload import _native

__all__ = ["adam_step", "adam_step_many", "accumulate_grad"]

# dtype codes shared with csrc/cpu_adam.h (enum DType)
_GRAD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NO_OUT = -1

_ALLOWED = "torch.float32, torch.bfloat16 or torch.float16"


@dataclass(frozen=True, slots=True)
class _Coef:
    """Per-call scalars, as doubles; the kernels round each to float (as torch does)."""

    grad_scale: float
    decay: float  # AdamW: 1 - lr*wd (1.0 = off)
    l2: float  # Adam: wd folded into the gradient (0.0 = off)
    w1: float  # 1 - beta1, the lerp weight
    beta2: float
    c2: float  # 1 - beta2
    bc2_sqrt: float  # sqrt(1 - beta2**step), 1.0 without bias correction
    eps: float
    neg_step: float  # -lr / (1 - beta1**step)

    def native_args(self) -> tuple[float, ...]:
        """The trailing arguments of ``_C.adam_step`` / ``_C.adam_step_multi``, in order."""
        return (
            self.grad_scale,
            self.decay,
            self.l2,
            self.w1,
            self.beta2,
            self.c2,
            self.bc2_sqrt,
            self.eps,
            self.neg_step,
        )


def _checked_coefficients(
    step, lr, betas, eps, weight_decay, adamw_mode, bias_correction, grad_scale
) -> _Coef:
    """Validates the per-call hyperparameters and turns them into the kernel's coefficients."""
    if isinstance(step, torch.Tensor):
        step = step.item()
    if bias_correction and not step >= 1:
        raise ValueError(f"step must be >= 1 with bias_correction=True, got {step!r}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    return _coefficients(
        step=float(step),
        lr=float(lr),
        betas=betas,
        eps=eps,
        weight_decay=float(weight_decay),
        adamw_mode=adamw_mode,
        bias_correction=bias_correction,
        grad_scale=grad_scale,
    )


def _coefficients(
    *,
    step: float,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
    grad_scale: float,
) -> _Coef:
    beta1, beta2 = float(betas[0]), float(betas[1])
    if bias_correction:
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
    else:
        bias_correction1 = bias_correction2 = 1.0
    step_size = lr / bias_correction1
    decay = 1 - lr * weight_decay if (adamw_mode and weight_decay != 0) else 1.0
    return _Coef(
        grad_scale=float(grad_scale),
        decay=decay,
        l2=0.0 if adamw_mode else float(weight_decay),
        w1=1 - beta1,
        beta2=beta2,
        c2=1 - beta2,
        bc2_sqrt=bias_correction2**0.5,
        eps=float(eps),
        neg_step=-step_size,
    )


def _check_tensor(name: str, t: object, numel: int | None, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype}; allowed: {allowed}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})"
        )
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements; expected {numel} (as param)")


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int | float,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> None:
    """One Adam (``adamw_mode=False``, L2 decay) or AdamW step, in place, in one pass.

    Args:
        param, exp_avg, exp_avg_sq: contiguous fp32 CPU tensors of the same number of elements
            (flat buffers; any shape is accepted, only the element order matters).
        grad: same number of elements, fp32, bf16 or fp16 (converted on the fly, not copied).
        step: the step number after this update (1 for the first); used for bias correction.
        lr, betas, eps, weight_decay: the usual Adam hyperparameters (lr in parameter units).
        adamw_mode: decoupled weight decay (AdamW) if True, else L2 added to the gradient (Adam).
        bias_correction: divide the moments by ``1 - beta**step`` (as torch) if True.
        grad_scale: multiplied into the gradient first (loss-scale unscaling times the clipping
            coefficient, e.g. ``clip_coef / loss_scale``).
        out: optional contiguous CPU tensor (bf16, fp16 or fp32) with as many elements; receives
            the updated parameters rounded to nearest even, equal to ``param.to(out.dtype)``.
    """
    n = param.numel() if isinstance(param, torch.Tensor) else 0
    _check_tensor("param", param, None, (torch.float32,))
    _check_tensor("grad", grad, n, tuple(_GRAD_CODES))
    _check_tensor("exp_avg", exp_avg, n, (torch.float32,))
    _check_tensor("exp_avg_sq", exp_avg_sq, n, (torch.float32,))
    if out is not None:
        _check_tensor("out", out, n, tuple(_GRAD_CODES))
    coef = _checked_coefficients(
        step, lr, betas, eps, weight_decay, adamw_mode, bias_correction, grad_scale
    )
    mod = _native.get()
    if mod is None:
        _adam_step_torch(param, grad, exp_avg, exp_avg_sq, coef, out)
        return
    mod.adam_step(
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        n,
        _GRAD_CODES[grad.dtype],
        0 if out is None else out.data_ptr(),
        _NO_OUT if out is None else _GRAD_CODES[out.dtype],
        *coef.native_args(),
    )


def adam_params_from_moments(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int | float,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
) -> None:
    """The parameter half of an Adam step whose moments are already the step's: ``param``
    (the value before the step) becomes, bit for bit, what :func:`adam_step` with these
    hyperparameters makes of it when its moments end at ``exp_avg`` / ``exp_avg_sq``. Used to
    redo a step whose step size (lr, eps, AdamW's weight decay: what the moments do not
    depend on; Adam's L2 decay is in them) changed after its moments were written, with no
    gradient at hand. ``exp_avg`` and ``exp_avg_sq`` are scratch: they are
    rewritten with the values they hold (give copies if their bits matter).

    It is the same kernel (so the same operations in the same order), its moment update made
    the identity: a zero gradient, lerp weight 0, beta2 1 and (1 - beta2) 0 leave m and v as
    they are, while the decay, the bias corrections, eps and the step size are the real
    ones. ``grad_scale`` is accepted for the caller's ``Hyper.kwargs()`` and has no effect."""
    del grad_scale
    c = _checked_coefficients(step, lr, betas, eps, weight_decay, adamw_mode, bias_correction, 1.0)
    c = _Coef(
        grad_scale=1.0,
        decay=c.decay,
        l2=0.0,
        w1=0.0,
        beta2=1.0,
        c2=0.0,
        bc2_sqrt=c.bc2_sqrt,
        eps=c.eps,
        neg_step=c.neg_step,
    )
    _check_tensor("param", param, None, (torch.float32,))
    n = param.numel()
    _check_tensor("exp_avg", exp_avg, n, (torch.float32,))
    _check_tensor("exp_avg_sq", exp_avg_sq, n, (torch.float32,))
    zero = torch.zeros(n, dtype=torch.float32)
    mod = _native.get()
    if mod is None:
        _adam_step_torch(param, zero, exp_avg, exp_avg_sq, c, None)
        return
    mod.adam_step(
        param.data_ptr(),
        zero.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        n,
        _GRAD_CODES[torch.float32],
        0,
        _NO_OUT,
        *c.native_args(),
    )


class AdamGroup:
    """Several parameter tensors updated together with the same hyperparameters, their fp32
    state prepared once (checked, pointers taken): :meth:`step` then checks only the gradients
    and makes one native call that spreads all tensors over the compute threads. This is what
    the engine uses when gradients stay in ``p.grad`` (one call per unit instead of one per
    tensor).

    Args:
        params, exp_avgs, exp_avg_sqs: contiguous fp32 CPU tensors, pairwise the same size; they
            must stay alive (and not be resized) while the group is used.
        outs: None, or tensors receiving the updated params (all of one dtype).
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        outs: list[torch.Tensor] | None = None,
    ) -> None:
        if not (len(params) == len(exp_avgs) == len(exp_avg_sqs)):
            raise ValueError("AdamGroup: params, exp_avgs and exp_avg_sqs differ in length")
        if outs is not None and len(outs) != len(params):
            raise ValueError("AdamGroup: outs must match params in length")
        for i, p in enumerate(params):
            n = p.numel()
            _check_tensor("param", p, None, (torch.float32,))
            _check_tensor("exp_avg", exp_avgs[i], n, (torch.float32,))
            _check_tensor("exp_avg_sq", exp_avg_sqs[i], n, (torch.float32,))
            if outs is not None:
                _check_tensor("out", outs[i], n, tuple(_GRAD_CODES))
        if outs is not None and len({o.dtype for o in outs}) > 1:
            raise ValueError("AdamGroup: outs must all have one dtype")
        self.tensors = (params, exp_avgs, exp_avg_sqs, outs)
        self.numels = [p.numel() for p in params]
        self._ptrs = (
            [p.data_ptr() for p in params],
            [m.data_ptr() for m in exp_avgs],
            [v.data_ptr() for v in exp_avg_sqs],
            [o.data_ptr() for o in outs] if outs is not None else [],
        )
        self._out_code = _GRAD_CODES[outs[0].dtype] if outs else _NO_OUT

    def step(
        self,
        grads: list[torch.Tensor],
        *,
        step: int | float,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        grad_scale: float = 1.0,
    ) -> None:
        """One :func:`adam_step` of every tensor, ``grads[i]`` for ``params[i]``."""
        if len(grads) != len(self.numels):
            raise ValueError(f"AdamGroup.step: {len(grads)} grads for {len(self.numels)} params")
        for g, n in zip(grads, self.numels):
            if g.dtype not in _GRAD_CODES or g.numel() != n or not g.is_contiguous() or g.is_cuda:
                _check_tensor("grad", g, n, tuple(_GRAD_CODES))
        c = _checked_coefficients(
            step, lr, betas, eps, weight_decay, adamw_mode, bias_correction, grad_scale
        )
        mod = _native.get()
        if mod is None:
            params, exp_avgs, exp_avg_sqs, outs = self.tensors
            for i, g in enumerate(grads):
                o = outs[i] if outs is not None else None
                _adam_step_torch(params[i], g, exp_avgs[i], exp_avg_sqs[i], c, o)
            return
        pp, mp, vp, op = self._ptrs
        mod.adam_step_multi(
            pp,
            [g.data_ptr() for g in grads],
            mp,
            vp,
            op,
            self.numels,
            [_GRAD_CODES[g.dtype] for g in grads],
            self._out_code,
            *c.native_args(),
        )


def adam_step_many(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    **hyper,
) -> None:
    """:func:`adam_step` of every tensor (``grads[i]`` for ``params[i]``, the same step and
    hyperparameters) in one native call: the pool splits all of them into tasks at once, where
    a call per tensor would pay a dispatch and a tail each (what :class:`CPUAdam` runs)."""
    AdamGroup(params, exp_avgs, exp_avg_sqs).step(grads, **hyper)


_FALLBACK_CHUNK = 1 << 22  # elements per torch pass: bounds the fallback's temporaries


def _adam_step_torch(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    c: _Coef,
    out: torch.Tensor | None,
) -> None:
    """The torch sequence the native kernel mirrors (any strides; see the Note on sqrt)."""
    if param.is_contiguous() and param.numel() > _FALLBACK_CHUNK:
        views = [
            t.view(-1).split(_FALLBACK_CHUNK) if t is not None else None
            for t in (param, grad, exp_avg, exp_avg_sq, out)
        ]
        for i in range(len(views[0])):
            p, g, m, v = (views[k][i] for k in range(4))
            _adam_step_torch(p, g, m, v, c, views[4][i] if out is not None else None)
        return
    g = grad if grad.dtype == torch.float32 else grad.float()
    g = g * c.grad_scale  # a new tensor: the caller's gradient is never modified
    if c.l2 != 0:
        g = g.add(param, alpha=c.l2)
    if c.decay != 1.0:
        param.mul_(c.decay)
    exp_avg.lerp_(g, c.w1)
    exp_avg_sq.mul_(c.beta2).addcmul_(g, g, value=c.c2)
    denom = exp_avg_sq.double().sqrt_().float()  # correctly rounded (see the Note on sqrt)
    if c.bc2_sqrt != 1.0:
        denom.div_(c.bc2_sqrt)
    denom.add_(c.eps)
    param.addcdiv_(exp_avg, denom, value=c.neg_step)
    if out is not None:
        out.view(-1).copy_(param.reshape(-1))


def accumulate_grad(
    acc: torch.Tensor,
    grad: torch.Tensor,
    *,
    scale: float = 1.0,
    overwrite: bool = False,
) -> tuple[bool, float]:
    """``acc = (0 if overwrite else acc) + grad * scale`` in one pass, with the clipping inputs.

    Args:
        acc: contiguous fp32 CPU tensor (the fp32 gradient shard).
        grad: contiguous CPU tensor with as many elements, fp32, bf16 or fp16.
        scale: multiplied into ``grad`` (e.g. ``1 / gradient_accumulation_steps``).
        overwrite: ignore the old contents of ``acc`` (first micro-batch).

    Returns:
        ``(found_inf, sumsq)``: whether any element of the new ``acc`` is inf or NaN, and the sum
        of the squares of the new ``acc`` computed in double (a Python float; its square root is
        the shard's L2 norm for global-norm clipping).
    """
    n = acc.numel() if isinstance(acc, torch.Tensor) else 0
    _check_tensor("acc", acc, None, (torch.float32,))
    _check_tensor("grad", grad, n, tuple(_GRAD_CODES))
    mod = _native.get()
    if mod is not None:
        found, sumsq = mod.accumulate_grad(
            acc.data_ptr(), grad.data_ptr(), n, _GRAD_CODES[grad.dtype], float(scale), overwrite
        )
        return bool(found), float(sumsq)
    flat = acc.view(-1)
    g = grad.view(-1)
    if overwrite:
        flat.copy_(g)  # exact widening
        if scale != 1.0:
            flat.mul_(scale)
    else:
        flat.add_(g, alpha=scale)  # torch fuses this multiply-add, as the kernel does
    sumsq = 0.0
    for chunk in flat.split(1 << 20):  # bounded temporary memory
        d = chunk.double()
        sumsq += float(torch.dot(d, d))
    return not math.isfinite(sumsq), sumsq
