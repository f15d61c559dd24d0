"""What offload replaces on the wrapped model's own modules, as instance attributes (their
classes are untouched, and ``ModelOverrides.remove`` restores them, like a hook handle): the
root's ``named_parameters``, ``zero_grad``, ``__deepcopy__`` and ``load_state_dict``, and the
``_apply`` (conversions) and ``__reduce_ex__`` (pickling) of every module holding parameters."""

from __future__ import annotations

import threading
import types
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:  # pragma: no cover
    from offload.runtime.state import Runtime


class ModelOverrides:
    """Methods of the wrapped root module that offload overrides, and the ``_apply`` of every
    module holding parameters (the module docstring; ``remove`` restores them all).

    Note: parameters read between steps
        ``optimizer.step()`` returns while the NVMe update may still run (into the next forward,
        which waits for each unit's update as it comes). Parameters that live on the device are
        written by it, so a read through ``model.parameters()`` or ``named_parameters()`` right
        after the step (an EMA of the weights, a weight-norm log, ``parameters_to_vector``) would
        see the old values or a mix. The root's ``named_parameters`` (which ``parameters``
        calls) first waits for that update (``state_dict`` does through its hook), as torch's
        synchronous step would have it. ``model.zero_grad()`` iterates the parameters without
        reading them (HF Trainer calls it right after the step), so it does not wait: the update
        keeps overlapping the forward. A tensor kept from an earlier ``parameters()`` call, or a
        submodule's own ``parameters()``, is not seen: ``optimizer.synchronize()`` first. With
        several ranks (stages 1-2) the other ranks' updated shares come in with the next
        forward's refresh (a collective, which a read on one rank cannot start), so this
        holds for one rank; ``state_dict`` is current on every rank.

    Note: model.zero_grad()
        Drops the gradients offload holds outside ``p.grad`` too (``Runtime.zero_grad``, what
        ``optimizer.zero_grad()`` does), as it drops ``p.grad`` in PyTorch: mid accumulation
        the host or NVMe sums stayed and were added to, and after a step it counts as the
        zero_grad() the next backward checks for (``Runtime._discards``).

    Note: copies
        ``copy.deepcopy`` of the wrapped model (an EMA's usual start) would copy the engine its
        hooks hold, threads and open files included, and fail deep inside ``copy``; it raises
        a clear error instead, which says to copy the model before ``wrap``. Pickling it
        (``torch.save(model)``, as older scripts save) failed deep inside pickle ("Can't
        pickle local object 'Runtime.install_hooks.<locals>.<lambda>'"), and a part of it
        (``torch.save(model.blocks[0])``, ``copy.deepcopy(model.lm_head)``) went through
        with the released storage's zeros for values, and with hooks that gather the original
        unit for the copy's forward: every module holding parameters refuses to be pickled or
        copied, naming what saves its values.

    Note: conversions
        ``model.to(dtype)``, ``.half()``, ``.cuda()`` (``Module._apply``) replaced each
        parameter's data with a converted copy that offload never fills (it gathers into its
        own storage): the model then computed with zeros, or with values the step no longer
        updates, without an error. A conversion that would change the compute dtype or
        device (tried on an empty tensor like a parameter) raises instead; one that changes
        neither (``model.to(its device)``, as Accelerate's ``prepare`` does) goes on. Every
        submodule holding parameters gets the same guard: ``model.lm_head.to(torch.bfloat16)``
        went through the root's.

    Note: model.load_state_dict(strict=...)
        torch calls each module's load hooks with ``strict=True`` whatever the caller gave,
        and applies ``strict`` only at the end; the root's ``load_state_dict`` records the
        caller's for :meth:`Runtime._load_values`.
    """

    NAMES = ("named_parameters", "zero_grad", "__deepcopy__", "load_state_dict")

    def __init__(self, model: nn.Module, runtime: Runtime) -> None:
        self.model = model
        settle, zero = runtime._settle_update_for_read, runtime.zero_grad
        cls = type(model)
        waiting = threading.local()  # inside zero_grad: its parameters() call reads nothing

        def named_parameters(self, *args, **kwargs):
            if not getattr(waiting, "off", False):
                settle()
            return cls.named_parameters(self, *args, **kwargs)

        def zero_grad(self, set_to_none: bool = True):
            zero(set_to_none)  # the gradients offload holds outside p.grad go too
            waiting.off = True
            try:
                return cls.zero_grad(self, set_to_none)
            finally:
                waiting.off = False

        def deepcopy(self, memo):
            raise TypeError(
                f"offload: a wrapped model ({cls.__name__}) cannot be deep-copied: its engine "
                "holds threads, buffers and swap files. Copy it before offload.wrap (an EMA: "
                "copy.deepcopy(model) first, then update it from model.state_dict()), or "
                "optimizer.close(restore=True) to get a plain PyTorch model back"
            )

        def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
            runtime.load_strict = strict
            try:
                return cls.load_state_dict(self, state_dict, strict=strict, assign=assign)
            finally:
                runtime.load_strict = False

        # bound methods, as the class's are (torch.compile reads ``named_parameters.__func__``:
        # plain functions here made it fail inside dynamo)
        methods = (named_parameters, zero_grad, deepcopy, load_state_dict)
        for name, fn in zip(self.NAMES, methods, strict=True):
            model.__dict__[name] = types.MethodType(fn, model)
        self.guarded = [model] + [
            m
            for m in model.modules()
            if m is not model and next(m.parameters(False), None) is not None
        ]
        for module in self.guarded:
            module.__dict__["_apply"] = types.MethodType(_conversion_guard(runtime), module)
        # (a block holds its layers' parameters, and its hooks: it is pickled before they are)
        self.unpickled = [m for m in model.modules() if next(m.parameters(), None) is not None]
        for module in self.unpickled:
            module.__dict__["__reduce_ex__"] = types.MethodType(_not_pickled, module)

    def remove(self) -> None:
        for name in self.NAMES:
            self.model.__dict__.pop(name, None)
        for module in self.guarded:
            module.__dict__.pop("_apply", None)
        for module in self.unpickled:
            module.__dict__.pop("__reduce_ex__", None)


