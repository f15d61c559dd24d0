"""The runtime's record of each unit: gather, release and the backward countdown, and how long
the unit stays gathered (its residency, chosen once from the plan).

Every gather and release is a profiler range (``offload::gather``, ``offload::release``) and a
``logger.debug`` line with the same name, so a trace reads like the state machine.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref

import torch
import torch.nn as nn
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.utils._python_dispatch import _disable_current_modes

from offload.homes.params import ParamHome
from offload.plan import Residency, Unit
from offload.runtime.phase import PhaseError

logger = logging.getLogger("offload.runtime")


class UnitRun:
    """One unit during training: its home does the moves, this counts and decides when."""

    __slots__ = (
        "unit",
        "home",
        "residency",
        "timers",
        "grads_pending",
        "backward_done",
        "done_in",
        "may_watch_inputs",
        "watches_inputs",
        "inputs",
        "modules",
        "versions",
        "views",
        "storages",
    )

    def __init__(self, unit: Unit, home: ParamHome, timers: dict[str, float]) -> None:
        self.unit, self.home, self.timers = unit, home, timers
        self.residency = RESIDENCY[unit.residency]
        self.grads_pending = 0  # trainable params whose grad is not final yet in this backward
        self.backward_done = False  # grads of this backward are off the device
        self.done_in = -1  # the backward (graph task) that made them final (:meth:`done`)
        # A frozen layer's backward (its input's gradient) can come after the last gradient
        # of the unit's trainable parameters; where that gradient would release the unit, the
        # unit's backward also waits for the gradients of its forward inputs (OffloadUnitInputs).
        # So does a unit whose module, or a layer in it, has backward hooks (registered before
        # or after wrap), which run as its (or the layer's) inputs' gradients are computed and
        # may read its weights (``watches_inputs_now``): released, or already updated by the
        # step in backward, also where the parameters stay on the device.
        frozen = any(not s.trainable for s in unit.layout.segments)
        self.may_watch_inputs = self.residency.finishes_in_backward
        self.watches_inputs = frozen and self.may_watch_inputs and home.releases
        self.inputs: list[weakref.ref] = []  # the OffloadUnitInputs nodes of its forwards (weakly)
        # the unit's module and the layers in it: a backward hook on any of them may read the
        # unit's weights (on an inner layer, ``fc1.register_full_backward_hook``, it ran after
        # the unit's release, on zeros with a warning, until 2026-12-07)
        self.modules = list(unit.module.modules())
        # each parameter's tensor onto offload's storage, as its home made it (``replaced``)
        self.views = [s.param.data for s in unit.layout.segments]
        self.storages = [(v.untyped_storage()._cdata, v.storage_offset()) for v in self.views]
        self.note_versions()

    def note_versions(self) -> None:
        """Notes each parameter's version counter (bumped by every in-place write through the
        tensor; offload's own writes go through other views of the storage: ``written``)."""
        self.versions = [s.param._version for s in self.unit.layout.segments]

    def stepped(self, seen: set[torch.nn.Parameter] | None) -> None:
        """The step moved the unit's trainable parameters that got a gradient (``seen``; None:
        all of them): their version counters move as torch's in-place update moves them, so a
        backward through a graph saved before the step (``retain_graph=True``) raises torch's
        "modified by an inplace operation" instead of reading the new values. The noted
        versions move with them: this write is offload's, not one :meth:`written` names."""
        for i, s in enumerate(self.unit.layout.segments):
            if s.trainable and (seen is None or s.param in seen):
                torch.autograd.graph.increment_version(s.param)
                self.versions[i] += 1

    def written(self, trainable_only: bool = False) -> list[str]:
        """The unit's parameters written in place through the tensor since the last note: an
        ``nn.init`` call, ``model.apply(...)``, a ``copy_`` under ``no_grad``, after ``wrap``."""
        segments = self.unit.layout.segments
        return [
            s.name
            for s, v in zip(segments, self.versions, strict=True)
            if s.param._version != v and (s.trainable or not trainable_only)
        ]

    def replaced(self) -> list[str]:
        """The unit's parameters given another tensor through ``p.data = ...`` after ``wrap``:
        offload gathers into and updates the storage its home gave them, so the new tensor
        would be neither filled nor trained (at every placement, also where the parameters are
        the master). ``restore`` points them back."""
        return [
            s.name
            for s, (storage, offset), view in zip(
                self.unit.layout.segments, self.storages, self.views, strict=True
            )
            if s.param.untyped_storage()._cdata != storage
            or s.param.storage_offset() != offset
            or s.param.shape != view.shape
        ]

    def restore(self) -> None:
        """Every parameter views offload's storage again (undoes ``p.data = ...``)."""
        for s, view in zip(self.unit.layout.segments, self.views, strict=True):
            s.param.data = view

    def touched(self) -> tuple[list[str], list[str]]:
        """(written, read) parameters of the released unit whose storage code outside offload
        touched since its release (``ParamHome.touched``): ``written`` were written (a write
        through ``p.data``, which bumps no version counter), ``read`` only read (zeros). Each
        touch is said once."""
        written, read = set(), set()
        for lo, hi, wrote in self.home.touched(self.unit):
            for s in self.unit.layout.segments:
                if s.offset < hi and lo < s.end:
                    (written if wrote else read).add(s.name)
        names = [s.name for s in self.unit.layout.segments]
        return [n for n in names if n in written], [n for n in names if n in read - written]

    def overwritten(self) -> list[str]:
        """The unit's parameters in ranges written by code outside offload and then written
        over by offload before a check saw it (``ParamHome.overwritten``)."""
        ranges = self.home.overwritten(self.unit)
        return [
            s.name
            for s in self.unit.layout.segments
            if any(s.offset < hi and lo < s.end for lo, hi in ranges)
        ]

    def gather(self, phase: str) -> None:
        """Makes the unit's parameters usable (idempotent). Its time counts in ``phase`` as IO
        wait, but for its copies to the device, which count as ``gather_copy_seconds``."""
        if self.home.gathered(self.unit):
            return
        self._check_untouched(phase)
        transfers = self.home.transfers
        t0, copied = time.perf_counter(), transfers.copy_seconds_here()
        with torch.profiler.record_function("offload::gather"), outside_transforms():
            self.home.unshard(self.unit)
        took = time.perf_counter() - t0
        copied = transfers.copy_seconds_here() - copied
        waited = took - copied
        self.timers["io_wait_seconds"] += waited  # part of the phase it happens in
        self.timers[f"{phase}_io_wait_seconds"] += waited
        self.timers["gather_copy_seconds"] += copied
        logger.debug(
            "offload::gather %s (%s, %.1f ms, copies %.1f ms)",
            self.unit.label,
            phase,
            took * 1e3,
            copied * 1e3,
        )

    def _check_untouched(self, phase: str) -> None:
        """Nothing read or wrote the released unit's storage in this pass before its gather
        (the runtime's check at the forward's start, step and ``state_dict`` took what came
        before). A read there is code outside the unit reading its parameter while it is
        released (``F.linear(x, self.blocks[2].fc2.weight)`` in another module's forward):
        it computed with zeros, silently, unless ``offload.register_external_parameter``
        declared it or ``wrap.check_reads`` was on (``tests/test_wrap_parity.py``'s model
        that reads two such weights trained 1e-2 off torch undeclared, with no error; the
        check came with 2026-12-06). A read after the unit's release in the forward is seen
        at its gather for the backward. Raised here, before the step can apply what was
        computed; the pages are given back, so it is said once."""
        wrote, read = self.touched()
        if not (wrote or read):
            return
        names = wrote + read
        raise PhaseError(
            f"offload: the {phase} of unit {self.unit.label}: code outside the unit "
            f"{'wrote' if wrote else 'read'} its storage while the unit was released, after "
            f"this forward began (the pages of {', '.join(names[:5])}"
            f"{', ...' if len(names) > 5 else ''}; a page, 4 KiB or a 2 MiB huge page, may "
            "hold several parameters): released, it holds zeros, so that code computed with "
            "zeros" + (" and its write is dropped" if wrote else "") + ". A forward that uses "
            "another block's weight (F.linear(x, self.blocks[2].fc2.weight)) must declare it "
            "before offload.wrap with offload.register_external_parameter(module, param); "
            "wrap.check_reads: 1 names the parameter and the module that uses it. Read values "
            "through model.state_dict()"
        )

    def release(self) -> None:
        if self.home.gathered(self.unit):
            with torch.profiler.record_function("offload::release"), outside_transforms():
                self.home.reshard(self.unit)
            logger.debug("offload::release %s", self.unit.label)

    def begin_backward(self) -> None:
        self.grads_pending = len(self.unit.trainable_params)
        self.backward_done = False
        if self.inputs:  # (in the task the backward began in: see inputs_passed)
            task = torch._C._current_graph_task_id()
            for node in self._live_inputs():
                node.expected = task if will_run(node) else None

    def done(self) -> None:
        """The unit's gradients of this backward are final (in the graph task running now)."""
        self.backward_done = True
        self.done_in = torch._C._current_graph_task_id()

    def again(self) -> None:
        """The backward goes through the unit again after its gradients were final: a call
        of it under ``checkpoint(use_reentrant=True)`` ran a backward of its own, which made
        them final, and the backward it is nested in reaches another call (``Runtime.
        _reached_again``). Its countdown starts over, so that its gradients are final, and
        it is released, after this round too."""
        self.grads_pending = len(self.unit.trainable_params)
        self.backward_done = False

    def watches_inputs_now(self) -> bool:
        """Whether this forward's inputs go through :class:`OffloadUnitInputs` (see
        ``watches_inputs``); the module's backward hooks are looked at at each forward."""
        if self.watches_inputs:
            return True
        if not self.may_watch_inputs:
            return False
        return bool(
            nn.modules.module._global_backward_hooks
            or nn.modules.module._global_backward_pre_hooks
            or any(m._backward_hooks or m._backward_pre_hooks for m in self.modules)
        )

    def grad_ready(self) -> bool:
        """One of the unit's gradients is final; True when that was the last one."""
        self.grads_pending -= 1
        return self.grads_pending == 0

    def watch(self, node) -> None:
        self.inputs = [ref for ref in self.inputs if ref() is not None]  # (graphs let go)
        self.inputs.append(weakref.ref(node))

    def _live_inputs(self) -> list:
        return [node for node in (ref() for ref in self.inputs) if node is not None]

    def inputs_passed(self) -> bool:
        """Whether the backward has computed the gradients of the unit's forward inputs (every
        forward of the unit it goes through): every layer of the unit the backward passes
        through has run, frozen ones too. The backward may be running a reentrant checkpoint's
        inner backward (``checkpoint(use_reentrant=True)`` inside the unit's forward, as
        transformers does), whose task does not hold the unit's input node: the node expected
        when the backward began counts until it ran."""
        task = torch._C._current_graph_task_id()
        for node in self._live_inputs():
            if node.task == task:
                continue
            if (node.expected is not None and node.task != node.expected) or will_run(node):
                return False
        return True


