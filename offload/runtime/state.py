"""The runtime of one wrapped model: its hooks, the phase they move through, and the step.

It holds the per-unit records, the param home, the gradient path, the step schedule and the
counters; ``offload.wrap`` builds it from the plan, the optimizer and checkpoints drive it. It
never asks which placement or mode it runs: those are the objects it was given.

Note: the hooks (what FSDP2 does, in words)
    - root forward pre-hook: captures the user's stream, casts floating inputs to the compute
      dtype and gathers the root unit (parameters outside every unit, and tied ones); the root
      stays gathered until the end of backward.
    - unit forward pre-hook: waits for the unit's pending update, gathers the unit (its pieces
      were prefetched while the previous unit ran); unit forward post-hook: the unit's residency
      decides whether it is released, and a hook goes on each output tensor that requires grad;
      that hook fires when backward reaches the unit and gathers it again (the pre-backward
      gather).
    - a post-accumulate-grad hook on every trainable parameter counts down the unit's pending
      grads; at zero the unit's gradients go to their owner and the schedule and residency say
      what happens to the unit.
    - one callback queued on the autograd engine at the first pre-backward hook finishes every
      unit that did not complete (unused params, frozen units, the root) and returns to IDLE.
    - during backward a forward hook means activation-checkpoint recomputation: gather, keep.
      A reentrant checkpoint's recomputation runs a backward of its own, which may make a
      unit's gradients final before the backward around it reaches another call of the unit:
      that call gathers it again (``Runtime._reached_again``).
    - a backward begun inside the model's forward (``torch.autograd.grad`` there) ends back
      in FORWARD, with what that forward had gathered gathered again (``_end_backward``).
    - a root forward under ``torch.autocast`` (found at its start or at its first unit) runs
      with autocast's cache off and saves casts of the weights as references
      (:class:`~offload.runtime.autocast.AutocastSaves`, its Note).

    The time inside these hooks (all that offload does on the thread that runs the model,
    its waits for reads and for updates included) is the step's ``hook_seconds`` (``_hook``).
    What a step takes beyond the model's own compute, ``hook_seconds`` and
    ``optimizer.step()`` is offload's other threads (the update, the IO) taking cores or memory
    bandwidth from the compute.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from offload._interrupts import interrupts_deferred
from offload.device import Transfers
from offload.homes.decay import StepCounts, UpdateRuns
from offload.homes.grads import Hyper
from offload.homes.optim import OptimHome
from offload.homes.params import ParamHome
from offload.plan import Plan
from offload.runtime.agree import Agreement, Call
from offload.runtime.autocast import AutocastSaves
from offload.runtime.grads import Grads
from offload.runtime.overrides import ModelOverrides
from offload.runtime.phase import Phase, PhaseError, PhaseTracker
from offload.runtime.schedule import StepSchedule
from offload.runtime.telemetry import Telemetry
from offload.runtime.units import OffloadUnitInputs, UnitRun, outside_transforms, will_run
from offload.runtime.values import GivenValues, Values
from offload.runtime.watch import ModelWatch

logger = logging.getLogger("offload.runtime")


def _hook(method):
    """A hook of the runtime: its time counts as ``hook_seconds`` (the module Note). Under
    ``torch.compile`` it is opaque (``torch.compiler.disable``): the graph breaks at it and it
    runs as Python, as FSDP2's hooks do. Traced, dynamo followed it into the gathers and the IO
    queue and guarded on their offsets, sizes and unit indices: every unit recompiled them and
    the user's block forward, which ran uncompiled past torch's recompile limit (the hooks of
    the parts inside a unit: ``_guard_parts``)."""

    @functools.wraps(method)
    def timed(self, *args):
        self._check_open()  # a hook a closed engine left on a graph (a loss kept past close())
        start = time.perf_counter()
        try:
            return method(self, *args)
        finally:
            self.timers["hook_seconds"] += time.perf_counter() - start

    return torch.compiler.disable(timed)


def _grad_hook(runtime: weakref.ref, index: int):
    """The gradient hook of unit ``index``'s parameters, holding its runtime weakly
    (``Runtime.install_hooks``)."""

    def hook(param: torch.Tensor) -> None:
        me = runtime()
        if me is None:  # its pools and values went with it: nothing can take this gradient
            raise RuntimeError(
                "offload: a gradient reached a parameter of a wrapped model whose engine was "
                "freed (the model and its optimizer were let go of without close()); optimizer."
                "close(restore=True) before letting go keeps the parameters usable as plain tensors"
            )
        if param.grad is not None and param.grad.layout is not torch.strided:
            raise RuntimeError(me._dense_only(me.runs[index], param))
        me._grad_ready(me.runs[index])  # (closed: _hook raises)
        if me._discarding:  # (Runtime._discards)
            param.grad = None

    return hook


class _GatheredFirst:
    """A full backward pre-hook of the user's on unit ``index``'s module, with the unit's
    pre-backward gather run before it (``Runtime._gather_for_backward_pre_hooks``); holds its
    runtime weakly, as :func:`_grad_hook` does. ``hook`` is the user's."""

    __slots__ = ("hook", "runtime", "index")

    def __init__(self, hook, runtime: weakref.ref, index: int) -> None:
        self.hook, self.runtime, self.index = hook, runtime, index

    def __call__(self, module, grad_output):
        me = self.runtime()
        if me is not None and not me.closed:
            me._pre_backward(me.runs[self.index])
        return self.hook(module, grad_output)


_WRAPPED_CALL = nn.Module._wrapped_call_impl.__code__


def model_calls(model: nn.Module, frame) -> int:
    """How many calls of ``model`` run on this thread's stack from ``frame`` outwards: the
    frames of torch's ``Module.__call__`` for it (one a call, compiled or not)."""
    calls = 0
    while frame is not None:
        calls += frame.f_code is _WRAPPED_CALL and frame.f_locals.get("self") is model
        frame = frame.f_back
    return calls