def _not_pickled(self, protocol):
    """``__reduce_ex__`` of a wrapped module (the Note on copies)."""
    raise TypeError(
        f"offload: a wrapped model's module ({type(self).__name__}) cannot be pickled or "
        "copied (torch.save(module), pickle, copy.deepcopy): the engine its hooks hold has "
        "threads, buffers and swap files, and its released parameters read as zeros. Save "
        "the values instead: torch.save(model.state_dict()) (a part's state_dict() has its "
        "values too), offload.save_checkpoint with the optimizer, or offload.save_pretrained; "
        "or optimizer.close(restore=True) first to get a plain PyTorch model back"
    )


def _conversion_guard(runtime: Runtime):
    """``Module._apply`` of a wrapped module: refuses a conversion of the parameters' dtype or
    device (tried on an empty tensor like a parameter), and one that would give any of its
    parameters a new tensor (``model.to(memory_format=torch.channels_last)``, which keeps
    both: it went on, the new tensors were never filled, and the step failed in a ``view`` of
    the gradients at every placement, a scratch probe, 2026-12-05), and ``share_memory()``
    (which moved the storage's data away from offload's released blocks: every check after it
    failed, 2026-12-06), then does the class's."""

    def refuse(self, what: str):
        raise ValueError(
            f"offload: converting a wrapped model or module ({type(self).__name__}: "
            ".to(), .half(), .bfloat16(), .cuda(), .to(memory_format=...); Trainer's "
            f"bf16_full_eval / fp16_full_eval) would make its parameters {what}: offload owns "
            "their storage and would not fill the converted copies (the model computed with "
            "zeros or stale values, no error). Set the compute dtype and device in the config "
            "(dtype, device), or convert the model before offload.wrap"
        )

    def apply(self, fn, recurse: bool = True):
        like = torch.empty(0, dtype=runtime.dtype, device=runtime.device)  # (a parameter)
        shared = like.is_shared()
        probe = fn(like)
        if (probe.dtype, probe.device) != (like.dtype, like.device):
            refuse(
                self, f"{probe.dtype} on {probe.device} (they are {like.dtype} on {like.device})"
            )
        if probe.is_shared() and not shared:
            raise ValueError(
                f"offload: share_memory() of a wrapped model or module ({type(self).__name__}) "
                "would move its parameters' storage into shared memory, away from the storage "
                "offload gathers into and releases (every check after it failed, and released "
                "pages were no longer given back): not supported. offload's parameters live in "
                "its own tiers, which processes do not share"
            )

        def checked(t):
            # an owned parameter: tried on an empty tensor like it first (the conversion would
            # read a released parameter: zeros, and a warning at the next forward)
            if id(t) in runtime.watch.owned:
                alike = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                if fn(alike) is not alike:  # (torch's .to() returns the tensor itself when
                    refuse(self, "new tensors (another memory format)")  # nothing changes)
            return fn(t)

        return type(self)._apply(self, checked, recurse)

    return apply