@contextlib.contextmanager
def outside_transforms():
    """A context for offload's own tensor operations (a gather's or release's copies into the
    parameters' storage), in which no ``torch.func`` transform and no ``TorchDispatchMode``
    of the caller's is active: they are not the model's. Under ``torch.func.grad``, ``vjp``,
    ``jacrev`` or ``jvp`` of the wrapped model torch refused the copies as "in-place operation
    (aten::copy_) that would mutate a captured Tensor", naming no offload; under selective
    activation checkpointing (``create_selective_checkpoint_contexts``, a dispatch mode)
    around several units the recomputation met other operations than the forward ("aten.view
    .default encountered during backward but not found in storage") or found a tensor it had
    cached mutated by the next gather (until 2026-12-08). Private in torch, as
    ``torch.compile`` uses them."""
    with contextlib.ExitStack() as stack:
        if torch._C._functorch.peek_interpreter_stack() is not None:
            stack.enter_context(temporarily_clear_interpreter_stack())
        if torch._C._len_torch_dispatch_stack() > 0:
            stack.enter_context(_disable_current_modes())
        yield


def will_run(node) -> bool:
    """Whether the backward running now goes through ``node``: private in torch, and what
    ``torch.autograd.graph.register_multi_grad_hook`` asks the same way."""
    return torch._C._will_engine_execute_node(node)


