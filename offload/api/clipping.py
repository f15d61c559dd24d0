"""Gradient clipping that cannot silently vanish.

Note: why torch's clipping sees nothing
    When offload owns the gradients (a host buffer or NVMe shards: ``GradOwner.HOST`` /
    ``NVME``), a parameter's ``.grad`` is dropped as its unit's backward ends.
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` then finds no gradient, returns
    0 and clips nothing, and Hugging Face ``Trainer`` (through Accelerate) logs ``grad_norm``
    0.0 and trains unclipped, while the same script with ``p.grad`` kept
    (``GradOwner.AUTOGRAD``) clips. The call that clips offload's gradients is
    ``optimizer.clip_grad_norm_(max_norm)``: the global norm from the owners' sums of squares,
    the coefficient fused into the next ``step()``.

Note: the guard
    From ``import offload`` on (or, if torch is not loaded yet then, from when it is:
    ``offload.AfterImport``), ``torch.nn.utils``'s ``clip_grad_norm_`` and
    ``clip_grad_value_`` (under ``torch.nn.utils`` and ``torch.nn.utils.clip_grad``) go
    through ``offload._clip_guard`` and :func:`refuse`: a call passing parameters of an open
    offload model whose gradients live elsewhere raises :class:`ClipError` naming the call
    to use. That is detected exactly (the parameters are the runtime's; their gradients are
    not in ``.grad``), so it is an error, not a warning that would scroll by while the run
    trains unclipped. Every other call goes to torch unchanged. Installing it only at the
    first ``wrap`` let a script's usual ``from torch.nn.utils import clip_grad_norm_`` (after
    ``import offload``, before the wrap) keep torch's own, which returned 0.0 and clipped
    nothing. Code that imported the function by name before offload was imported keeps
    torch's own; it is not guarded. ``accelerate.Accelerator.clip_grad_norm_`` is guarded the
    same way (:func:`_guard_accelerate`, at the first ``wrap`` or, if Accelerate is imported
    only later, as it loads: :class:`offload.AfterImport`): from Accelerate 1.16 (with
    transformers 5.24, on 2026-12-02) it no longer calls torch's function but keeps the
    parameters whose ``.grad`` is set and clips them with ``get_total_norm`` and
    ``clip_grads_with_norm_``, so offload's parameters never reached the torch guard and a
    plain ``Trainer`` again logged ``grad_norm`` 0.0 and trained unclipped
    (``tests/test_hf.py``). torch's own two-step form of that,
    ``clip_grads_with_norm_(params, max_norm, get_total_norm([p.grad ...]))`` (torch >= 2.6),
    clipped nothing just as silently: ``clip_grads_with_norm_`` is guarded too, with the
    others at ``import offload``. ``get_total_norm`` takes the gradient tensors, not the
    parameters, so it cannot tell offload's parameters from others; the guard on the clipping
    that follows it refuses the pair. Where the gradients are in ``.grad`` both are torch's.

Note: scaled gradients
    Where the gradients stay in ``.grad`` (``GradOwner.AUTOGRAD``) but offload's loss scaler
    is on (``loss_scale.enabled``, fp16), ``.grad`` holds them times the loss scale until
    ``step()`` unscales them: torch's clipping took that norm (2620 for a true 2.56 at a scale
    of 1024) and clipped 1024 times too hard, silently (1.27e-2 off torch's ``GradScaler``
    with ``unscale_`` after four steps; a scratch probe of 2026-12-08). Those parameters are
    guarded too, with their own message; ``optimizer.clip_grad_norm_`` unscales first.

Note: routing Trainer and Accelerate
    :func:`route_clipping` gives one ``accelerate.Accelerator`` a ``clip_grad_norm_`` that sends
    offload's parameters to their optimizer (``max_norm=inf``, which ``Trainer`` uses to log the
    norm without clipping, gives the norm and clips nothing) and everything else to Accelerate.
    ``offload.OffloadTrainer`` does this for its own accelerator. The whole set of a model's
    trainable parameters is clipped together or not at all: a call with only some of them, or
    mixed with other parameters, is a :class:`ClipError`.
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
import torch.nn.utils

import offload
from offload.api.optimizer import GRADS_HELD_IN
from offload.plan import GradOwner

# optimizers whose runtime keeps gradients outside .grad (weak: a closed, dropped model goes)
_HELD: weakref.WeakSet = weakref.WeakSet()


class ClipError(RuntimeError):
    """Clipping asked of parameters whose gradients offload holds elsewhere."""


def register(optimizer) -> None:
    """Called by ``wrap``: guards torch's clipping once gradients are held outside ``.grad``,
    or are in ``.grad`` but multiplied by offload's loss scale (Note: scaled gradients)."""
    if optimizer._engine.plan.placement.grads is GradOwner.AUTOGRAD and optimizer.scaler is None:
        return
    _HELD.add(optimizer)
    _install()


def _install() -> None:
    offload._guard_torch_clipping()  # done at `import offload` already (module Note)
    # Accelerate imported after the first wrap (a Trainer imported later in the script) is
    # guarded as it loads: importing it here would cost every process that has it installed
    # ~14 MiB of RSS and 0.15 s, used or not (measured on 2026-12-02; the RSS budget tests in
    # tests/test_memory.py caught it)
    offload.AfterImport.run_once_loaded("accelerate", _guard_accelerate)


