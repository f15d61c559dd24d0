"""The engine: one record per wrapped model that owns its units, the placement strategies, the
hooks and the counters. ``offload.wrap`` builds it; the optimizer and checkpoints drive it.

Note: the hooks (what FSDP2 does, in words)
    - root forward pre-hook: casts floating inputs to the compute dtype and gathers the root unit
      (parameters outside every unit, and tied ones); the root stays gathered until the end of
      backward.
    - unit forward pre-hook: gathers the unit (its pieces were prefetched while the previous unit
      ran); unit forward post-hook: releases it (unless persistent) and registers a hook on each
      output tensor that requires grad; that hook fires when backward reaches the unit and
      gathers it again (the pre-backward gather).
    - a post-accumulate-grad hook on every trainable parameter counts down the unit's pending
      grads; at zero the unit's gradients are streamed off the device and its params released.
    - one callback queued on the autograd engine at the first pre-backward hook finishes every
      unit that did not complete (unused params, frozen units, the root) and returns to IDLE.
    - during backward a forward hook means activation-checkpoint recomputation: gather, keep.

Note: the background NVMe step
    With the optimizer state on NVMe the step is disk-bound (read master, moments and grads,
    write them and the new params back); run as a phase of its own it overlaps no compute. So
    ``optimizer.step()`` fixes the update (hyperparameters, loss scale and clipping coefficient
    are all known then) and hands it to one background thread, which updates the units in
    forward order; the next forward waits, at each unit's pre-hook, only for that unit's update
    (its new params are then still in the store's cache). The disk work of the step overlaps
    the next forward. The math, and its order within a unit, are those of an immediate step.
    Anything else that reads or writes state first waits for the whole update
    (:meth:`Engine.flush_pending`): a backward, checkpoints, ``state_dict``, export, a new
    ``step()``, ``close``. The store, the IO engine and the native pool are safe to call from
    both threads; the worker touches no parameter storage.

Note: the step in backward (``offload_optimizer.step_in_backward``)
    The background step above still leaves the disk idle in the backward, and it writes every
    gradient to disk and reads it back. With step_in_backward the worker starts with the
    backward: each unit is handed to it as its gradients are final (persistent ones released
    then, the root at the end of backward, when everything not yet updated is reordered to
    forward order), its grad pieces still in their buffers, and consumed there: the gradient
    bytes never touch the disk. A backward that raises leaves the units already handed in
    updated (teardown is fine; going on training after catching it is not). The hyperparameters are those in ``param_groups`` when the backward
    starts (an LR scheduler stepped after ``optimizer.step()`` gives the same values), and
    ``optimizer.step()`` only checks them and closes the step. So each backward must be
    followed by ``step()`` (no gradient accumulation), and nothing may need every gradient
    before the update: no clipping, no fp16 overflow check (refused by the config).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map

from offload.engine.background import BackgroundStep
from offload.engine.optstate import GradParts, Hyper, OptimState, UnitFeed
from offload.engine.params import ParamHome
from offload.engine.phase import Phase, PhaseError, PhaseTracker
from offload.engine.telemetry import Telemetry
from offload.engine.transfer import Transfers
from offload.engine.units import Unit

logger = logging.getLogger("offload.engine")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Engine:
    def __init__(
        self,
        model: nn.Module,
        units: list[Unit],
        *,
        device: torch.device,
        dtype: torch.dtype,
        params: ParamHome,
        optim: OptimState,
        transfers: Transfers,
        stores: dict,
        pin: bool,
    ) -> None:
        self.model = model
        self.units = units  # units[0] is the root
        self.device, self.dtype = device, dtype
        self.params, self.optim, self.transfers = params, optim, transfers
        self.stores = stores  # name -> TieredStore (for stats and close)
        self.phase = PhaseTracker()
        self.owner: dict[nn.Parameter, Unit] = {}
        for unit in units:
            for seg in unit.layout.segments:
                self.owner[seg.param] = unit
        self.step_count = 0  # optimizer steps taken (not counting skipped ones)
        self.backwards_since_step = 0
        self.first_micro_step = True  # next grad sink overwrites instead of adding
        self._callback_queued = False
        self._handles: list = []
        max_train = max((u.layout.trainable for u in units), default=0)
        self._grad_staging = self._dev_staging = None  # CUDA only: see _grad_parts
        if transfers.is_cuda:
            self._grad_staging = transfers.host_empty(max(max_train, 1), dtype, pin)
            self._dev_staging = torch.empty(max(max_train, 1), dtype=dtype, device=device)
        self.timers: dict[str, float] = defaultdict(float)  # seconds, current step
        self.telemetry = Telemetry()  # replaced by wrap when telemetry.jsonl_path is set
        self._step_started = time.perf_counter()
        self._fwd_start: float | None = None
        self._bwd_start: float | None = None
        self.closed = False
        self.orig_dtype: dict[nn.Parameter, torch.dtype] = {}  # set by wrap
        self.background = BackgroundStep(self.timers)  # the update's thread (see the Notes)
        self.resources: list = []  # pools, NVMe stores, IO engine (set by wrap; closed last)
        # step_in_backward (see the Note): the optimizer's hyperparameters now, the units
        # handed in and the hyperparameters the running step uses
        self.hyper_source: Callable[[], dict] | None = None  # set by OffloadOptimizer
        self._fed: set[int] = set()
        self._feed_hyper: dict | None = None
        self.buffer_dtypes: dict = {}  # (module, name) -> dtype before wrap (set by wrap)

    # ---------------------------------------------------------------- hooks
    def install_hooks(self) -> None:
        h = self.model.register_forward_pre_hook(
            self._root_pre_forward, with_kwargs=True, prepend=True
        )
        self._handles.append(h)
        self._handles.append(self.model.register_forward_hook(self._root_post_forward))
        for unit in self.units[1:]:
            unit.hook_handles.append(
                unit.module.register_forward_pre_hook(lambda m, a, u=unit: self._pre_forward(u))
            )
            unit.hook_handles.append(
                unit.module.register_forward_hook(lambda m, a, o, u=unit: self._post_forward(u, o))
            )
        for unit in self.units:
            for p in unit.trainable_params:
                unit.hook_handles.append(
                    p.register_post_accumulate_grad_hook(lambda p, u=unit: self._grad_ready(u))
                )
        self._handles.append(self.model._register_state_dict_hook(self._state_dict_hook))

    def remove_hooks(self) -> None:
        for unit in self.units:
            for h in unit.hook_handles:
                h.remove()
            unit.hook_handles.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _cast_input(self, x):
        if isinstance(x, torch.Tensor):
            if x.is_floating_point() and x.dtype != self.dtype:
                x = x.to(self.dtype)
            if x.device != self.device:
                x = x.to(self.device)
        return x

    def _root_pre_forward(self, module, args, kwargs):
        self._check_open()
        if self.phase.phase is Phase.BACKWARD:
            return None  # recomputation of the whole model (unusual) keeps everything gathered
        if self.phase.phase is Phase.IDLE:
            self._begin_micro_step()
        self.phase.to(Phase.FORWARD)
        self._wait_unit(self.units[0])
        self._gather(self.units[0])
        return tree_map(self._cast_input, args), tree_map(self._cast_input, kwargs)

    def _root_post_forward(self, module, args, output):
        if self.phase.phase is not Phase.FORWARD:
            return output
        if self._fwd_start is not None:
            self.timers["forward_seconds"] += time.perf_counter() - self._fwd_start
            self._fwd_start = None
        if not (torch.is_grad_enabled() and _requires_grad(output)):
            # inference: nothing will come back through backward
            for unit in self.units:
                if not unit.persistent:
                    self._release(unit)
            self.phase.to(Phase.IDLE)
        else:
            self._hook_outputs(self.units[0], output)
        return output

    def _begin_micro_step(self) -> None:
        self._fwd_start = time.perf_counter()
        if self.backwards_since_step == 0:  # the optimizer store's trace starts at backward
            for name, store in self.stores.items():
                if name != "offload_optimizer":
                    store.begin_iteration()

    def _pre_forward(self, unit: Unit) -> None:
        if self.phase.phase is Phase.IDLE:  # a unit called directly, outside the model
            self._begin_micro_step()
            self.phase.to(Phase.FORWARD)
        self._wait_unit(unit)
        self._gather(unit)

    def _post_forward(self, unit: Unit, output):
        if self.phase.phase is Phase.BACKWARD:
            return output  # activation-checkpoint recomputation: keep gathered for its backward
        if torch.is_grad_enabled():
            self._hook_outputs(unit, output)
        if not unit.persistent:
            self._release(unit)
        return output

    def _begin_backward(self) -> None:
        """A backward starts (from a forward, or again over a retained graph): every unit's
        grads are pending, the root is gathered, one end-of-backward callback is queued."""
        if self._fwd_start is not None:
            self.timers["forward_seconds"] += time.perf_counter() - self._fwd_start
            self._fwd_start = None
        self.flush_pending()  # the grad sinks below write the shards the update reads
        if self.optim.in_backward:
            self._start_step_in_backward()
        if self.backwards_since_step == 0 and "offload_optimizer" in self.stores:
            self.stores["offload_optimizer"].begin_iteration()  # its user is idle now
        self.phase.to(Phase.BACKWARD)
        self._bwd_start = time.perf_counter()
        for unit in self.units:
            unit.grads_pending = len(unit.trainable_params)
            unit.backward_done = False
        self._gather(self.units[0])
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _hook_outputs(self, unit: Unit, output) -> None:
        """The pre-backward gather: fires when backward reaches ``unit``'s outputs."""
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, u=unit: self._pre_backward(u))

    def _pre_backward(self, unit: Unit) -> None:
        if self.phase.phase is not Phase.BACKWARD:
            self._begin_backward()
        if not unit.backward_done:
            self._gather(unit)

    def _grad_ready(self, unit: Unit) -> None:
        if self.phase.phase is not Phase.BACKWARD:
            self._begin_backward()  # a backward that reached no unit output first
        unit.grads_pending -= 1
        if unit.grads_pending == 0 and not unit.is_root:
            self._finish_unit_backward(unit)

    def _end_backward(self) -> None:
        feed = self.background.feed
        for unit in reversed(self.units):
            if not unit.backward_done:
                self._finish_unit_backward(unit)
        for unit in self.units:
            if not unit.persistent or feed is not None:
                self._release(unit)  # a persistent root too when its update starts now
        if feed is not None:
            self.params.quiesce()  # host homes are about to be rewritten
            for unit in self.units:
                if unit.index not in self._fed and self.optim.pieces(unit):
                    feed.put(unit)
            feed.close(reorder=lambda u: u.index)  # the rest in the next forward's order
            self.background.feed = None
        self._callback_queued = False
        self.backwards_since_step += 1
        self.first_micro_step = False
        if self._bwd_start is not None:
            self.timers["backward_seconds"] += time.perf_counter() - self._bwd_start
            self._bwd_start = None
        self.phase.to(Phase.IDLE)

    # ---------------------------------------------------------------- movement
    def _gather(self, unit: Unit) -> None:
        if unit.gathered:
            return
        t0 = time.perf_counter()
        self.params.gather(unit)
        waited = time.perf_counter() - t0
        self.timers["io_wait_seconds"] += waited  # part of the phase it happens in
        self.timers[f"{self.phase.phase.value}_io_wait_seconds"] += waited

    def _release(self, unit: Unit) -> None:
        self.params.release(unit)

    def _finish_unit_backward(self, unit: Unit) -> None:
        """Streams the unit's gradients off the device and releases its params; with
        step_in_backward, hands the unit to the step (see the Note)."""
        unit.backward_done = True
        if unit.layout.trainable and not self.optim.keeps_grads:
            self.optim.sink_grads(unit, self._grad_parts(unit), first=self.first_micro_step)
            for p in unit.trainable_params:
                p.grad = None
        if unit.is_root:
            pass  # its grads are final only at the end of backward: see _end_backward
        elif self.background.feed is not None:  # persistent too: its copy is stale from now on
            self._release(unit)
            if self.optim.pieces(unit):
                self.params.quiesce()  # host homes are about to be rewritten
                self.background.feed.put(unit)
                self._fed.add(unit.index)
        elif not unit.persistent:
            self._release(unit)
        if self.background.failed:
            self.flush_pending()

    def _grad_parts(self, unit: Unit) -> GradParts:
        """The unit's gradients on the host. On the CPU they are read in place; on CUDA they are
        flattened into a device staging buffer and copied to the host in one transfer."""
        n = unit.layout.trainable
        parts: list = []
        prev_end = 0
        for seg in unit.layout.segments:
            if not seg.trainable:
                continue
            if seg.offset > prev_end:
                parts.append((prev_end, seg.offset, None))
            g = seg.param.grad
            parts.append((seg.offset, seg.end, None if g is None else g.reshape(-1)))
            prev_end = seg.end
        if prev_end < n:
            parts.append((prev_end, n, None))
        if self._dev_staging is None:
            return GradParts(parts)
        flat = self._dev_staging[:n]
        for a, b, g in parts:
            if g is None:
                flat[a:b].zero_()
            else:
                flat[a:b].copy_(g)
        host = self._grad_staging[:n]
        self.transfers.to_host(host, flat).wait()
        return GradParts.of_flat(host)

    # ---------------------------------------------------------------- step
    def grad_norm_sq(self) -> tuple[bool, float]:
        """(any inf/NaN, sum of squares) of the accumulated gradients (still loss-scaled)."""
        if self.optim.in_backward:
            raise PhaseError(
                "offload: the gradient norm is not available with "
                "offload_optimizer.step_in_backward: each unit's gradients are consumed by its "
                "update as the backward produces them (set it false to clip gradients)"
            )
        if self.optim.keeps_grads:
            grads = [p.grad for u in self.units for p in u.trainable_params if p.grad is not None]
            if not grads:
                return False, 0.0
            norms = torch._foreach_norm(grads, 2.0)
            ss = float(sum(float(n.double() ** 2) for n in norms))
            return not torch.isfinite(torch.tensor(ss)).item(), ss
        return self.optim.grad_stats()

    def check_idle(self, what: str) -> None:
        """Raises unless between steps; then waits for a background update (state is read)."""
        self._check_open()
        if self.phase.phase is not Phase.IDLE:
            raise PhaseError(
                f"offload: {what} called during {self.phase.phase.value}; call it between steps"
            )
        if self.optim.in_backward and self.backwards_since_step:
            raise PhaseError(
                f"offload: {what} called between loss.backward() and optimizer.step(); with "
                "offload_optimizer.step_in_backward the update is already running, so call it "
                "after optimizer.step()"
            )
        self.flush_pending()

    def check_can_step(self) -> None:
        self._check_open()
        if self.phase.phase is not Phase.IDLE:
            raise PhaseError(
                f"offload: optimizer.step() called during {self.phase.phase.value}; "
                "call it after loss.backward() has returned"
            )
        if self.backwards_since_step == 0:
            raise PhaseError(
                "offload: optimizer.step() called with no backward since the last step; "
                "call loss.backward() first (gradients would be missing or stale)"
            )

    def step(self, hyper_base: dict, grad_scale: float) -> None:
        self.check_can_step()
        if self.optim.in_backward:
            self._close_step_in_backward(hyper_base, grad_scale)
            return
        t0 = time.perf_counter()
        self.phase.to(Phase.STEP)
        try:
            self.params.quiesce()  # host homes are about to be rewritten
            self.flush_pending()
            hyper = Hyper(step=self.step_count + 1, grad_scale=grad_scale, **hyper_base)
            for unit in self.units:
                if unit.persistent:
                    self._release(unit)  # its device copy is stale now; gathered fresh next use
            if not self.optim.defers:
                self.optim.step_units(self.units, self.params, hyper)
            for store in self.stores.values():
                store.end_iteration()
        finally:
            self.phase.to(Phase.IDLE)
        self.step_count += 1
        self.timers["optimizer_seconds"] += time.perf_counter() - t0
        # the step's record is closed before a background update starts, so what that update
        # moves is counted in the next step's record whatever the threads' timing
        self._end_step()
        if self.optim.defers:  # units in forward order (see the Note)
            self.background.start(self.optim, self.params, self.units, hyper)

    def _start_step_in_backward(self) -> None:
        """A backward starts with step_in_backward: the worker starts, fed unit by unit."""
        if self.backwards_since_step:
            for unit in self.units:  # back to between steps: step() can still close the first
                if not unit.persistent:
                    self._release(unit)
            self.phase.to(Phase.IDLE)
            raise PhaseError(
                "offload: a second backward before optimizer.step(); with "
                "offload_optimizer.step_in_backward the first one already updated the weights, so "
                "gradient accumulation is not possible (call step() after every backward, or set "
                "it false)"
            )
        if self.hyper_source is None:
            raise PhaseError("offload: step_in_backward needs the optimizer from offload.wrap")
        self._feed_hyper = self.hyper_source()
        hyper = Hyper(step=self.step_count + 1, grad_scale=1.0, **self._feed_hyper)
        self._fed = set()
        self.background.start(self.optim, self.params, self.units, hyper, UnitFeed())

    def _close_step_in_backward(self, hyper_base: dict, grad_scale: float) -> None:
        """``optimizer.step()`` with step_in_backward: the update is running already."""
        used, self._feed_hyper = self._feed_hyper, None
        for store in self.stores.values():
            store.end_iteration()
        self.step_count += 1
        self._end_step()
        changed = {k: (used[k], v) for k, v in hyper_base.items() if used and used[k] != v}
        if changed or grad_scale != 1.0:
            what = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
            raise PhaseError(
                "offload: with offload_optimizer.step_in_backward this step used the values "
                "param_groups held when loss.backward() started, but they changed before "
                f"optimizer.step() ({what or f'gradient scale {grad_scale!r}'}); change them "
                "before the backward (an LR scheduler stepped after optimizer.step() does)"
            )

    def _wait_unit(self, unit: Unit) -> None:
        """Blocks until ``unit``'s background update (if any) is complete. Not in a backward's
        recomputation: a step in backward updates a unit only after its backward."""
        if self.phase.phase is not Phase.BACKWARD:
            self.background.wait_unit(unit)

    def flush_pending(self) -> None:
        """Waits for the background update to finish; re-raises its error."""
        self.background.join()

    def skip_step(self) -> None:
        """An fp16 overflow: no update; gradients are discarded."""
        for store in self.stores.values():
            store.end_iteration()
        self._end_step(skipped=True)

    def _end_step(self, skipped: bool = False) -> None:
        now = time.perf_counter()
        self.timers["step_seconds"] = now - self._step_started
        self._step_started = now
        self.backwards_since_step = 0
        self.first_micro_step = True
        self.telemetry.end_step(self.timers, self.stores, self.step_count, skipped)
        self.timers.clear()

    def restart_step_counters(self) -> None:
        """Whatever ran since the last step (an evaluation, say) is not counted in the next one."""
        self.timers.clear()
        self._step_started = time.perf_counter()
        self.telemetry.rebase(self.stores)

    def zero_grad(self) -> None:
        self.first_micro_step = True
        for unit in self.units:
            for p in unit.trainable_params:
                p.grad = None

    # ---------------------------------------------------------------- values
    def full_values(self, unit: Unit) -> dict[nn.Parameter, torch.Tensor]:
        """Current values of the unit's parameters as new host tensors: the fp32 master for
        trainable ones, the compute params for frozen ones."""
        self.flush_pending()
        out: dict[nn.Parameter, torch.Tensor] = {}
        layout = unit.layout
        for seg in layout.segments:
            out[seg.param] = torch.empty(
                seg.numel, dtype=torch.float32 if seg.trainable else self.dtype
            )
        for lo, hi in self.optim.pieces(unit):
            master = self.optim.read(unit, "master", lo, hi)
            for seg, a, b in layout.overlaps(lo, hi, trainable_only=True):
                out[seg.param][a:b].copy_(master[seg.offset + a - lo : seg.offset + b - lo])
        frozen = [s for s in layout.segments if not s.trainable]
        if frozen:
            lo, hi = layout.trainable, layout.total
            for plo, phi in self.compute_pieces(unit, lo, hi):
                vals = self.params.read(unit, plo, phi)
                for seg, a, b in layout.overlaps(plo, phi):
                    if not seg.trainable:
                        out[seg.param][a:b].copy_(vals[seg.offset + a - plo : seg.offset + b - plo])
        return {p: t.view(p.shape) for p, t in out.items()}

    def compute_pieces(self, unit: Unit, lo: int, hi: int) -> list[tuple[int, int]]:
        return self.params.pieces_in(unit, lo, hi)

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        if prefix:  # only the root's own call sees the whole dict
            return state_dict
        names = dict(self.model.named_parameters(remove_duplicate=False))
        values: dict[nn.Parameter, torch.Tensor] = {}
        for unit in self.units:
            values.update(self.full_values(unit))
        for name, p in names.items():
            if name in state_dict and p in values:
                state_dict[name] = values[p].to(self.orig_dtype.get(p, values[p].dtype))
        return state_dict

    # ---------------------------------------------------------------- lifecycle
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("offload: this model's engine was closed; wrap the model again")

    def close(self, restore: bool = False) -> None:
        """Removes the hooks and frees pools and swap files. With ``restore`` every parameter
        first gets its current value back (original dtype, on the device), so the model goes
        on as a plain PyTorch model; without, using the model afterwards is an error."""
        if self.closed:
            return
        if restore:
            self.check_idle("close(restore=True)")
            for unit in self.units:
                values = self.full_values(unit)
                self.params.release(unit)
                for p, v in values.items():
                    p.data = v.to(self.device, self.orig_dtype.get(p, v.dtype))
            for (m, name), dt in self.buffer_dtypes.items():
                if m._buffers.get(name) is not None:
                    m._buffers[name] = m._buffers[name].to(dt)
        self.closed = True
        self.remove_hooks()
        if not restore:
            self._handles.append(self.model.register_forward_pre_hook(self._closed_hook))
        # Teardown goes on past errors: every pool, swap file and thread is released. IO errors
        # (already raised to the caller when they happened) are logged; any other is raised.
        first: BaseException | None = None
        steps = [self.flush_pending, self.params.close, self.optim.close]
        steps += [store.close for store in self.stores.values()]
        steps += [res.close for res in reversed(self.resources)]
        for close in steps:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - logged, the rest still closes
                logger.warning("offload: error while closing (%s); continuing teardown", exc)
                first = first or exc
        if first is not None and not isinstance(first, OSError | RuntimeError):
            raise first

    @staticmethod
    def _closed_hook(module, args):
        raise RuntimeError(
            "offload: this model's engine was closed (optimizer.close()); its parameters were "
            "released. Wrap it again, or close with optimizer.close(restore=True) to keep using it"
        )


def _requires_grad(output) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(output)[0])


__all__ = ["DTYPES", "Engine"]
