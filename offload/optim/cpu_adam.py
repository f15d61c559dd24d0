"""``CPUAdam``: a ``torch.optim.Optimizer`` running the native Adam/AdamW kernel on CPU tensors.

A drop-in for ``torch.optim.AdamW`` (or ``Adam`` with ``adamw_mode=False``) on fp32 CPU
parameters: param groups with their own hyperparameters, ``state_dict()`` /
``load_state_dict()`` (the state has torch's layout: ``step`` as a float32 scalar tensor,
``exp_avg``, ``exp_avg_sq``, so a torch AdamW state loads here and back), LR schedulers and
``zero_grad()`` all behave as in torch. Each parameter is updated by
:func:`offload.optim.adam_step` in one pass, the group's tensors in one native call (thread
count: ``offload._native.set_num_threads``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from offload.optim.kernels import _adam_step_torch, _coefficients, adam_step_many

__all__ = ["CPUAdam"]


def _check_hyper(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"CPUAdam {name}={value!r} is not allowed; {allowed}")


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over fp32 CPU parameters with the native SIMD kernel.

    Args:
        params: parameters or param-group dicts (each group may override any option below).
        lr: learning rate (parameter units per step); a float or a 0-d tensor.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: decoupled decay (AdamW) or L2 penalty (Adam), >= 0.
        adamw_mode: True for AdamW (decoupled), False for Adam (L2 folded into the gradient).
        bias_correction: divide the moments by ``1 - beta**step`` as torch does.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)
        for gi, group in enumerate(self.param_groups):
            self._check_group(gi, group)

    @staticmethod
    def _check_group(gi: int, group: dict[str, Any]) -> None:
        lr = float(group["lr"])
        _check_hyper(f"param_groups[{gi}].lr", lr, lr >= 0.0, "allowed: a float >= 0")
        betas = group["betas"]
        ok = len(betas) == 2 and all(0.0 <= float(b) < 1.0 for b in betas)
        _check_hyper(f"param_groups[{gi}].betas", betas, ok, "allowed: two floats in [0, 1)")
        eps = float(group["eps"])
        _check_hyper(f"param_groups[{gi}].eps", eps, eps >= 0.0, "allowed: a float >= 0")
        wd = float(group["weight_decay"])
        _check_hyper(f"param_groups[{gi}].weight_decay", wd, wd >= 0.0, "allowed: a float >= 0")
        for pi, p in enumerate(group["params"]):
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise ValueError(
                    f"CPUAdam param_groups[{gi}].params[{pi}] is {p.dtype} on {p.device}; "
                    "allowed: torch.float32 tensors on the CPU"
                )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_group(len(self.param_groups) - 1, self.param_groups[-1])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("adamw_mode", True)
            group.setdefault("bias_correction", True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hyper = dict(
                lr=float(group["lr"]),
                betas=(float(group["betas"][0]), float(group["betas"][1])),
                eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]),
                adamw_mode=bool(group["adamw_mode"]),
                bias_correction=bool(group["bias_correction"]),
            )
            # One native call per step count (normally one per group): the kernel's pool splits
            # all of the group's tensors into tasks at once instead of paying a dispatch and a
            # tail per tensor (a GPT has a few hundred small ones).
            batches: dict[float, list[tuple[torch.Tensor, ...]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("CPUAdam does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if isinstance(state["step"], torch.Tensor):
                    state["step"] += 1
                    step = state["step"].item()
                else:  # a plain number (e.g. a state written by another optimizer)
                    state["step"] += 1
                    step = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if all(t.is_contiguous() for t in (p, grad, m, v)):
                    batches.setdefault(float(step), []).append((p, grad, m, v))
                else:  # rare layouts: the same arithmetic through torch, on the strided tensors
                    coef = _coefficients(step=float(step), grad_scale=1.0, **hyper)
                    _adam_step_torch(p, grad, m, v, coef, None)
            for step, tensors in batches.items():
                params, grads, ms, vs = (list(t) for t in zip(*tensors))
                adam_step_many(params, grads, ms, vs, step=step, **hyper)
        return loss