class _Fresh:
    """Whether one unit's values are the last step's (``Runtime._fresh``)."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = True


class Runtime:
    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        *,
        params: ParamHome,
        optim: OptimHome,
        grads: Grads,
        schedule: StepSchedule,
        transfers: Transfers,
        stores: dict,
        trace_starts: dict[str, list],
        hyper: Callable[[], dict],  # param group values now, and "grad_scale": loss unscaling
        timers: dict[str, float],
        telemetry: Telemetry,
        resources: list,
        buffer_dtypes: dict,
    ) -> None:
        self.model, self.plan = model, plan
        self.units = plan.units  # units[0] is the root
        self.device, self.dtype = plan.placement.device, plan.placement.dtype
        self.params, self.optim, self.grads, self.schedule = params, optim, grads, schedule
        grads.between = self._hand_over
        self.transfers = transfers
        self.stores = stores  # config section -> TieredStore
        # phase name -> stores whose access trace starts there (the param store's with the
        # first forward of a step, the optimizer store's with its first backward)
        self._trace_starts = trace_starts
        self.comm = grads.comm  # the model's process group (offload.dist)
        self.values = Values(plan, params, optim, self.comm)
        # the ranks reach the same calls (its Note); stage 1 may differ in micro-steps
        self.agreement = Agreement(self.comm, count_backwards=grads.reduces_in_backward)
        self._sharded = plan.placement.shard_params
        # nothing trains (wrapped for its forwards: _check_trains): at stages 1-2 no update
        # ever makes a share stale, so its forwards gather nothing (_root_pre_forward)
        self._trains = any(u.trainable_params for u in self.units)
        params.gate = self._gate
        self.timers = timers  # seconds of the current step (the schedule's worker adds too)
        self.runs = [UnitRun(u, params, timers) for u in self.units]
        self.autocast = AutocastSaves(self.runs, self.device)  # (its Note)
        self._hyper = hyper  # the optimizer's param groups' values now
        # each parameter's param group, and those weight decay leaves alone (set_no_decay)
        self.update_runs = UpdateRuns()
        self.telemetry = telemetry
        self.resources = resources  # IO engine, NVMe stores, pools, tiered stores (closed last)
        self.buffer_dtypes = buffer_dtypes  # (module, name) -> dtype before wrap
        self.orig_dtype = {s.param: s.dtype for u in self.units for s in u.layout.segments}
        self.phase = PhaseTracker()
        self.step_count = 0  # optimizer steps taken (not counting skipped ones)
        # each trainable parameter's steps without a gradient (absent: none): its own step
        # count is step_count less that (offload.homes.decay.StepCounts; replaced, not changed)
        self.missed: dict[nn.Parameter, int] = {}
        self.backwards_since_step = 0
        self.backwards_ever = 0  # backwards this runtime took (step(): see check_can_step)
        # the unit whose forward ran last (so far, and in the last forward with grad; before
        # one ran, the plan's last): its backward comes first, so it stays gathered between
        # the two (see _post_forward)
        self._keeps = params.keeps_across_the_turn and len(self.runs) > 1
        self._ran_last: UnitRun | None = None
        self._backward_first: UnitRun | None = self.runs[-1] if self._keeps else None
        self._callback_queued = False
        # the backward running began inside the model's forward (_inside_forward): the units
        # gathered for that forward then, gathered again at its end, which returns to FORWARD
        self._forward_held: list[UnitRun] | None = None
        self._grad_free = False  # the backward running reaches no trainable parameter
        self._discarding = False  # ... or its gradients are dropped (_discards)
        self.load_strict = False  # inside the root's load_state_dict(strict=True)
        self.released = False  # closed without restore: the parameters' values are gone
        # a backward failed part way: its gradients are incomplete until zero_grad()
        self._grads_incomplete = False
        # zero_grad() was called since the last step (or no step ran yet): see _discards
        self._zeroed = True
        # why the gradients held are not the step's until zero_grad() (_check_unzeroed), or None
        self._unzeroed: str | None = None
        # a loss scaler (fp16, or loss_scale.enabled): the optimizer's scale_loss marks the
        # backward that starts from its scaled loss (mark_scaled); one that does not is refused
        # (_check_scaled)
        self.needs_scaled_loss = False
        self._scaled = False
        # the clipping optimizer.clip_grad_norm_ asked since the last step (its coefficient;
        # None: none), applied by the step; dropped with the gradients (zero_grad, also
        # model.zero_grad()); a backward while it is pending is refused (_check_no_clip)
        self.clip_coef: float | None = None
        self._handles: list = []
        # the modules holding a unit's parameters (_guard_parts); set here, as a close of a
        # wrap stopped before its hooks were all on reads them (AttributeError, and a "closed"
        # hook left on the model: tests/_ctrl_c_points.py PHASE weights, 2026-12-07)
        self._parts: list[nn.Module] = []
        # per unit: whether its values are the last step's (_ready_for_forward ran since the
        # step). Off from a step until then, it sends a part of a unit whose parameters are
        # never released, called outside the unit's forward, to _check_gathered, which waits
        # for the unit's update (the released units' parts go there by their gathered flag)
        self._fresh = [_Fresh() for _ in self.units]
        self._step_started = time.perf_counter()
        self._fwd_start: float | None = None
        self._forward_open = False  # a root forward begun and not ended yet
        self._in_step = False  # inside step() or skip_step() (a call made there is refused)
        self._torn: str | None = None  # a load that stopped part way (:meth:`restoring`)
        self._forward_thread = 0  # the thread that began it
        self._forward_graph: _Graph | None = None  # that forward's, until it returns
        # the graphs of this micro-step's forwards that returned (weak references to the
        # _Graph each one's output hooks hold)
        self._graphs: list[weakref.ref] = []
        self._bwd_start: float | None = None
        self.closed = False
        self._teardown: list = []  # close()'s steps not run yet (a stopped close)

    # ---------------------------------------------------------------- hooks
    def install_hooks(self) -> None:
        """Puts the runtime's hooks on the model, each recorded with its handle for
        :meth:`remove_hooks`. One block for a Ctrl-C (a few milliseconds of registrations):
        delivered as a registration returned, before its handle was recorded, it left a hook
        that no close took off (a gradient hook of a stopped wrap's closed engine raised in the
        next wrap's backward: tests/_ctrl_c_points.py, PHASE wrap)."""
        with interrupts_deferred():
            self._install_hooks()

    def _install_hooks(self) -> None:
        self._me = weakref.ref(self)  # what the autograd graph holds (see below)
        h = self.model.register_forward_pre_hook(
            self._root_pre_forward, with_kwargs=True, prepend=True
        )
        self._handles.append(h)
        # (hooks dict, handle id, at its end): the gathers and releases kept outermost
        self._outermost = [(self.model._forward_pre_hooks, h.id, False)]
        self._handles.append(self.model.register_forward_hook(self._root_post_forward))
        self._handles.append(
            self.model.register_forward_hook(self._root_forward_failed, always_call=True)
        )
        for run in self.runs[1:]:
            module = run.unit.module
            h = module.register_forward_pre_hook(lambda m, a, r=run: self._pre_forward(r))
            self._handles.append(h)
            self._outermost.append((module._forward_pre_hooks, h.id, False))
            if run.may_watch_inputs:
                self._handles.append(
                    module.register_forward_pre_hook(
                        lambda m, a, k, r=run: self._watch_inputs(r, a, k), with_kwargs=True
                    )
                )
            h = module.register_forward_hook(lambda m, a, o, r=run: self._post_forward(r, o))
            self._handles.append(h)
            self._outermost.append((module._forward_hooks, h.id, True))
        self._guard_parts()
        self._gather_for_backward_pre_hooks()
        # A tensor's hooks are held from C++, where the cycle collector cannot see them: one that
        # held this runtime would keep it and the model alive for good once the caller let go
        # of both without closing. So it holds the runtime weakly, and the unit by position.
        me = self._me
        for i, run in enumerate(self.runs):
            for p in run.unit.trainable_params:
                self._handles.append(p.register_post_accumulate_grad_hook(_grad_hook(me, i)))
        self._model_state_dict = False  # inside the model's own state_dict() (_part_values)
        self._handles.append(self.model.register_state_dict_pre_hook(self._state_dict_begins))
        self._handles.append(self.model._register_state_dict_hook(self._state_dict_hook))
        # a load of the model, or of any module in it holding parameters (a block's, a
        # layer's: it copied into released storage, said success and loaded nothing); a
        # module's hook finds nothing where an enclosing module's load took its keys first
        for module in self.model.modules():
            if module is self.model or next(module.parameters(), None) is not None:
                self._handles.append(module.register_load_state_dict_pre_hook(self._load_values))
                self._handles.append(module.register_load_state_dict_post_hook(self._loaded_values))
        self._loaded_keys: set[str] = set()
        self._load_missing: list | None = None  # the load _loaded_keys are of (its missing keys)
        # what code outside offload did to the parameters between uses (its module docstring)
        self.watch = ModelWatch(
            self.model,
            self.runs,
            self.params,
            self.plan.placement,
            self._derive_again,
            self._differ_from_master,
            self.flush_pending,
        )
        self._handles.append(ModelOverrides(self.model, self))

    def _guard_parts(self) -> None:
        """A module holding a unit's parameters, called by itself while the unit is released
        (outside the unit's forward: a parent calling ``block.proj`` directly, a root layer
        called before the model), would compute with storage that reads as zeros (the module
        Note of ``offload.device.pages``): it raises instead, naming the module and its unit.
        The unit's own module is not guarded: its forward gathers it. Its ``state_dict()``
        (a block's, a layer's) read those zeros too: it gets the values (:meth:`_part_values`)."""
        owner = {s.param: run for run in self.runs for s in run.unit.layout.segments}
        units = {run.unit.module for run in self.runs}
        for name, module in self.model.named_modules():
            runs = {owner[p] for p in module._parameters.values() if p in owner}
            if runs and module is not self.model:  # (the model's own state dict: below)
                self._parts.append(module)
                self._handles.append(
                    module._register_state_dict_hook(
                        lambda m, sd, prefix, meta, rs=tuple(runs): self._part_values(
                            m, sd, prefix, rs
                        )
                    )
                )
            if module in units:
                continue
            for run in runs:
                # the check's fast path reads the unit's flag alone: traced by torch.compile
                # inside the unit's forward, it is guarded on that flag (``_Gathered``), and
                # the graph breaks only where the unit is not gathered. A unit never released
                # is always gathered: its flag is whether its values are the last step's
                flag, check = run.home.flag(run.unit), self._check_gathered
                if not run.home.releases:
                    flag, check = self._fresh[run.unit.index], self._settle_part
                self._handles.append(
                    module.register_forward_pre_hook(
                        lambda m, a, r=run, n=name, g=flag, c=check: None if g.on else c(r, n, m)
                    )
                )

    @torch.compiler.disable
    def _check_gathered(self, run: UnitRun, name: str, module: nn.Module) -> None:
        """Called outside its unit's forward under ``no_grad`` between steps (an inference
        that calls part of the model: Hugging Face's ``generate`` runs an encoder-decoder's
        encoder by itself, ``model.get_encoder()(...)``, whose embedding is the root unit's),
        the part gathers its unit for the call; with gradients on it raises (the unit's
        backward would not follow it)."""
        if run.home.gathered(run.unit) or self.closed:
            return
        if not torch.is_grad_enabled() and self.phase.phase is Phase.IDLE:
            self._ready_for_forward(run)
            self.watch.check_unwritten(f"a call of {name} by itself")  # (what came between steps)
            self.watch.check_pieces(f"a call of {name} by itself", run)
            run.gather(Phase.FORWARD.value)

            # released when this call ends, also by an error; a hook for this call alone (a
            # standing always_call hook on every part made torch.compile guard on its id)
            def release(*_) -> None:
                once.remove()
                run.release()

            once = module.register_forward_hook(release, always_call=True)
            return
        if self.phase.phase is Phase.BACKWARD and run.backward_done:
            # the recomputation of the unit's body, checkpointed inside its forward with
            # use_reentrant=True, for another call of it (_reached_again)
            self._check_one_backward(run)
        raise RuntimeError(
            f"offload: {name} ({type(module).__name__}) was called outside the forward of "
            f"its unit {run.unit.label}, whose parameters are released there (they would "
            f"read as zeros). {run.residency.called_outside}; or, for a call that computes "
            "no gradient (an inference, a value read for saving), make it under "
            "torch.no_grad(), where the part gathers its unit for the call"
        )

    @torch.compiler.disable
    def _settle_part(self, run: UnitRun, name: str, module: nn.Module) -> None:
        """A part of a unit whose parameters are never released (``offload_param.device:
        none``), called outside its unit's forward between a step and that forward: it computes
        with them as they are, so it waits for the unit's update first, which the step may have
        left running (it read the values of before the step, or a mix). Not in a backward: the
        step's update is done there (the backward began by waiting for it), and an update in
        this backward may wait for its end."""
        if not self.closed and self.phase.phase in (Phase.IDLE, Phase.FORWARD):
            self._ready_for_forward(run)

    def _settle_update_for_read(self) -> None:
        """The parameters are read through the model between a step and the next forward (an
        EMA, a weight norm): the update that ``step()`` left running writes the device-resident
        ones, so it is waited for first (:class:`~offload.runtime.overrides.ModelOverrides`). Elsewhere the
        forward waits for each unit's update itself, and before ``step()`` none runs."""
        if not self.closed and self.phase.phase is Phase.IDLE and not self.backwards_since_step:
            self.flush_pending()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for run in self.runs[1:]:  # the user's backward pre-hooks as they were
            hooks = run.unit.module._backward_pre_hooks
            for key, hook in list(hooks.items()):
                if isinstance(hook, _GatheredFirst):
                    hooks[key] = hook.hook

    def _cast_input(self, x):
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() and x.dtype != self.dtype:
                x = x.to(self.dtype)
            if x.device != self.device:
                x = x.to(self.device)
        return x

    def _keep_outermost(self) -> None:
        """A unit's gather runs before the forward pre-hooks the user registered on its
        module, and its release after the forward hooks, also those registered after wrap (a
        hook that reads the block's weights: a regularizer, a probe) or with ``prepend=True``:
        they would read released storage (zeros). Moved only when another hook took the place,
        so the hooks dicts do not change otherwise (``torch.compile`` guards on them). Called
        as the model's forward begins; the model's own pre-hook moves from its next forward."""
        for hooks, key, last in self._outermost:
            if key in hooks and next(reversed(hooks) if last else iter(hooks)) != key:
                hooks.move_to_end(key, last=last)

    def _gather_for_backward_pre_hooks(self) -> None:
        """A full backward pre-hook on a unit's module (``register_full_backward_pre_hook``)
        runs as the gradients of the module's outputs arrive, before the tensor hooks that
        gather the unit for its backward (``_hook_outputs``: torch wraps a module's outputs
        for its backward hooks after its forward hooks ran): it read the unit released, zeros,
        and the gather after it raised as at a read between uses (until 2026-12-07). Each
        such hook is wrapped so that the gather runs first in it. Done at wrap and as the
        model's forward begins (torch takes a module's hooks as it is called: one registered
        inside the forward counts from the next); the dicts change only for a new hook
        (``torch.compile`` guards on them)."""
        for i, run in enumerate(self.runs[1:], start=1):
            hooks = run.unit.module._backward_pre_hooks
            if not hooks:
                continue
            for key, hook in list(hooks.items()):
                if not isinstance(hook, _GatheredFirst):
                    hooks[key] = _GatheredFirst(hook, self._me, i)

    @_hook
    def _root_pre_forward(self, module, args, kwargs):
        self._check_open()
        self._keep_outermost()
        self._gather_for_backward_pre_hooks()
        self._settle_backward()
        if self.phase.phase is Phase.BACKWARD:
            return None  # recomputation of the whole model (unusual) keeps everything gathered
        self.watch.check_in_model("a forward of the model")
        self._check_consistent("a forward of the model")
        # (it gathers: agree's Note). A model with nothing trainable at stages 1-2 gathers
        # nothing, ever: its forwards stay this rank's own, as a replicated model's in torch, so
        # ranks may run different numbers of them (an evaluation split unevenly, generate()
        # stopping at another length). Checked, each one was a blocking collective, and a rank
        # with a batch more waited in it while the others went on to gather the predictions:
        # gloo aborted them ("Received data size doesn't match expected size").
        if self._sharded or (self.backwards_since_step == 0 and self._trains):
            self.agreement.check(
                Call.FORWARD, self.step_count, self.backwards_since_step, torch.is_grad_enabled()
            )
        # if it raises, _root_forward_failed drops it (with the micro-step, when no earlier
        # forward's outputs are held)
        if self.phase.phase is Phase.IDLE:
            self._begin_micro_step()
        self._forward_open = True
        self._forward_thread = threading.get_ident()
        self._forward_graph = _Graph()
        self.phase.to(Phase.FORWARD)
        self.autocast.begin_forward()
        self._use(self.runs[0])
        return tree_map(self._cast_input, args), tree_map(self._cast_input, kwargs)

    @_hook
    def _root_post_forward(self, module, args, output):
        if self.phase.phase is not Phase.FORWARD:
            return output
        self._stop_timer("_fwd_start", "forward_seconds")
        if torch.is_grad_enabled() and self._keeps:  # learned for the next (_post_forward)
            self._backward_first = self._ran_last
        if not (torch.is_grad_enabled() and _requires_grad(output)):
            self._drop_forward()  # inference: nothing will come back through backward
        else:
            graph = self._forward_graph  # (None after a forward of the root nested in it)
            self._hook_outputs(self.runs[0], output)
            if graph is not None:
                self._graphs.append(weakref.ref(graph))
            self._close_forward()
        return output

    @_hook
    def _root_forward_failed(self, module, args, output) -> None:
        """Runs after every root forward (``always_call``), also one that raised (an error in
        the model, an IO error of a gather). One that raised is not a forward a backward can
        follow: when no earlier forward of the micro-step has outputs held either, the
        micro-step is undone as an inference ends (its units let go, back to between steps),
        so that everything works as before it (it stayed in FORWARD: loading a checkpoint
        refused until a backward). The gradients of the step's earlier micro-steps are kept.
        torch runs these hooks for an ``Exception`` only: a forward stopped by Ctrl-C is
        dropped at the caller's next call (:meth:`_settle_forward`)."""
        if self._forward_open:  # (not ended by _root_post_forward)
            self.watch.forward_failed()  # (before the drop releases the units it gathered)
            self._drop_forward()

    def _close_forward(self) -> None:
        """The root forward is over: returned (its graph is in ``_graphs``) or stopped (its
        partial outputs, which a traceback may hold, keep nothing)."""
        self._forward_open = False
        self._forward_graph = None
        self.autocast.end_forward()

    def _drop_forward(self) -> None:
        """The open root forward gets no backward (an inference, or one that failed): closed,
        and the micro-step dropped (:meth:`_end_forward`) when no earlier forward of it can get
        one either."""
        self._close_forward()
        if self.phase.phase is Phase.FORWARD and not self._graphs_held():
            self._end_forward()

    def _graphs_held(self) -> bool:
        """Whether a backward can still follow one of the micro-step's forwards that returned."""
        return any(ref() is not None for ref in self._graphs)

    def _end_forward(self) -> None:
        """The micro-step's forwards end with no backward to follow (an inference, or one
        dropped): their units let go, back to between steps. The gradients of the step's
        earlier micro-steps are kept."""
        self._close_forward()
        for run in self.runs:
            run.residency.end_of_pass(run)
        self.phase.to(Phase.IDLE)

    def _settle_forward(self) -> None:
        """A forward that no backward can follow any more is dropped (:meth:`_end_forward`),
        for a call of the caller's between steps: every forward of the micro-step either
        returned and had its loss and outputs let go unused (a loss looked at with gradients
        on, a skipped batch), or was stopped by Ctrl-C on this thread (torch runs no hook for
        it; the traceback's frames may still hold its partial outputs). Left in FORWARD,
        loading state would be refused and ``step()`` too, where plain PyTorch goes on. A
        forward's graph is gone when its :class:`_Graph` is (only the autograd graph holds
        it)."""
        if self.phase.phase is not Phase.FORWARD:
            return
        if self._forward_open:
            # (else: running on another thread, or still running on this one: the caller is
            # a signal handler or a hook inside it, a save for a preemption say)
            if self._forward_thread == threading.get_ident() and not self._forward_on_stack():
                self._drop_forward()  # stopped by Ctrl-C
        elif self._graphs and not self._graphs_held():
            self._end_forward()

    def _forward_on_stack(self) -> bool:
        """Whether the root forward is still running under the caller on this thread: a
        frame of torch's module call for the model is on the stack (after a Ctrl-C it is
        not: the exception unwound it)."""
        return model_calls(self.model, sys._getframe(1)) > 0

    def _begin_micro_step(self) -> None:
        # the update in the last backward (step_in_backward) wrote the weights: a forward
        # before step() would compute with them, where torch's uses the ones of before
        self.schedule.check_access("a forward of the model", self.backwards_since_step)
        self._graphs = []
        self._fwd_start = time.perf_counter()
        self.transfers.capture_stream()
        if self.backwards_since_step == 0:
            for store in self._trace_starts.get("forward", ()):
                store.begin_iteration()

    @_hook
    def _pre_forward(self, run: UnitRun) -> None:
        self._settle_backward()
        if self.phase.phase is Phase.IDLE:  # a unit called directly, outside the model
            self._check_consistent("a forward of a part of the model")
            self._begin_micro_step()
            self.phase.to(Phase.FORWARD)
        self._use(run)
        self.autocast.unit_begins(run, self._forward_open)

    def _use(self, run: UnitRun) -> None:
        """Gathers a unit for its forward (or its recomputation inside a backward)."""
        if self.phase.phase is Phase.BACKWARD:
            if run.backward_done:  # a recomputation after its gradients were final
                self._check_one_backward(run)
                run.again()
        else:  # an update starts only after the backward
            self._ready_for_forward(run)
            self.watch.check_pieces("a forward of the model", run)  # (its update is done)
            if torch.is_grad_enabled():  # (stages 2-3: the order of the reductions)
                self.grads.forward_use(run.unit)
        run.gather(self.phase.phase.value)

    def _ready_for_forward(self, run: UnitRun) -> None:
        """The unit's values are the last step's: its update done (it may still run after
        ``step()``), and at stages 1-2 the other ranks' updated shares in."""
        self.schedule.wait_unit(run.unit)
        self.params.refresh(run.unit)
        self._fresh[run.unit.index].on = True

    @_hook
    def _watch_inputs(self, run: UnitRun, args, kwargs):
        """The unit's inputs that need a gradient go through :class:`OffloadUnitInputs`, whose
        backward tells :meth:`_inputs_done` (the unit holds frozen layers: ``UnitRun``)."""
        if not torch.is_grad_enabled() or not run.watches_inputs_now():
            return None
        flat, spec = tree_flatten((args, kwargs))
        at = [i for i, t in enumerate(flat) if _grad_tensor(t)]
        if not at:
            return None
        outs = OffloadUnitInputs.apply(self._me, run.unit.index, *(flat[i] for i in at))
        run.watch(outs[0].grad_fn)
        for i, t in zip(at, outs, strict=True):
            flat[i] = t
        return tree_unflatten(flat, spec)

    @_hook
    def _inputs_done(self, run: UnitRun) -> None:
        if self.phase.phase is not Phase.BACKWARD:
            self._begin_backward()
        if run.grads_pending == 0 and not run.backward_done and run.inputs_passed():
            self._countdown_done(run)

    def _gate(self, unit) -> None:
        """Before a collective reads ``unit``'s home ahead of its use: its own pending update
        must be done (not in a backward: the update of a unit starts after its backward)."""
        if self.phase.phase is not Phase.BACKWARD:
            self.schedule.wait_unit(unit)

    @_hook
    def _post_forward(self, run: UnitRun, output):
        if self.phase.phase is Phase.BACKWARD:
            return output  # activation-checkpoint recomputation: keep gathered for its backward
        self.autocast.unit_ends()
        if torch.is_grad_enabled():
            self._hook_outputs(run, output)
            self._ran_last = run
            if run is self._backward_first:
                # the last forward's last unit is the backward's first: kept gathered for it
                # (released after its backward, or at the end of the pass), so the backward
                # does not read it again; the memory budget's next-unit slot holds it
                return output
        run.residency.after_forward(run)
        if not self._forward_open and not self._graphs_held():
            # a unit called by itself, outside the model, that no backward can follow (under
            # no_grad): an inference, ended here as the model's are (it stayed in FORWARD,
            # and load_checkpoint was refused as if a loss were held)
            self._end_forward()
        return output

    def _begin_backward(self) -> None:
        """A backward starts (from a forward, or again over a retained graph): every unit's
        grads are pending, the root is gathered, one end-of-backward callback is queued."""
        self._stop_timer("_fwd_start", "forward_seconds")
        self.transfers.capture_stream()
        self._grad_free = not self._reaches_trainable()
        self._discarding = False
        self._forward_held = None
        if self._inside_forward():
            self._forward_held = [r for r in self.runs if r.home.gathered(r.unit)]
        try:
            self._check_trainable()
            self._check_no_create_graph()
            if not self._grad_free:
                self._begin_step_backward()
        except PhaseError:
            self.grads.backward_failed()
            if self._forward_held is not None:  # the forward goes on (its error, say)
                self._forward_held = None
                self._fwd_start = time.perf_counter()
                raise
            for run in self.runs:  # back to between steps: step() can still close the first
                run.residency.end_of_pass(run)
            self.phase.to(Phase.IDLE)
            raise
        self.phase.to(Phase.BACKWARD)
        self._bwd_start = time.perf_counter()
        for run in self.runs:
            run.begin_backward()
        self.runs[0].gather(Phase.BACKWARD.value)
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _inside_forward(self) -> bool:
        """Whether the backward beginning now runs inside the model's forward: a root forward
        is open and its call is on its thread's stack (a forward stopped by Ctrl-C is open,
        but its call is not there: :meth:`_forward_on_stack`). That thread may be another
        than this one: autograd runs a device's backward on a thread of its own, the
        forward's waiting in it."""
        if not self._forward_open:
            return False
        frame = sys._current_frames().get(self._forward_thread)
        return frame is not None and model_calls(self.model, frame) > 0

    def _begin_step_backward(self) -> None:
        """The backward starting is one of the step's: its checks, then the gradients' owner
        and the schedule hear of it (before it takes any gradient)."""
        if self._forward_held is not None:
            raise PhaseError(
                "offload: a backward that reaches the model's trainable parameters "
                "(loss.backward(), backward(inputs=...) naming parameters) began inside the "
                "model's forward: offload counts it as one of the step's backwards, whose "
                "gradients it takes and whose update may run in it, before the rest of the "
                "forward computes with the weights. Call it after the forward returns; "
                "torch.autograd.grad inside the forward (a gradient with respect to an "
                "activation or the input, or to parameters without create_graph) works"
            )
        # the first backward after a step with no zero_grad() since
        after_step = not (self._zeroed or self.backwards_since_step)
        if self._discards(after_step):  # (before the scale check: a GAN's generator loss is
            self._scaled = False  # scaled by the generator's optimizer, not this one's)
            self._grad_free = self._discarding = True
            return
        self._check_scaled(after_step)
        self._check_no_clip()
        step, backwards = self.step_count, self.backwards_since_step
        self.grads.backward_begins(
            lambda order: self.agreement.check(Call.BACKWARD, step, backwards, detail=order)
        )
        self.schedule.backward_begins(self._step_hyper, self.backwards_since_step)
        if self.backwards_since_step == 0:
            for store in self._trace_starts.get("backward", ()):
                store.begin_iteration()

    def _grads_after_all(self) -> None:
        """A gradient reached a trainable parameter in a backward taken at its start for one
        that reaches none (:meth:`_reaches_trainable`): every trainable unit runs under
        ``torch.utils.checkpoint(use_reentrant=True)`` (LoRA adapters in checkpointed layers
        around a frozen root), whose recomputation builds the graph to their parameters only
        inside the backward. Taken for grad-free, that backward dropped the gradients offload
        holds and ``step()`` said "no backward since the last step". It becomes one of the
        step's backwards here, before the first gradient is taken (the units it finished so
        far hold no trainable parameter)."""
        self._grad_free = False
        try:
            self._begin_step_backward()
        except BaseException:
            self._abort_backward()
            raise

    def _reaches_trainable(self) -> bool:
        """Whether the backward starting now accumulates a trainable parameter's gradient.
        One that does not (``torch.autograd.grad`` with respect to the inputs: an adversarial
        example, a saliency map; ``backward(inputs=...)`` naming no parameter) is not a
        micro-step of the step: it gathers and releases the units and leaves the gradients,
        the step's count of backwards and the update in backward alone. Counted, it was taken
        for the step's last backward and ran the update in it (the next forward refused).
        Asked of autograd per parameter's accumulation node (:meth:`_params_ahead`)."""
        return any(self._params_ahead(run) for run in self.runs)

    def mark_scaled(self) -> None:
        """The backward now starting begins at a loss ``scale_loss`` scaled (its hook)."""
        self._scaled = True

    def _check_scaled(self, after_step: bool) -> None:
        """A loss scaler without ``scale_loss``: the step divides the gradients by the loss
        scale (2**16 at first) that the loss never got, so every update was about that much too
        small, and no overflow could show it: refused before this backward takes anything.
        ``after_step``: the backward follows a step with no ``zero_grad()`` since, where the
        gradients stay in ``p.grad`` (else :meth:`_discards` took it): a GAN's generator loss,
        scaled by the generator's optimizer, through the discriminator. Its sum is only wrong
        once read, so the norm and the step refuse it until ``zero_grad()`` instead."""
        scaled, self._scaled = self._scaled, False
        if self.needs_scaled_loss and not scaled and after_step:
            self._unzeroed = (
                "a loss.backward() without this optimizer's loss scaling (another model's "
                "scale_loss: a GAN's generator loss through the discriminator) after "
                "optimizer.step() with no zero_grad() in between: its gradients are not at "
                "this optimizer's loss scale"
            )
        elif self.needs_scaled_loss and not scaled:
            raise PhaseError(
                "offload: loss.backward() without loss scaling, with a loss scaler (fp16 "
                "compute or loss_scale.enabled): the step divides the gradients by the loss "
                "scale, so the loss must be multiplied by it; "
                "call optimizer.scale_loss(loss).backward() (for several losses, scale their "
                "sum, or each of them)"
            )

    def _discards(self, after_step: bool) -> bool:
        """Whether this backward, the first after a step with no ``zero_grad()`` since
        (``after_step``), drops its gradients. In PyTorch it adds them to the ones the step used. An owner that handed
        those to the update (host or NVMe gradients) no longer has them, and went on as if
        zero_grad() had been called, so the same loop trained differently on another
        placement; until 2026-12-05 such a backward was refused. But its sum is only wrong
        once something reads it, and a GAN's loop never does: the generator's step
        backpropagates through the discriminator after the discriminator's step, and the loop
        zeroes the discriminator's gradients before their next backward (torch's DCGAN
        example). So the backward runs as one that reaches no trainable parameter (the units
        are gathered and released, no update runs in it, its gradients are dropped, and the
        model stays readable between steps), and :meth:`_check_unzeroed` refuses the norm and
        the step until ``zero_grad()``."""
        if not after_step or self.grads.owner.kept_after_step:
            return False
        self._unzeroed = (
            "a loss.backward() that followed optimizer.step() with no zero_grad() in between: "
            "PyTorch would add that backward's gradients to the ones the last step used, but "
            "offload's step consumed them (its gradients live outside p.grad with this "
            "placement)"
        )
        return True

    def _check_unzeroed(self, what: str) -> None:
        if self._unzeroed:
            raise PhaseError(
                f"offload: {what} after {self._unzeroed}; call optimizer.zero_grad() (or "
                "model.zero_grad()) after each step. A backward through this model that only "
                "feeds another model's step (a GAN's generator step through the "
                "discriminator) needs no zero_grad() until this model's next backward of its "
                "own"
            )

    def _check_no_clip(self) -> None:
        """A backward after ``clip_grad_norm_`` and before the step. Torch's clipping scales
        the gradients accumulated so far in place and this backward's add unclipped; offload's
        multiplies all of the step's gradients at the step, so this backward's would have been
        clipped too (2.6 against 0.11 for the step's norm, the probe) without a word. Refused
        before this backward takes anything."""
        if self.clip_coef is None:
            return
        raise PhaseError(
            "offload: loss.backward() after optimizer.clip_grad_norm_() and before "
            "optimizer.step(): offload applies the clipping to all of the step's gradients at "
            "step(), this backward's included, where torch's in-place clipping would scale only "
            "the gradients accumulated before it; call clip_grad_norm_ after the step's last "
            "backward, and optimizer.grad_norm() to read the norm before it (it clips nothing; "
            "optimizer.zero_grad() drops the gradients and the clipping). Refused also where "
            "this clipping scaled nothing, so that a loop is refused at its first step, not at "
            "the first batch whose norm is over max_norm"
        )

    def _check_trainable(self) -> None:
        """Which parameters train is fixed at wrap: the layout puts them first, with their
        optimizer state and gradient room. One unfrozen after wrap was never trained, without
        a word: refused at the next backward instead, before it takes anything. One frozen
        after wrap (``requires_grad_(False)``) just gets no gradient in the backwards it is
        frozen for: a GAN's loop freezes the discriminator for the generator's step (CycleGAN's
        ``set_requires_grad``; refused here until 2026-12-05), and its own step leaves it
        alone, as torch's does (``offload.homes.decay.StepCounts``; that step was refused
        until 2026-12-06, when offload's moved it as with a zero gradient)."""
        for run in self.runs:
            for s in run.unit.layout.segments:
                if s.param.requires_grad and not s.trainable:
                    raise PhaseError(
                        f"offload: parameter {s.name} was frozen when the model was wrapped and "
                        "now has requires_grad=True; offload fixes which parameters train at "
                        "wrap (it holds no optimizer state for it). Set requires_grad before "
                        "offload.wrap (offload.from_pretrained: its before_wrap= callable), or "
                        "wrap again"
                    )

    def _check_no_create_graph(self) -> None:
        """A backward that builds a graph of its own (``create_graph=True``: a gradient
        penalty, WGAN-GP, R1, a Hessian-vector product) saves the parameters in that graph,
        and offload releases them after it: the backward through it then computed with
        zeros (5e-2 to 8e-2 off torch after one step, no error). Refused where the
        parameters are released; autograd runs such a backward with grad mode on, which a
        hook sees (the engine sets it from ``create_graph``)."""
        if not torch.is_grad_enabled():
            return
        released = [
            run.unit.label
            for run in self.runs
            if run.home.releases
            and run.unit.layout.segments
            and run.residency.backward_releases(self.schedule)
        ]
        if released:
            raise PhaseError(
                "offload: a backward with create_graph=True (torch.autograd.grad or "
                "backward with create_graph=True: a gradient penalty, a gradient of a "
                "gradient; the backward of torch.func.grad, vjp, jacrev or hessian, which "
                "builds its graph so) over units whose parameters offload releases after the "
                "backward "
                f"({', '.join(released[:3])}{', ...' if len(released) > 3 else ''}): the graph "
                "it builds would read released parameters. Keep the parameters on the "
                "device (offload_param.device: none, distributed.stage 1 or 2) to train "
                "with such a loss"
            )

    def _hook_outputs(self, run: UnitRun, output) -> None:
        """The pre-backward gather: fires when backward reaches ``run``'s outputs. The hooks
        hold their forward's :class:`_Graph` (a unit called outside the model is a forward of
        its own)."""
        outputs = [t for t in _tensors(output) if _grad_tensor(t)]
        if not outputs:
            return
        graph = self._forward_graph
        if graph is None:
            graph = _Graph()
            self._graphs.append(weakref.ref(graph))
        for t in outputs:
            t.register_hook(lambda g, r=run, held=graph: self._pre_backward(r))

    @_hook
    def _pre_backward(self, run: UnitRun) -> None:
        if self.phase.phase is not Phase.BACKWARD:
            self._begin_backward()
        elif run.backward_done and self._reached_again(run):
            run.again()
        if not run.backward_done:
            self.schedule.unit_backward_begins(run.unit)
            run.gather(Phase.BACKWARD.value)
            if not self._grad_free:
                run.residency.backward_begins(self.grads, run)

    def _reached_again(self, run: UnitRun) -> bool:
        """Whether the backward, reaching an output of ``run`` after the unit's gradients were
        final, goes through the unit again. Autograd sums every use of a parameter in one
        backward before its hook runs, so in the backward that made them final an output
        reached later passes an input through (``return h, x``): nothing of the unit runs.
        They were made final in another, then: the backward of a call of the unit under
        ``checkpoint(use_reentrant=True)``, nested in this one, which now reaches another
        call (``x = blk(x); x = checkpoint(blk, x, use_reentrant=True)``; a unit checkpointing
        its own body so, called twice). That call's backward reads the unit's parameters,
        which the first round's end released: it computed with zeros (the gradients of
        ``blk.a`` and of everything before the unit half torch's, with only a "read between
        uses" warning, until 2026-12-08), or its recomputation raised as a call of a layer
        outside its unit's forward. Where the gradients stay in ``p.grad`` the unit is
        gathered again and its rounds add up as in PyTorch; where offload took them
        (:meth:`_check_one_backward`) this is refused here, before anything reads the
        released parameters, when the unit's parameters are ahead in this backward, and
        otherwise at the recomputation of the unit's body (:meth:`_check_gathered`)."""
        if run.done_in == torch._C._current_graph_task_id():
            return False
        if not self.grads.owner.kept_after_step and self._params_ahead(run):
            self._check_one_backward(run)  # (raises)
        return self.grads.owner.kept_after_step

    @staticmethod
    def _params_ahead(run: UnitRun) -> bool | None:
        """Whether the backward running now accumulates a gradient of ``run``'s parameters,
        asked of autograd per parameter's accumulation node (private: ``will_run``); None
        inside ``autograd.grad``, where none accumulates and torch refuses the question. Asked
        outside the ``torch.func`` transforms (``outside_transforms``): inside one (the
        backward of ``torch.func.grad``) a parameter's edge was not found, and the backward
        raised an AttributeError in torch, at every placement (until 2026-12-08)."""
        with outside_transforms():
            for p in run.unit.trainable_params:
                if not p.requires_grad:  # frozen for now (_check_trainable): no edge
                    continue
                try:
                    if will_run(get_gradient_edge(p).node):
                        return True
                except RuntimeError:  # "... currently running autograd.grad()"
                    return None
        return False

    @staticmethod
    def _dense_only(run: UnitRun, param: torch.Tensor) -> str:
        """The error for a gradient that is not a dense tensor (``F.embedding(...,
        sparse=True)`` in a forward; a module with ``sparse=True`` is refused at wrap): it
        would reach the flat buffers' ``view`` and fail there, naming no parameter."""
        name = next(s.name for s in run.unit.layout.segments if s.param is param)
        return (
            f"offload: parameter '{name}' got a {param.grad.layout} gradient (a lookup with "
            "sparse=True, such as F.embedding(..., sparse=True)): offload's gradient buffers, "
            "clipping and Adam are dense, as torch's Adam and AdamW are. Look it up with "
            "sparse=False"
        )

    @_hook
    def _grad_ready(self, run: UnitRun) -> None:
        if self.phase.phase is not Phase.BACKWARD:
            self._begin_backward()  # a backward that reached no unit output first
        elif self._grad_free and not self._discarding:
            self._grads_after_all()
        self._check_one_backward(run)
        if run.grad_ready() and run.inputs_passed():
            self._countdown_done(run)

    def _countdown_done(self, run: UnitRun) -> None:
        try:
            run.residency.countdown_done(self, run)
        except BaseException:
            self._abort_backward()
            raise

    def _check_one_backward(self, run: UnitRun) -> None:
        """A unit's gradients come in one backward graph: autograd sums every use of a
        parameter before its hook runs. A unit called more than once, a call of it (or its
        body, checkpointed inside its forward) under ``torch.utils.checkpoint(use_reentrant=
        True)``, is the exception: each such recomputation runs a backward of its own, so the
        unit's gradients came in rounds, and an owner that takes them out of ``p.grad`` at
        the first round's end (a host buffer, NVMe) lost the rest without a word. Where they
        stay in ``p.grad`` the rounds add up as in PyTorch (:meth:`_reached_again`)."""
        if run.backward_done and not self.grads.owner.kept_after_step:
            self._abort_backward()
            raise RuntimeError(
                f"offload: unit {run.unit.label} is used again in a backward after its "
                "gradients were final and taken: it is called more than once in the forward, "
                "and a call of it (or its body) runs under torch.utils.checkpoint("
                "use_reentrant=True), whose recomputation runs a backward of its own. Use "
                "use_reentrant=False (torch's recommendation), or call the unit once per "
                "forward"
            )

    def _abort_backward(self) -> None:
        """This backward failed (in a hook of ours, its update failed, say; or anywhere:
        :meth:`_settle_backward`): back to between steps (its end-of-backward callback, if it
        still runs, does nothing). The gradients it left are incomplete: an update that ran
        speculatively in it is undone, and ``step()`` refuses them until ``zero_grad()``."""
        self._callback_queued = False
        self._forward_held = None
        self._grads_incomplete = True
        self.grads.backward_failed()
        try:
            self.schedule.flush_quietly()
            for run in self.runs:
                run.release()
            self.schedule.abandon_step()  # (the units released first: an undo rewrites them)
        finally:
            self.phase.phase = Phase.IDLE  # (a store, not a call: PhaseTracker's docstring)

    def _settle_backward(self) -> None:
        """A backward that failed outside offload's hooks (in the model, a hook of the user's,
        autograd itself, or stopped by Ctrl-C) never runs its end-of-backward callback (autograd
        drops it), which would leave the engine in BACKWARD for good: refusing ``step()``,
        checkpoints and the next backward. Outside every backward that phase can only be such a
        leftover, and it is aborted as a backward that failed in a hook of ours. Autograd's
        graph task id tells whether a backward runs on this thread (-1: none); it is private,
        and ``torch.utils.checkpoint`` reads it the same way: no public call says it."""
        if self.phase.phase is Phase.BACKWARD and torch._C._current_graph_task_id() == -1:
            self._abort_backward()

    def finish_unit_backward(self, run: UnitRun) -> None:
        """The unit's gradients are final: their owner takes them (now, or once their
        reduction across ranks lands) and the residency and the schedule say what happens to
        the unit (in that order, but where the update takes the unit's gradient pieces as
        they come: ``Schedule.takes_pieces``), then the schedule hears of the units whose
        gradients were taken."""
        run.done()
        if self._grad_free:  # (_reaches_trainable): nothing to take
            run.residency.backward_done(run, self.schedule)
            return
        if self.schedule.takes_pieces(run.unit):  # the update may rewrite its home meanwhile:
            # released first, the root too (its residency waits for the backward's end,
            # which is where the root is finished)
            self.schedule.unit_backward_done(run)
            self.grads.unit_done(run.unit)
        else:
            self.grads.unit_done(run.unit)
            run.residency.backward_done(run, self.schedule)
        self._hand_over()

    def _hand_over(self) -> None:
        for unit in self.grads.taken():
            self.schedule.grads_taken(unit)

    @_hook
    def _end_backward(self) -> None:
        if not self._callback_queued:
            return  # the backward was aborted (see _abort_backward)
        for run in reversed(self.runs):
            if not run.backward_done:
                self.finish_unit_backward(run)
        if not self._grad_free:
            self.grads.backward_done()  # the last reductions land
            self._hand_over()
        self.schedule.backward_ends(self.runs)
        self._callback_queued = False
        self.backwards_since_step += not self._grad_free
        self.backwards_ever += not self._grad_free
        self._stop_timer("_bwd_start", "backward_seconds")
        held, self._forward_held = self._forward_held, None
        if held is None:
            self.phase.to(Phase.IDLE)
            return
        # A backward inside the model's forward (torch.autograd.grad of an activation there,
        # which reaches no trainable parameter: _begin_step_backward refuses the others) ends
        # back in that forward, with what it had gathered gathered again (the root, the unit
        # whose forward called it): it released them, and went to IDLE, so the rest of the
        # forward raised at its next root layer "called outside the forward of its unit
        # <root>", and its units gathered again as a forward of their own (until 2026-12-08)
        self.phase.to(Phase.FORWARD, "the end of a backward inside the forward")
        for run in held:
            run.gather(Phase.FORWARD.value)
        self._fwd_start = time.perf_counter()

    def _stop_timer(self, attr: str, timer: str) -> None:
        start = getattr(self, attr)
        if start is not None:
            self.timers[timer] += time.perf_counter() - start
            setattr(self, attr, None)

    # ---------------------------------------------------------------- step
    def grad_norm_sq(self) -> tuple[bool, float]:
        """(any inf/NaN, sum of squares) of the accumulated gradients (still loss-scaled)."""
        self._settle_backward()
        self._check_unzeroed("optimizer.clip_grad_norm_() / grad_norm()")
        self.schedule.check_grad_norm()
        self.agreement.check(Call.NORM, self.step_count, self.backwards_since_step)
        return self.grads.stats()

    def check_idle(self, what: str, *, restoring: bool = False) -> None:
        """Raises unless between steps; then waits for a running update (state is read, or,
        ``restoring``, overwritten: then a failed update's mixed state may be replaced)."""
        self._check_phase(what, (Phase.IDLE,), restoring)

    def check_readable(self, what: str) -> None:
        """:meth:`check_idle` for a call that only reads the state (a checkpoint, an export,
        ``optimizer.state_dict()``): also allowed after a forward whose loss is still held
        (its backward may come), where nothing changes the state either."""
        self._check_phase(what, (Phase.IDLE, Phase.FORWARD), restoring=False)

    def _check_phase(self, what: str, phases: tuple[Phase, ...], restoring: bool) -> None:
        self._check_open()
        self._check_not_in_step(what)
        self._settle_backward()
        self._settle_forward()
        if self.phase.phase is Phase.FORWARD and self.phase.phase not in phases:
            self._refuse_in_forward(what)
        if self.phase.phase not in phases:
            raise PhaseError(
                f"offload: {what} called during {self.phase.phase.value}; call it between steps"
            )
        self.schedule.check_access(what, self.backwards_since_step)
        if restoring and self.backwards_since_step:  # they would be dropped, or summed with
            raise PhaseError(  # gradients of other values: neither is what the caller means
                f"offload: {what} called with the gradients of {self.backwards_since_step} "
                "backward(s) since the last step pending; call optimizer.step() or "
                "optimizer.zero_grad() first"
            )
        self.flush_pending()
        if not restoring:
            self._check_consistent(what)

    def _refuse_in_forward(self, what: str) -> None:
        """After :meth:`_settle_forward`, a forward still here may yet get its backward."""
        raise PhaseError(
            f"offload: {what} called during forward: the outputs of a forward with "
            "gradients on are still held (a loss not yet backwarded); call "
            "loss.backward() first, or let the loss go (del loss), or run such forwards "
            "under torch.no_grad()"
        )

    def _check_consistent(self, what: str) -> None:
        """Refuses ``what`` on a mixed state, a failed update's or a torn load's (one that
        stopped part way, :meth:`restoring`): a step, a save, and since 2026-12-07 a forward
        and a read of the values (``state_dict()``) too: an evaluation after a failed update
        computed with the mix, the update's error the only word of it."""
        failure = self.schedule.failure
        if failure is not None:
            raise PhaseError(
                f"offload: {what} refused: an earlier optimizer update failed part way "
                f"({failure}), so some units hold the new values and others the old ones; "
                "load a checkpoint (offload.load_checkpoint) or optimizer.load_state_dict() first"
            )
        if self._torn is not None and what != self._torn:  # (the same load may run again)
            raise PhaseError(
                f"offload: {what} refused: {self._torn} stopped part way (an error or a Ctrl-C "
                "after it had begun writing the units' state), so some units hold the loaded "
                "values and others their own; run that load again, whole, or load a checkpoint "
                "(offload.load_checkpoint) first"
            )

    def restoring(self, what: str) -> None:
        """``what`` (a load) begins writing the units' state: until :meth:`state_restored`
        says it ended, the state is a mix of the loaded values and the units' own, and a step
        or a save of it is refused (:meth:`_check_consistent`). A load that stopped part way
        (an error while writing, which it names; a Ctrl-C, which it cannot) left it so, and a
        notebook's next cell trained on the mix. Its forwards and ``state_dict()`` read the
        mix too (an evaluation's figures, a plain torch save of it), and are refused as well
        (until 2026-12-07 they ran)."""
        self._torn = what

    def state_restored(self) -> None:
        """Every unit's state was loaded (a checkpoint, ``load_state_dict``)."""
        self.schedule.state_restored()
        self._torn = None

    def _check_trains(self) -> None:
        """A model wrapped with no trainable parameter is wrapped for its forwards (an
        inference of a model beyond the device's memory, ZeRO-Inference's use; a frozen
        teacher beside a student): its homes hold the frozen values, and its optimizer has
        nothing to update. ``wrap`` refused such a model until 2026-12-05, naming PEFT's
        prompt tuning, whose trainable parameters are the PeftModel's own, outside the base
        model: wrapping the base model there trains nothing, so its first step says so."""
        if not self._trains:
            raise PhaseError(
                "offload: optimizer.step() on a model wrapped with no trainable parameters "
                "(all requires_grad=False at wrap): offload wrapped it for forwards (inference, "
                "a frozen teacher), and nothing of it trains. To train, set requires_grad "
                "before offload.wrap; PEFT's prompt and prefix tuning train parameters of the "
                "PeftModel itself (its prompt encoder), not of the model get_base_model() "
                "returns: wrap the PeftModel"
            )

    def _check_not_in_step(self, what: str) -> None:
        """A call made while :meth:`step` runs on this thread (only a signal handler, or a hook
        inside the step, can make one) is refused: the step count and the values disagree
        until the step ends (a save there wrote the new count with the old values)."""
        if self._in_step:
            raise PhaseError(
                f"offload: {what} called inside optimizer.step() (from a signal handler, or "
                "a hook that runs in it), where the step is half done; call it between steps: "
                "a signal handler can set a flag that the training loop checks"
            )

    def check_can_step(self) -> None:
        self._check_open()
        self._check_trains()
        self._check_not_in_step("optimizer.step()")
        self.watch.check_in_model("optimizer.step()")
        self._settle_backward()
        self._settle_forward()
        self._check_consistent("optimizer.step()")
        if self.phase.phase is Phase.FORWARD:
            self._refuse_in_forward("optimizer.step()")
        if self.phase.phase is not Phase.IDLE:
            raise PhaseError(
                f"offload: optimizer.step() called during {self.phase.phase.value}; "
                "call it after loss.backward() has returned"
            )
        self._check_unzeroed("optimizer.step()")
        if self._grads_incomplete:
            raise PhaseError(
                "offload: optimizer.step() after a backward that failed part way (an exception "
                "or Ctrl-C in it): its gradients are incomplete; call optimizer.zero_grad() and "
                "run the step's backwards again"
            )
        if self.backwards_ever == 0:
            hand = sum(p.grad is not None for u in self.units for p in u.trainable_params)
            raise PhaseError(
                "offload: optimizer.step() called before any backward reached this optimizer's "
                "model; call loss.backward() on the wrapped model's output first"
                + (
                    f" ({hand} trainable parameters have a p.grad set by hand, as "
                    "torch.autograd.grad(loss, params) and p.grad = g do: offload takes its "
                    "gradients from loss.backward() through the model and does not read those)"
                    if hand
                    else ""
                )
            )

    def _step_hyper(self, grad_scale: float | None = None) -> Hyper:
        """This step's hyperparameters as they are now; ``grad_scale`` (loss scale and clipping)
        defaults to the loss scale's unscaling alone (what a speculative update assumes: no
        clipping), and is multiplied by the mean over ranks (``offload.runtime.grads``' Note)."""
        groups, unscale = self._hyper()
        scale = unscale if grad_scale is None else grad_scale
        return Hyper(
            step=self.step_count + 1,
            groups=groups,
            grad_scale=scale * self.grads.mean_scale,
            runs_of=self.update_runs,
            counts=StepCounts(self.missed, self.grads.now_seen()),
        )

    def param_steps(self, param: nn.Parameter) -> int:
        """``param``'s own step count: the steps it got a gradient in (torch's per-parameter
        ``step``)."""
        return self.step_count - self.missed.get(param, 0)

    def set_param_steps(self, step_count: int, steps: dict[nn.Parameter, int]) -> None:
        """Restores the counts (a state dict, a checkpoint): ``step_count`` and each trainable
        parameter's own (``steps``; absent: ``step_count``)."""
        self.step_count = step_count
        self.missed = {p: step_count - n for p, n in steps.items() if n != step_count}

    @property
    def no_decay(self) -> frozenset:
        """The trainable parameters weight decay leaves alone."""
        return self.update_runs.no_decay

    def set_no_decay(self, params: frozenset, what: str) -> None:
        """From the next update on, weight decay leaves ``params`` alone. Between steps only: an
        update of the open step may have run already (in a backward) with the set before."""
        self.check_idle(what)
        if self.backwards_since_step:
            raise PhaseError(
                f"offload: {what} called with {self.backwards_since_step} backward(s) of a step "
                "pending (its update may have run in them); call it before the step's first "
                "backward or after optimizer.step()"
            )
        self.update_runs = self.update_runs.with_no_decay(params)

    def step(self, grad_scale: float, clipped: bool = False) -> None:
        """The update with the gradients times ``grad_scale`` (loss unscaling and clipping
        together; ``clipped``: clipping made it smaller, counted in telemetry)."""
        self.check_can_step()
        self._in_step = True  # until the update is launched: see _check_not_in_step
        try:
            self._step(grad_scale, clipped)
        finally:
            self._in_step = False

    def _step(self, grad_scale: float, clipped: bool) -> None:
        self.grads.settle()  # stage 1: the step's reduction
        hyper = self._step_hyper(grad_scale)
        self.timers["clipped_steps"] += clipped
        t0, waited = time.perf_counter(), self.timers["step_wait_seconds"]
        self.phase.to(Phase.STEP)
        try:
            with torch.profiler.record_function("offload::step"):
                for run in self.runs:
                    run.residency.at_step(run)  # a kept copy is stale after the update
                self.schedule.step(hyper)
                for store in self.stores.values():
                    store.end_iteration()
        finally:  # a store, not a call (PhaseTracker's docstring): a second Ctrl-C at to()'s
            # start, in the unwinding of a first one in the step, left the engine in the step
            # for good ("cannot go from step to forward": tests/_ctrl_c_points.py with AGAIN)
            self.phase.phase = Phase.IDLE
        self.step_count += 1
        self.missed = hyper.counts.advanced(p for u in self.units for p in u.trainable_params)
        # each version counter moved and noted together: a Ctrl-C between the two left a
        # version moved and not noted, which the next forward refused as a write of the
        # user's (tests/_ctrl_c_points.py, sampled, 2026-12-08)
        with interrupts_deferred():
            for run in self.runs:
                run.stepped(hyper.counts.seen)
        # the update's own time: a background update counts its time on its worker, and waiting
        # for it here is step_wait_seconds (counting it twice put more update than step in a
        # step whose update ran in its backward)
        waited = self.timers["step_wait_seconds"] - waited
        self.timers["optimizer_seconds"] += time.perf_counter() - t0 - waited
        self._end_step()
        for fresh in self._fresh:  # (before the launch: an update may end before the loop)
            fresh.on = False
        self.schedule.launch(hyper)

    def flush_pending(self) -> None:
        """Waits for a running update to finish; re-raises its error."""
        self.schedule.flush()

    def skip_step(self) -> None:
        """An fp16 overflow: no update; gradients are discarded."""
        self.check_can_step()
        self._in_step = True
        try:
            self.schedule.skip()
            for store in self.stores.values():
                store.end_iteration()
            self._end_step(skipped=True)
        finally:
            self._in_step = False

    def _end_step(self, skipped: bool = False) -> None:
        now = time.perf_counter()
        self.timers["step_seconds"] = now - self._step_started
        self._step_started = now
        self.backwards_since_step = 0
        self._zeroed = False
        self.grads.step_ended()
        self.params.end_iteration()
        self.telemetry.end_step(self.timers, self._counters(), self.step_count, skipped)
        self.timers.clear()

    def counted(self) -> list:
        """Everything that counts bytes moved between tiers: the stores and the host <-> device
        transfers."""
        return [*self.stores.values(), self.transfers]

    def _counters(self) -> list:
        """What telemetry reads: :meth:`counted` and the collectives."""
        return [*self.counted(), self.comm]

    def state_bytes(self) -> dict[str, int]:
        """Bytes of training state this rank holds, by where (``device``, ``host``, ``nvme``):
        compute params, fp32 master, fp32 gradients and moments, as their owners hold them
        (padding included; the swap pools and gradients in ``p.grad`` are not state)."""
        out = {"device": 0, "host": 0, "nvme": 0}
        for owner in (self.params, self.optim, self.grads.owner):
            for where, n in owner.held().items():
                out[where] += n
        return out

    def restart_step_counters(self) -> None:
        """Whatever ran since the last step (an evaluation, say) is not counted in the next one."""
        self.timers.clear()
        self._step_started = time.perf_counter()
        self.telemetry.rebase(self._counters())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients are dropped, and with them the backwards since the step (they no
        longer count toward it): an update that ran speculatively in the last one is undone,
        as no step was taken for it. ``set_to_none=False``: a ``p.grad`` that is set (where
        the gradients stay there) is zeroed in place instead, as torch's; gradients offload
        holds elsewhere have no ``p.grad`` and are dropped, their parameters moved by the next
        step as with a zero gradient even where its backwards give them none, as torch's
        zeroed ``p.grad`` is."""
        self._check_open()
        self._settle_backward()
        self.schedule.abandon_step()
        params = [p for u in self.units for p in u.trainable_params]
        kept = [(p, p.grad) for p in params if not set_to_none and p.grad is not None]
        self.grads.zero(set_to_none)
        for p, g in kept:
            if g.grad_fn is not None:
                g.detach_()
            else:
                g.requires_grad_(False)
            p.grad = g.zero_()
        self.backwards_since_step = 0
        self._grads_incomplete = False
        self._zeroed = True
        self._unzeroed = None
        self.clip_coef = None  # the clipping goes with the gradients it was computed for

    # ---------------------------------------------------------------- values
    def full_values(self, unit) -> dict[nn.Parameter, torch.Tensor]:
        """Current values of the unit's parameters as new host tensors: the fp32 master for
        trainable ones, the compute params for frozen ones."""
        self.flush_pending()
        return self.values.full(unit)

    def _state_dict_begins(self, module, prefix, keep_vars) -> None:
        self._model_state_dict = True

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        """The model's entries (under ``prefix`` when a module holding the model asks: a
        ``PeftModel`` around the wrapped transformers model, whose ``save_pretrained`` reads
        the adapters so; they read as the released storage's zeros before) get the values."""
        self._model_state_dict = False
        self.watch.check_in_model("model.state_dict()", pieces=True)
        self._check_consistent("model.state_dict()")
        self.schedule.check_access("model.state_dict()", self.backwards_since_step)  # (above)
        named = self.model.named_parameters(remove_duplicate=False)
        self._fill(state_dict, prefix, named, self.units)
        return state_dict

    def _part_values(self, module: nn.Module, state_dict: dict, prefix: str, runs) -> None:
        """``state_dict()`` of a module inside the model: its own parameters get their values
        (inside the model's own ``state_dict()`` call, that call's hook fills them all)."""
        if self._model_state_dict:
            return
        self._check_consistent("state_dict()")
        self.schedule.check_access("state_dict()", self.backwards_since_step)
        self._fill(state_dict, prefix, module._parameters.items(), [r.unit for r in runs])

    def _fill(self, state_dict: dict, prefix: str, named, units) -> None:
        """The entries ``prefix + name`` of ``named`` parameters get their current values
        (each of ``units`` read once), in the parameters' dtype before wrap."""
        values: dict[nn.Parameter, torch.Tensor] = {}
        for unit in units:
            values.update(self.full_values(unit))
        for name, p in named:
            if p in values and prefix + name in state_dict:
                state_dict[prefix + name] = values[p].to(self.orig_dtype.get(p, values[p].dtype))

    def _load_values(
        self, module, state_dict, prefix, metadata, strict, missing, unexpected, errors
    ):
        """``model.load_state_dict``: the parameters' values go into their homes (the fp32
        master of trainable ones, which derives the compute params; frozen values), as
        ``optimizer.load_state_dict`` writes them; torch would copy them into the parameters'
        storage, which is released between uses or derived from the master, and the next
        step would start from the old master. Their keys are taken out of the dict (torch
        loads the buffers) and out of its missing keys (:meth:`_loaded_values`). The moments
        stay, as torch's load leaves the optimizer alone. A key whose shape differs is
        reported in torch's words, and then, or when a key is missing from a strict load of
        the model itself (``load_strict``, :class:`~offload.runtime.overrides.ModelOverrides`), no parameter is changed
        (torch's load would have changed the others). The hook's own ``strict`` is always True
        (torch's), so a partial ``strict=False`` load loaded nothing, silently (PEFT's
        ``load_adapter`` and the Trainer's ``load_best_model_at_end`` load so). It is the
        hook of every module holding parameters: a part's own load (``model.blocks[0].
        load_state_dict``) went into released storage; where an enclosing module's load took
        the part's keys first, the part's finds none of them."""
        if missing is not self._load_missing:  # a new load (one list for all its hooks)
            self._load_missing, self._loaded_keys = missing, set()
        names = list(module.named_parameters(remove_duplicate=False))
        if not any(prefix + name in state_dict for name, _ in names):
            return  # (a module whose enclosing module's load took its keys, or a buffers' load)
        self.check_idle("model.load_state_dict()")
        segments = {s.param: s for u in self.units for s in u.layout.segments}
        given: dict[nn.Parameter, torch.Tensor] = {}
        for name, p in names:
            key = prefix + name
            if key not in state_dict or p not in segments:
                continue
            value, shape = state_dict.pop(key), segments[p].shape
            self._loaded_keys.add(key)
            if not isinstance(value, torch.Tensor):
                errors.append(
                    f'While copying the parameter named "{key}", expected torch.Tensor or '
                    f"Tensor-like object from checkpoint but received {type(value)}"
                )
            elif value.shape != shape:
                errors.append(
                    f"size mismatch for {key}: copying a param with shape {value.shape} from "
                    f"checkpoint, the shape in current model is {shape}."
                )
            else:
                given[p] = value.detach()
        if self.load_strict and module is self.model:  # torch raises for a missing key
            absent = [  # after loading the others
                prefix + n
                for n, p in self.model.named_parameters()
                if p in segments and p not in given
            ]
            if absent:
                return  # (torch's load goes on and raises "Missing key(s)")
        if errors or not given:
            return
        source = GivenValues(given, self.values.flat, self.params.dtype)
        # (check_idle refused any other load's mix: the parameters are whole again at the end)
        self.restoring("model.load_state_dict()")
        for run in self.runs:
            self.values.load(run.unit, source)
            if any(s.trainable and s.param in given for s in run.unit.layout.segments):
                self.params.loaded(run.unit)  # (on every rank: its share may hold none)
            run.release()  # a gathered copy would be stale
        self._torn = None

    def _loaded_values(self, module, incompatible) -> None:
        self.watch.forget_writes()  # (a write before the load is what the load replaced)
        incompatible.missing_keys[:] = [
            k for k in incompatible.missing_keys if k not in self._loaded_keys
        ]

    def _differ_from_master(self, run: UnitRun, names: list[str]) -> list[str]:
        """Those of ``names`` (parameters of ``run``'s unit, which stays on the device with
        its master apart) that are trainable and hold other values than their master's in
        the compute dtype, what the next update would write over them (NaN as NaN)."""
        self.flush_pending()  # (the update's writes have landed)
        wanted = set(names)
        full = self.values.full(run.unit)
        differ = []
        for s in run.unit.layout.segments:
            if s.trainable and s.name in wanted:
                now = s.param.data
                derived = full[s.param].to(device=now.device, dtype=now.dtype)
                if not bool(((now == derived) | (now.isnan() & derived.isnan())).all()):
                    differ.append(s.name)
        return differ

    def _derive_again(self, runs: list[UnitRun]) -> None:
        """The trainable parameters of ``runs``, written through the tensor, get the values
        derived from their master again (offload's values, as a released unit's next gather
        gives them)."""
        self.flush_pending()
        for run in runs:
            full = self.values.full(run.unit)
            given = {s.param: full[s.param] for s in run.unit.layout.segments if s.trainable}
            self.values.load(run.unit, GivenValues(given, self.values.flat, self.params.dtype))
            self.params.loaded(run.unit)

    # ---------------------------------------------------------------- lifecycle
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                "offload: this model's engine was closed (optimizer.close()): its optimizer, "
                "and a loss computed before the close, cannot be used any more. "
                + self._closed_advice()
            )

    def _closed_advice(self) -> str:
        if not self.released:
            return "Wrap the model again to train it"
        return (
            "Its parameters were released (close() without restore): their values are gone. "
            "Wrap it again with weights= (what offload.export or save_pretrained wrote), or "
            "close with optimizer.close(restore=True) to keep using it"
        )

    def close(self, restore: bool = False) -> None:
        """Removes the hooks and frees pools and swap files. With ``restore`` every parameter
        first gets its current value back (original dtype, on the device), so the model goes
        on as a plain PyTorch model; without, using the model afterwards is an error. A close
        stopped part way (a Ctrl-C while it waits for the last update) is finished by the next
        call: the teardown's steps left are kept (their swap files and pools stayed until the
        process ended, in a notebook its whole session)."""
        if self.closed:
            self._tear_down()
            return
        if restore:
            self.check_idle("close(restore=True)")
            for run in self.runs:
                values = self.full_values(run.unit)
                run.release()
                for p, v in values.items():
                    p.data = v.to(self.device, self.orig_dtype.get(p, v.dtype))
            for (m, name), dt in self.buffer_dtypes.items():
                if m._buffers.get(name) is not None:
                    m._buffers[name] = m._buffers[name].to(dt)
        # Teardown goes on past errors: every pool, swap file and thread is released. IO errors
        # (already raised to the caller when they happened) are logged; any other is raised.
        steps = [self.remove_hooks]
        if not restore:  # a forward or a state dict would read the released storage: zeros
            steps.append(self._refuse_after_close)
        steps += [self.flush_pending, self.params.close, self.optim.close, self.grads.owner.close]
        steps += [res.close for res in reversed(self.resources)]  # stores before their pools
        steps.append(self.comm.close)  # the process group, last: closing may still gather
        self._teardown = steps  # (before closed: a close stopped before it starts again)
        self.closed = True
        # the parameters' values went with the engine (where it released them)
        self.released = not restore and any(run.home.releases for run in self.runs)
        self._tear_down()

    def _refuse_after_close(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._closed_hook))
        for module in (self.model, *self._parts):
            self._handles.append(module._register_state_dict_hook(self._closed_hook))

    def _tear_down(self) -> None:
        """Runs the close's steps left, each taken off once it ran (a Ctrl-C inside one leaves
        it for the next close: each is idempotent)."""
        first: BaseException | None = None
        while self._teardown:
            step = self._teardown[0]
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - logged, the rest still closes
                logger.warning("offload: error while closing (%s); continuing teardown", exc)
                first = first or exc
            if self._teardown and self._teardown[0] is step:  # (a close inside it ran it too)
                del self._teardown[0]
        if first is not None and not isinstance(first, OSError | RuntimeError):
            raise first

    def _closed_hook(self, module, *args):
        raise RuntimeError(
            "offload: this model's engine was closed (optimizer.close()). " + self._closed_advice()
        )

    def forget(self) -> None:
        """The closed engine lets its model go: a new ``wrap`` of it (with its values given
        again) takes over, so the hooks that refuse the released storage go."""
        self.remove_hooks()


