"""``wrap.check_reads``: the first forwards run under a check that raises where code outside a
unit reads one of the unit's parameters while the unit is released.

Note: what the check sees
    A unit's parameters are gathered for its forward and backward and released otherwise (on
    the CPU their storage then reads as zeros). Code outside the unit that reads one directly
    (``F.linear(x, self.blocks[2].fc.weight)`` in the model's forward or another block's) is
    not seen by the hooks, and computes with zeros or stale values without an error, unless
    ``offload.register_external_parameter`` declared it before wrap. For the forwards it
    covers, the check runs the model's forward under a :class:`~torch.overrides.TorchFunctionMode`
    (from the root's forward pre-hook to its forward hook) that looks at every torch call's
    tensor arguments, one list deep: a watched parameter (a unit's, where the param home
    releases) whose unit is not gathered at that moment raises, naming the parameter, its
    unit and the module whose forward was running. Reading its metadata (shape, dtype,
    device, ``requires_grad``, ...) reads no value and passes; so do offload's own calls (a
    frame of offload's between the call and the module call it runs under: its gathers, its
    watch's compares, also where a mode of the caller's runs first). ``p.data`` and
    ``p.detach()`` count as reads (what they return aliases the storage and is not watched).
    What it does not see:
    a read in a backward (an activation-checkpoint recomputation), one after the forwards it
    covers, and one traced by ``torch.compile`` (the mode passes everything while dynamo
    traces, which would otherwise guard on each argument's identity and recompile the user's
    forwards for every new activation); under ``torch.compile`` the end of the check changes
    the mode stack, so each compiled frame recompiles once then.

    A forward stopped by Ctrl-C runs none of torch's forward hooks (``always_call`` ones run
    for an ``Exception`` only), so the mode stays on the thread's stack until the next
    forward, which finds that forward gone (:meth:`ReadCheck._drop_stopped`) and takes it off;
    the stopped forward does not count among those checked.

    It costs nothing where it is off (0, the default: no hook, no mode). On, each torch call of
    the covered forwards goes through Python: on a 3-block model of 48 features (CPU, one
    thread) the forward took 2.0-2.1 ms against 1.5-1.7 ms, the step 7.1-7.3 ms against
    6.1-6.8 ms. It is not on by default because it is not free of false alarms (a torch call
    that reads only metadata and is missing from ``_METADATA``, say ``torch.numel(p)``, raises)
    and because of the recompilation above.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from offload.runtime.state import model_calls

if TYPE_CHECKING:  # pragma: no cover
    from offload.runtime.state import Runtime

_METADATA_ATTRS = (
    "shape",
    "dtype",
    "device",
    "requires_grad",
    "ndim",
    "layout",
    "is_cuda",
    "is_meta",
    "is_leaf",
    "grad",
    "grad_fn",
    "is_sparse",
    "is_quantized",
    "is_nested",
    "itemsize",
    "nbytes",
)
_METADATA_METHODS = (
    "size",
    "dim",
    "ndimension",
    "numel",
    "nelement",
    "stride",
    "storage_offset",
    "is_contiguous",
    "is_floating_point",
    "is_complex",
    "element_size",
    "get_device",
    "data_ptr",
    "untyped_storage",
    "__len__",
    "requires_grad_",
    "register_hook",
    "register_post_accumulate_grad_hook",
)
# torch calls that read no value of their tensor: passed by the check
_METADATA = frozenset(
    [getattr(torch.Tensor, n).__get__ for n in _METADATA_ATTRS]
    + [getattr(torch.Tensor, n) for n in _METADATA_METHODS]
)
_CALLS = (nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__)


def _module_call(frame) -> bool:
    """Whether the frame is torch's call of a module (its forward and hooks run under it)."""
    return frame.f_code in _CALLS and isinstance(frame.f_locals.get("self"), nn.Module)


class _Watch:
    """A watched parameter: its name, and its unit's label and gathered flag."""

    __slots__ = ("flag", "name", "unit")

    def __init__(self, name: str, unit: str, flag) -> None:
        self.name, self.unit, self.flag = name, unit, flag


class _ReleasedReads(TorchFunctionMode):
    """Raises at a torch call that reads a watched parameter whose unit is released (the module
    Note)."""

    def __init__(self, watched: dict[int, _Watch], module_names: dict[int, str]) -> None:
        super().__init__()
        self.watched, self.module_names = watched, module_names

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA and not torch.compiler.is_compiling():
            for a in (*args, *kwargs.values()):
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    w = self.watched.get(id(t))
                    if w is not None and not w.flag.on:
                        self._refuse(w)
        return func(*args, **kwargs)

    def _refuse(self, w: _Watch) -> None:
        frame = sys._getframe(2)
        while frame is not None and not _module_call(frame):
            if frame.f_globals.get("__name__", "").startswith("offload."):
                # offload's own (a gather's copy into the parameter, the watch's compare), also
                # through a mode the caller pushed above this one
                return
            frame = frame.f_back
        module = frame.f_locals["self"] if frame is not None else None
        name = self.module_names.get(id(module), None) if module is not None else None
        reader = (
            f"the forward of {name or '<model>'} ({type(module).__name__})"
            if module is not None
            else "code outside the model's forward"
        )
        reads = f"model.get_submodule('{name}')" if name else "model"
        raise RuntimeError(
            f"offload (wrap.check_reads): {w.name} is read by {reader}, outside its unit "
            f"{w.unit}, whose parameters are released there (it would read zeros or stale "
            "values). Declare the read before offload.wrap: offload.register_external_"
            f"parameter({reads}, model.get_parameter('{w.name}')); or call the layer that "
            "holds it"
        )


class ReadCheck:
    """Runs the model's first ``forwards`` forwards under :class:`_ReleasedReads`; removed
    like a hook handle (``remove``), and removes its hooks once those forwards are done."""

    def __init__(self, model: nn.Module, runtime: Runtime, forwards: int) -> None:
        self.model, self.runtime, self.left = model, runtime, forwards
        owner = {}
        for run in runtime.runs[1:]:
            flag = run.home.flag(run.unit)
            for s in run.unit.layout.segments:
                owner[s.param] = (run.unit.label, flag)
        watched: dict[int, _Watch] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if p in owner and id(p) not in watched:
                watched[id(p)] = _Watch(name, *owner[p])
        names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self._mode = _ReleasedReads(watched, names)
        self._depth = 0
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, module, args) -> None:
        if self._depth and self._depth >= model_calls(self.model, sys._getframe()):
            self._drop_stopped()
        if self._depth == 0 and self.left > 0:
            self._mode.__enter__()
            self._depth = 1
        elif self._depth:
            self._depth += 1

    def _exit(self, module, args, output) -> None:
        if not self._depth:
            return
        self._depth -= 1
        if self._depth == 0:
            self._mode.__exit__(None, None, None)
            self.left -= 1
            if self.left == 0:
                self.remove()

    def _drop_stopped(self) -> None:
        """Forwards that began under the check are no longer running, and no forward hook
        said so: a Ctrl-C stopped them (torch runs ``always_call`` hooks for an ``Exception``
        only), leaving the mode on the thread's stack, the modes that ``with`` blocks inside
        them pushed popped by their exits. The mode is taken off (from the top, or from below
        a mode the caller pushed since) and the depth counts the forwards still running."""
        self._depth = model_calls(self.model, sys._getframe()) - 1
        if self._depth:
            return
        above = []
        while torch._C._len_torch_function_stack():
            mode = torch._C._pop_torch_function_stack()
            if mode is self._mode:
                break
            above.append(mode)
        for mode in reversed(above):
            torch._C._push_on_torch_function_stack(mode)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