class OffloadUnitInputs(torch.autograd.Function):
    """The identity on a unit's forward inputs that need a gradient (``UnitRun.watches_inputs``);
    its backward runs when their gradients are computed, after every layer of the unit that
    the backward passes through. It tells the runtime (held weakly, the unit by position: the
    autograd graph holds this node from C++). As under FSDP2's equivalent, the unit sees its
    inputs as views: modifying one in place inside the unit is refused by torch (its error
    names this class)."""

    @staticmethod
    def forward(ctx, runtime: weakref.ref, index: int, *inputs):
        ctx.runtime, ctx.index = runtime, index
        ctx.task = None  # the backward (graph task) that ran it last
        ctx.expected = None  # the backward expected to run it (UnitRun.begin_backward)
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.task = torch._C._current_graph_task_id()
        me = ctx.runtime()
        if me is not None:
            me._inputs_done(me.runs[ctx.index])
        return (None, None, *grads)


class Transient:
    """Released after each forward and after its backward."""

    # its countdown finishes its backward (its gradients taken; the unit released, here, or by
    # the step in backward, persistent ones too) before the backward ends
    finishes_in_backward = True

    def backward_releases(self, schedule) -> bool:
        """Whether a backward releases the unit (the root at its end), so that a graph the
        backward builds (``create_graph``) cannot read its parameters after it."""
        return True

    called_outside = (  # what to do when one of its layers is called outside its forward
        "Call it from that unit's forward, or make it a unit of its own or leave it out of "
        "every unit (wrap.module_classes)"
    )

    def after_forward(self, run: UnitRun) -> None:
        run.release()

    def backward_begins(self, grads, run: UnitRun) -> None:
        """The backward reached the unit: its gradients come next (``runtime.grads``)."""
        grads.unit_begins(run.unit)

    def countdown_done(self, runtime, run: UnitRun) -> None:
        runtime.finish_unit_backward(run)

    def backward_done(self, run: UnitRun, schedule) -> None:
        schedule.unit_backward_done(run)

    def after_backward(self, run: UnitRun) -> None:
        run.release()

    def end_of_pass(self, run: UnitRun) -> None:
        run.release()

    def at_step(self, run: UnitRun) -> None:
        pass