def _grad_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _tensors(output) -> list:
    """The leaves of a forward's output: torch's pytree (tuples, lists, dicts, HF's
    ``ModelOutput``, which registers itself) and, inside it, the attributes of other objects,
    which the pytree takes as one leaf each (as DDP's output search does not). A unit
    returning a dataclass, a ``SimpleNamespace`` or a class of the user's own (``Out(h)``)
    got no pre-backward hook, and a model returning one was taken for an inference: the
    backward ran on released parameters (7e-2 off torch after two steps for a dataclass,
    5.9e-2 after three for a plain object; only the "read between uses" warning). Only
    while gradients are on (an object's attributes are walked then alone: nothing needs a
    hook in an inference), each object once, modules, types and functions not entered."""
    out: list = []
    _leaves(output, out, set() if torch.is_grad_enabled() else None)
    return out


def _leaves(output, out: list, seen: set | None) -> None:
    for leaf in tree_flatten(output)[0]:
        if seen is None or isinstance(leaf, (torch.Tensor, _NOT_ENTERED)) or id(leaf) in seen:
            out.append(leaf)
            continue
        seen.add(id(leaf))
        if dataclasses.is_dataclass(leaf):
            _leaves([getattr(leaf, f.name) for f in dataclasses.fields(leaf)], out, seen)
            continue
        fields = list(getattr(leaf, "__dict__", {}).values())
        for cls in type(leaf).__mro__:  # (a class with __slots__ has no __dict__ for them)
            for name in getattr(cls, "__slots__", ()):
                if isinstance(name, str) and hasattr(leaf, name) and not name.startswith("__"):
                    fields.append(getattr(leaf, name))
        if fields:
            _leaves(fields, out, seen)
        else:
            out.append(leaf)


# leaves whose attributes are not an output's: scalars, strings, and what a forward may return
# beside its tensors without holding them as results (a module, a class, a function)
_NOT_ENTERED = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type,
    nn.Module,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.ModuleType,
    torch.dtype,
    torch.device,
    torch.Size,
)


def _requires_grad(output) -> bool:
    return any(_grad_tensor(t) for t in _tensors(output))


class _Graph:
    """Held by the hooks on the outputs of one forward's units, which the autograd graph
    holds: it dies with the last of them, when nothing can run a backward through that
    forward any more (the caller let its loss and outputs go). One that no hook holds (a
    leaf output) lives on."""

    __slots__ = ("__weakref__",)