def _guard_accelerate() -> None:
    """``accelerate.Accelerator.clip_grad_norm_`` through :func:`_refuse` (module Note on the
    guard); an accelerator that :func:`route_clipping` routed sends offload's parameters to
    their optimizer before they get here."""
    from accelerate import Accelerator  # noqa: PLC0415 - optional, imported only if installed

    method = Accelerator.clip_grad_norm_
    if getattr(method, "_offload_guard", False):
        return

    @functools.wraps(method)
    def clip(self, parameters, *args, **kwargs):
        params = _as_list(parameters)
        _refuse(params, "accelerate.Accelerator.clip_grad_norm_")
        return method(self, params, *args, **kwargs)

    clip._offload_guard = True
    Accelerator.clip_grad_norm_ = clip


def _as_list(parameters) -> list:
    """A tensor or an iterable of them (what torch's clipping functions take) as a list."""
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _owned(parameters: list) -> dict:
    """``{optimizer: [its trainable parameters among these]}`` for open offload models that hold
    their gradients elsewhere."""
    out: dict = {}
    for opt in list(_HELD):
        if opt._engine.closed:
            continue
        mine = {id(p) for p in opt._params}
        hit = [p for p in parameters if id(p) in mine]
        if hit:
            out[opt] = hit
    return out


def _refuse(params: list, call: str) -> None:
    """Raises :class:`ClipError` if ``params`` hold parameters of an open offload model whose
    gradients are not in ``.grad`` (module Note on the guard)."""
    owned = _owned(params)
    if owned:
        opt, hit = next(iter(owned.items()))
        if opt._engine.plan.placement.grads is GradOwner.AUTOGRAD:
            raise ClipError(
                f"{call}: {sum(len(h) for h in owned.values())} of the {len(params)} "
                "parameters passed are trained by offload with its loss scaler on "
                "(loss_scale.enabled, or fp16): their .grad holds the gradients times the loss "
                f"scale ({opt.scaler.scale:g}) until step() unscales them, so this call would "
                "take a norm that many times too large and clip by a coefficient that many "
                "times too small. Call optimizer.clip_grad_norm_(max_norm) on the optimizer "
                "offload.wrap returned (it unscales first), or set gradient_clipping in the "
                "config"
            )
        where = GRADS_HELD_IN.get(opt._engine.plan.placement.grads, "offload's buffers")
        two_step = (
            "; torch.nn.utils.get_total_norm over their .grad misses them too: "
            "optimizer.grad_norm() gives their norm"
            if call.endswith("clip_grads_with_norm_")
            else ""
        )
        raise ClipError(
            f"{call}: {sum(len(h) for h in owned.values())} of the "
            f"{len(params)} parameters passed are trained by offload, which keeps their "
            f"gradients in {where}, not in .grad: this call would find no gradient and "
            f"clip nothing (a norm of 0{two_step}). Call optimizer.clip_grad_norm_(max_norm) on "
            "the optimizer offload.wrap returned (it returns the global norm and the clip is "
            "applied in optimizer.step()), or set gradient_clipping in the config; with "
            "Hugging Face Trainer use offload.OffloadTrainer, with Accelerate call "
            "offload.route_clipping(accelerator) once"
        )


def refuse(parameters, call: str) -> list:
    """``parameters`` as a list, after :func:`_refuse`: the check of the guard on torch's
    clipping functions (``offload._clip_guard``, installed at ``import offload``)."""
    params = _as_list(parameters)
    _refuse(params, call)
    return params


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, fallback=None):
    """``torch.nn.utils.clip_grad_norm_`` for parameters that may be offload's: those of one
    wrapped model (all its trainable parameters, any others of it being frozen) go to its
    optimizer; parameters of no offload model go to ``fallback`` (torch's by default)."""
    params = _as_list(parameters)
    owned = _owned(params)
    if not owned:
        fallback = fallback or torch.nn.utils.clip_grad_norm_
        return fallback(params, max_norm, norm_type=norm_type)
    (opt, hit), *others = owned.items()
    trainable = opt._params
    ours = {id(p) for p in trainable}
    stray = [p for p in params if id(p) not in ours and p.requires_grad]
    if others or stray or len({id(p) for p in hit}) != len(trainable):
        raise ClipError(
            "clip_grad_norm_: offload clips all of a wrapped model's gradients together; pass "
            f"exactly its parameters (model.parameters()): got {len(hit)} of its "
            f"{len(trainable)} trainable parameters, {len(stray)} parameters of no offload model"
            + (f" and parameters of {len(others)} other offload model(s)" if others else "")
        )
    if math.isinf(max_norm):
        return opt.grad_norm()
    return opt.clip_grad_norm_(max_norm, norm_type)


def route_clipping(accelerator) -> None:
    """Makes ``accelerator.clip_grad_norm_`` clip offload's parameters through their optimizer
    (see the module Note); idempotent."""
    original = accelerator.clip_grad_norm_
    if getattr(original, "_offload_route", False):
        return

    def routed(parameters, max_norm, norm_type=2):
        return clip_grad_norm_(parameters, max_norm, norm_type, fallback=original)

    routed._offload_route = True
    accelerator.clip_grad_norm_ = routed