class Persistent(Transient):
    """Kept gathered from first use until the step (its copy is stale after the update)."""

    def backward_releases(self, schedule) -> bool:
        return schedule.releases_persistent  # (the update in the backward releases it)

    def after_forward(self, run: UnitRun) -> None:
        pass

    def after_backward(self, run: UnitRun) -> None:
        pass

    def end_of_pass(self, run: UnitRun) -> None:
        pass

    def at_step(self, run: UnitRun) -> None:
        run.release()


class Root(Transient):
    """Gathered from the start of a forward to the end of its backward; its gradients are final
    only then (its parameters, tied ones included, are used all along)."""

    def after_forward(self, run: UnitRun) -> None:
        pass

    finishes_in_backward = False
    called_outside = (
        "Call the wrapped model itself; a model around it that calls a model inside it "
        "directly (PeftModel.generate calls the transformers model it holds) needs that "
        "inner model wrapped instead (peft_model.get_base_model())"
    )

    def backward_begins(self, grads, run: UnitRun) -> None:
        pass  # its gradients come only at the end of the backward

    def countdown_done(self, runtime, run: UnitRun) -> None:
        pass  # finished with the end of the backward

    def backward_done(self, run: UnitRun, schedule) -> None:
        pass  # released with every other unit at the end of the backward


RESIDENCY = {
    Residency.TRANSIENT: Transient(),
    Residency.PERSISTENT: Persistent(),
    Residency.ROOT: Root(),
}
