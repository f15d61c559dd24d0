"""When the optimizer update runs: one schedule object per wrapped model, chosen by the plan.

- :class:`Immediate`: inside ``optimizer.step()`` (optimizer state in host memory).
- :class:`Background`: ``optimizer.step()`` hands the update to a worker thread that runs into
  the next forward (optimizer state on NVMe; Note: the background step).
- :class:`InBackward`: each unit is updated as its backward completes
  (``offload_optimizer.step_in_backward``; Note: the step in backward).

The runtime calls the same methods at the same points whatever the schedule; what happens there
is the schedule's.

Note: the background step
    With the optimizer state on NVMe the update is disk-bound (read master, moments and grads,
    write them and the new params back); run as a phase of its own it overlaps no compute. So
    ``optimizer.step()`` fixes the update (hyperparameters, loss scale and clipping coefficient
    are all known then) and hands it to one worker thread, which updates the units in forward
    order; the next forward waits, at each unit's pre-hook, only for that unit's update (its new
    params are then still in the store's cache). The disk work of the update overlaps the next
    forward. The math, and its order within a unit, are those of an immediate step. Anything
    else that reads or writes state first waits for the whole update (``flush``): a backward,
    checkpoints, ``state_dict``, export, a new ``step()``, ``close``. The store, the IO engine
    and the native pool are safe to call from both threads; the worker touches no parameter
    storage.

Note: the step in backward
    The background step still leaves the disk idle in the backward, and it writes every
    gradient to disk and reads it back. With the step in backward the worker starts with the
    backward: each unit is handed to it as its gradients are final (persistent ones released
    then, the root at the end of backward, when everything not yet updated is reordered to
    forward order), its grad pieces still in their buffers (``HeldNvmeGrads``), and consumed
    there: the gradient bytes never touch the disk. A backward that raises leaves the units
    already handed in updated (teardown is fine; going on training after catching it is not).
    The hyperparameters are those in ``param_groups`` when the last backward of the step
    starts (an LR scheduler stepped after ``optimizer.step()`` gives the same values). What
    needs every gradient before the update (clipping, the fp16 overflow check, a value changed
    late) is settled at ``optimizer.step()``, which keeps the speculative update or undoes and
    redoes it (:class:`InBackward`).

Note: the head start
    A loop that clips every step updates after its backward (the step in backward speculates
    only when the last step's update would have been kept), and the next forward then waits
    for that update's first units: on the 50M demo GPT's recipe (accumulation 2, clipping
    that triggers) ~45-80 ms an iteration before its second unit could start, the update
    reading that unit's master and moments from a disk that sat mostly idle in the backward
    just before. So in the step's last backward, once only the units whose pieces come first
    in the update's order are left to take, their master and moments are read into the
    buffers the speculative update would have used (``NvmeOptim.read_head``; how many:
    ``offload.plan.placement``'s Note on the NVMe step's buffers) and held for the update,
    which takes them when it starts in that order. Whatever else comes first (a ``flush``: a
    state access, a new backward, a skipped step, ``close``) lets them go unused. They are
    reads of values the update has not changed yet, so nothing about the result changes.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from offload import _native
from offload._interrupts import interrupts_deferred, wait
from offload.homes.grads import Hyper, PieceSink
from offload.homes.optim import OptimHome, Part, Units
from offload.homes.params import ParamHome
from offload.io import lifecycle
from offload.plan import Unit
from offload.runtime.phase import PhaseError


class UnitFeed(Units):
    """Units handed to an update while it runs (the step in backward gets each unit's pieces
    as the backward hands them over, the rest of a unit once its gradients are all in).
    :meth:`poll` never blocks (None: nothing yet); :meth:`take` waits (None: the feed is closed
    and empty)."""

    def __init__(self, units: list[Unit]) -> None:
        self._lock = threading.Lock()  # entered directly: see BufferPool's
        self._cond = threading.Condition(self._lock)
        self._items: deque[Part] = deque()
        self._next = {u.index: 0 for u in units}  # units not given whole yet: their next piece
        self._closed = False

    def put(self, unit: Unit, upto: int | None = None) -> None:
        """Hands in ``unit``'s pieces up to ``upto`` (None: all the rest; a unit the update does
        not go over is ignored)."""
        with self._lock:
            first = self._next.get(unit.index)
            if first is None or (upto is not None and upto <= first):
                return
            if upto is None:
                del self._next[unit.index]
            else:
                self._next[unit.index] = upto
            self._items.append((unit, first, upto))
            self._cond.notify_all()

    def close(self, rest: list[Unit] = (), reorder=None) -> None:
        """No more units after ``rest`` (what of them was not given yet); ``reorder`` (a sort
        key of units) reorders the parts not taken yet."""
        with self._lock:
            self._items.extend(
                (u, self._next[u.index], None) for u in rest if u.index in self._next
            )
            self._next.clear()
            if reorder is not None:  # (stable: a unit's parts keep their order)
                self._items = deque(sorted(self._items, key=lambda part: reorder(part[0])))
            self._closed = True
            self._cond.notify_all()

    def poll(self) -> Part | None:
        with self._lock:
            return self._items.popleft() if self._items else None

    def take(self) -> Part | None:
        with self._lock:
            while not self._items and not self._closed:
                wait(self._cond)  # (offload._interrupts, Note: waits)
            return self._items.popleft() if self._items else None


class _Worker:
    """One update in flight on a thread: per-unit completion events and the error to re-raise.
    ``timers`` is the runtime's per-step seconds; ``fail`` is the schedule's
    (:meth:`StepSchedule.fail`)."""

    def __init__(
        self,
        optim: OptimHome,
        timers: dict[str, float],
        fail: Callable[[BaseException, str], RuntimeError],
    ) -> None:
        self.optim, self.timers, self.fail = optim, timers, fail
        self._thread: threading.Thread | None = None
        self._unit_done: dict[int, threading.Event] = {}
        self._error: BaseException | None = None
        self._undo: Callable[[], None] | None = None
        self._pid = os.getpid()  # the process the thread runs in (see _check_here)

    @property
    def failed(self) -> bool:
        return self._error is not None

    def start(
        self,
        units: list[Unit],
        source: Units,
        hyper: Hyper,
        *,
        then: Callable[[], None] | None = None,
        undo: Callable[[], None] | None = None,
    ) -> None:
        """Updates ``units`` in the order ``source`` gives them; ``then`` runs on the worker
        when the update succeeded, ``undo`` on the main thread when it failed (it restores the
        state from before the update, which is then not mixed)."""
        events = {u.index: threading.Event() for u in units}

        def run() -> None:
            t0 = time.perf_counter()
            # beside the training thread's compute, a libgomp team of this thread's own would
            # spin on its cores: the pool (csrc/compute_threads.h)
            _native.use_pool_in_this_thread()
            try:
                with torch.profiler.record_function("offload::update"):
                    self.optim.step_units(
                        source, hyper, on_unit_done=lambda u: events[u.index].set()
                    )
                    if then is not None:
                        then()
            except BaseException as exc:  # re-raised by the main thread when it waits
                self._error = exc
            finally:
                # counted in the step whose forward it overlaps (joined before that step ends)
                self.timers["optimizer_seconds"] += time.perf_counter() - t0
                for event in events.values():
                    event.set()

        # a Ctrl-C inside start() would leave a thread that runs but is not held, one held
        # that never started (join() then raises), or events no thread sets (a forward then
        # waited on them for good): held back over the lines that make the update this one
        with interrupts_deferred():
            self._unit_done, self._error, self._undo = events, None, undo
            self._pid = os.getpid()
            self._thread = threading.Thread(target=run, name="offload-step", daemon=True)
            self._thread.start()

    def wait_unit(self, unit: Unit) -> None:
        """Blocks until ``unit``'s update (if any) is complete; re-raises a failure."""
        event = self._unit_done.get(unit.index)
        if event is not None and not event.is_set():
            self._check_here()
            t0 = time.perf_counter()
            with torch.profiler.record_function("offload::wait_update"):
                wait(event)  # a Ctrl-C inside Event.wait left it locked (Note: waits)
            self.timers["step_wait_seconds"] += time.perf_counter() - t0
        if self._error is not None:
            self.join()

    def _check_here(self) -> None:
        """Raises in a process forked while the update ran: its thread stayed in the parent,
        and its events are never set here."""
        if os.getpid() != self._pid:
            raise RuntimeError(lifecycle.forked("a wait for the optimizer update", "update"))

    def join(self) -> None:
        """Waits for the update to finish; re-raises its error."""
        if self._thread is None:
            return
        if not all(e.is_set() for e in self._unit_done.values()):
            self._check_here()
        t0 = time.perf_counter()
        self._thread.join()
        self.timers["step_wait_seconds"] += time.perf_counter() - t0
        self._thread = None
        err, self._error = self._error, None
        undo, self._undo = self._undo, None
        if err is not None:
            try:
                if undo is not None:
                    undo()
                    raise RuntimeError(
                        f"offload: the background optimizer step failed: {err} (the update was "
                        "undone: the state is that of before this step)"
                    ) from err
            except RuntimeError:
                raise
            except Exception as exc:  # the undo failed too (the same disk): the state is mixed
                err = exc
            raise self.fail(err, f"the background optimizer step failed: {err}") from err
        self._unit_done = {}


class StepSchedule:
    """Interface of the schedules; the defaults are those of a step after backward."""

    # whether a backward may release persistent units (the update in it does)
    releases_persistent = False

    def __init__(
        self, optim: OptimHome, params: ParamHome, stepped: list[Unit], timers: dict[str, float]
    ) -> None:
        self.optim, self.params, self.stepped = optim, params, stepped
        self.timers = timers
        # what made an update fail part way (its state is then mixed), until state is loaded
        self.failure: str | None = None

    def fail(self, err: BaseException, what: str) -> RuntimeError:
        """An update failed part way (``err``): the state it left is mixed until loaded again
        (:attr:`failure`, which the runtime's calls refuse on). Returns the error to raise,
        ``what`` happened and what to do."""
        self.failure = f"{type(err).__name__}: {err}"
        return RuntimeError(
            f"offload: {what} (the optimizer state now mixes updated and old units; load a "
            "checkpoint before training on)"
        )

    def backward_begins(self, hyper: Callable[[], Hyper], pending_backwards: int) -> None:
        """A backward starts (``hyper`` gives this step's hyperparameters as they are now)."""
        self.flush()  # the gradients about to be accumulated are what an update reads

    def unit_backward_begins(self, unit: Unit) -> None:
        """The backward reached ``unit`` (its params are gathered next)."""

    def unit_backward_done(self, run) -> None:
        """A unit's backward ended (its gradients are with their owner, or on their way)."""
        run.residency.after_backward(run)

    def grads_taken(self, unit: Unit) -> None:
        """The unit's gradients of this backward are with their owner."""

    def takes_pieces(self, unit: Unit) -> bool:
        """Whether an update in this backward takes ``unit``'s gradient pieces as they are
        handed over (``offload.homes.grads.PieceSink``): the unit is then released before its
        gradients are taken, since the update may rewrite its home meanwhile."""
        return False

    def backward_ends(self, runs: list) -> None:
        for run in runs:
            run.residency.end_of_pass(run)

    def step(self, hyper: Hyper) -> None:
        """``optimizer.step()``, before the step's telemetry record closes."""
        self.params.quiesce()  # host homes are about to be rewritten
        self.flush()

    def launch(self, hyper: Hyper) -> None:
        """``optimizer.step()``, after the step's record closed (what runs from here on is
        counted in the next step's record, whatever the threads' timing)."""

    def skip(self) -> None:
        """``optimizer.step()`` skips the update (an fp16 overflow)."""

    def abandon_step(self) -> None:
        """The gradients since the last step are dropped (``zero_grad()``, or a backward that
        failed, after :meth:`flush`): no update is taken for them."""

    def wait_unit(self, unit: Unit) -> None:
        """Blocks until ``unit``'s pending update (if any) is complete (before a forward)."""

    def flush(self) -> None:
        """Waits until no update is running; re-raises its error."""

    def flush_quietly(self) -> None:
        """:meth:`flush` where its error was raised already (a backward that failed)."""
        try:
            self.flush()
        except Exception:  # noqa: BLE001 - reported by the call that failed first
            pass

    def check_access(self, what: str, pending_backwards: int) -> None:
        """Raises if state may not be read or written now."""

    def check_grad_norm(self) -> None:
        """Raises if the gradients cannot be inspected as a whole."""

    def check_accumulation(self, backwards: int, who: str) -> None:
        """Raises if a loop of ``backwards`` backwards per step (``who`` says it) cannot run."""

    def state_restored(self) -> None:
        """Every unit's state was loaded again: a failed update's mix is gone."""
        self.failure = None


class Immediate(StepSchedule):
    """The update inside ``optimizer.step()``, over host state rewritten in place (no version
    to roll back, and a copy to undo it from would double the optimizer's host memory): one
    that fails part way (an IO error writing a unit's new params to NVMe, reported as the next
    unit's are taken; a Ctrl-C between units) leaves the units before updated and the rest not,
    and is a failed update (:meth:`StepSchedule.fail`), refused on until state is loaded.
    Until 2026-12-07 its error was raised bare and training went on from the mix."""

    def step(self, hyper: Hyper) -> None:
        super().step(hyper)
        with torch.profiler.record_function("offload::update"):
            try:
                self.optim.step_units(Units(self.stepped), hyper)
            except Exception as err:
                raise self.fail(err, f"the optimizer step failed: {err}") from err
            except BaseException as err:  # a Ctrl-C between units: the same mix
                self.fail(err, "the optimizer step was interrupted")
                raise  # (the interrupt goes up as it came)


class Background(StepSchedule):
    def __init__(self, optim, params, stepped, timers) -> None:
        super().__init__(optim, params, stepped, timers)
        self.worker = _Worker(optim, timers, self.fail)

    def launch(self, hyper: Hyper) -> None:
        self.worker.start(self.stepped, Units(self.stepped), hyper)

    def wait_unit(self, unit: Unit) -> None:
        self.worker.wait_unit(unit)

    def flush(self) -> None:
        self.worker.join()


class InBackward(Background, PieceSink):
    """Note: the step in backward, above. ``accumulation`` backwards make a step; in the last
    one each unit is updated speculatively as its gradients are final, inside a version of the
    optimizer store (``offload.store``'s Note on versions). ``optimizer.step()`` then knows the
    global norm, the overflow flag and its hyperparameters: when they are the ones the update
    used, the version is committed; when not (clipping, a changed learning rate), it is rolled
    back and the update redone with the right ones from the state of before and the gradients
    kept for it (``HeldNvmeGrads.retain``); an overflow rolls back and skips. With no
    gradients kept, a change of the step size alone (lr, eps, AdamW's weight decay) is redone
    on the params only, from the master of before and the moments the update wrote, which do
    not depend on it (``NvmeOptim.redo_step_size``, one rank); any other late change is
    refused. So the result is bitwise that of the update after the backward. A step whose
    update would not have been kept makes the next one update after its backward (no redo to
    pay while the loop clips every step); one that would have been kept makes the next
    speculative again."""

    releases_persistent = True

    def __init__(
        self, optim, params, stepped, timers, *, grads, accumulation: int | None, retain: bool
    ):
        super().__init__(optim, params, stepped, timers)
        self.grads, self.retain_configured = grads, retain
        # backwards per step; None until the first step has counted them (its update runs
        # after its backwards, as the background step's)
        self.accumulation = accumulation
        self._learned = accumulation is None  # "auto": errors say where the count came from
        self.feed: UnitFeed | None = None  # being filled, until the backward ends
        self._quiesced: set[int] = set()  # units the feed got some of (their homes quiesced)
        self._spec: Hyper | None = None  # the speculative update's hyperparameters, until step()
        self._then: tuple | None = None  # what launch() does: ("redo",), ("refuse", used, hyper)
        self._norm_asked = False  # the global norm was asked for (clipping): keep the grads
        self._steps = 0
        self._backwards = 0  # in this step
        self._hyper_now: Callable[[], Hyper] | None = None  # the values an update would use
        # whether the last step's update used the values a speculative one would have (no
        # clipping, no late change): speculate only then; a loop that clips every step updates
        # after the backward, and pays no redo
        self._would_keep = True
        # an update after the backward: units whose gradients this backward must take before
        # its first pieces are read (Note: the head start), until then
        self._head_after: set[int] | None = None

    def backward_begins(self, hyper: Callable[[], Hyper], pending_backwards: int) -> None:
        self.flush()
        self._backwards = pending_backwards + 1
        self._hyper_now = hyper
        if self.accumulation is None or not self._would_keep:
            if self._backwards == self.accumulation:
                self._arm_head_start()
            return  # counting (the first step), or an update after the backward this time
        if self._spec is not None or pending_backwards >= self.accumulation:
            raise PhaseError(
                f"offload: backward number {pending_backwards + 1} before optimizer.step(), "
                f"but gradient_accumulation_steps is {self._accumulation_said}: with "
                "offload_optimizer.step_in_backward the last of them already updated the "
                "weights (for more gradient accumulation raise gradient_accumulation_steps; or "
                "call step() sooner, or set step_in_backward false)"
            )
        if pending_backwards + 1 < self.accumulation:
            return  # an earlier backward of the step: its gradients accumulate on NVMe
        # until a step has shown whether the loop clips, they are kept too
        retain = self.retain_configured or self._norm_asked or self._steps == 0
        with interrupts_deferred():  # a speculative update begun whole, or not at all
            self._spec = hyper()
            self.grads.hand_over(retain, self)
            self.optim.begin_version()
            self.feed, self._quiesced = UnitFeed(self.stepped), set()
            self.worker.start(self.stepped, self.feed, self._spec, undo=self._undo)

    def unit_backward_begins(self, unit: Unit) -> None:
        # its update comes right after its backward: what the update reads (one copy on
        # disk: the master) or overwrites (the compute params of a master of its own) of the
        # param home is kept for it, not taken by the backward's prefetches meanwhile (23.1 ->
        # 15.5 B/param read with beyond_ram's 4 param buffers). Not the root's: its backward
        # is the whole backward
        if self.feed is not None and not unit.is_root:
            self.optim.expect(unit)

    def unit_backward_done(self, run) -> None:
        if self.feed is None:
            super().unit_backward_done(run)
            return
        run.release()  # persistent too: its copy is stale from now on

    def _arm_head_start(self) -> None:
        buffers = self.optim.plan.placement.head_start
        if buffers > 0:
            head = {item.unit.index for item in self.optim.head_pieces(self.stepped, buffers)}
            self._head_after = {u.index for u in self.stepped if u.index not in head}
            self._head_start()

    def _head_start(self) -> None:
        if self._head_after is not None and not self._head_after:
            self._head_after = None
            self.optim.read_head(self.stepped, self.optim.plan.placement.head_start)

    def grads_taken(self, unit: Unit) -> None:
        if self._head_after is not None:
            self._head_after.discard(unit.index)
            self._head_start()
        if self.feed is None or unit.is_root:  # the root goes in at the backward's end
            return
        if self.worker.failed:
            self.flush()  # (raises its error)
        self._quiesce(unit)
        self.feed.put(unit)  # what of it was not handed over piece by piece

    # PieceSink: the update takes the grad pieces of a unit larger than what the pool holds
    # for it as they are handed over, so that none crosses the disk (HeldNvmeGrads)
    def takes_pieces(self, unit: Unit) -> bool:
        # The root too: it is finished at the backward's end (``Root``), released there
        # before its gradients are taken. A unit that fits goes over whole, as its backward
        # ends: told piece by piece too, bench_e2e's units (3 pieces, 4 held) ran 1.03-1.04x
        # per pair in 4 A/B pairs, slower in 7 of 8 runs; whole, 1.00x / 0.98x; and releasing
        # every unit before its gradients were taken made its clipping recipe 1.07x
        # (benchmarks/README, ab_roots)
        hold = self.optim.plan.placement.grad_hold
        return self.feed is not None and len(self.optim.pieces(unit)) > hold

    def pieces_in(self, unit: Unit, upto: int) -> None:
        self._quiesce(unit)
        self.feed.put(unit, upto)

    def _quiesce(self, unit: Unit) -> None:
        """Once per unit and step, before the update gets any of it: its share in its home is
        about to be rewritten."""
        if unit.index not in self._quiesced:
            self._quiesced.add(unit.index)
            self.params.quiesce(unit)

    def backward_ends(self, runs: list) -> None:
        if self.feed is None:
            super().backward_ends(runs)
            return
        for run in runs:
            run.release()  # a persistent root too: its update starts now
        self.params.quiesce()
        self.feed.close(rest=self.stepped, reorder=lambda u: u.index)  # forward order
        self.feed = None

    def step(self, hyper: Hyper) -> None:
        self._steps += 1
        if self.accumulation is None:
            self.accumulation = self._backwards  # learned: the step in backward from now on
        if self._spec is None:  # no speculative update ran: the update after the backward
            self.params.quiesce()
            self.worker.join()  # (not flush(): launch()'s update takes the head start)
            self._head_after = None
            self._then = ("after",)
            self._would_keep = self._hyper_now is None or _same(self._hyper_now(), hyper)
            return
        self.flush()  # the speculative update is complete
        with interrupts_deferred():  # the version ends with the speculation's record
            self.timers["updates_in_backward"] += 1
            used, self._spec = self._spec, None
            self.grads.take_back()
            self._would_keep = _same(used, hyper)
            if self._would_keep:
                self._commit()
            elif self.grads.retain:
                self.optim.rollback_version()  # redone in launch() with the right values
                self.timers["rollbacks"] += 1
                self._then = ("redo",)
            elif _step_size_only(used, hyper) and self.optim.redoes_step_size:
                self.timers["rollbacks"] += 1  # the params' half of the update, redone here
                self._commit(first=lambda: self.optim.redo_step_size(self.stepped, hyper))
            else:
                self._commit()  # taken with the values it used; then refused
                self._then = ("refuse", used, hyper)

    def _commit(self, first: Callable[[], None] | None = None) -> None:
        """Keeps the speculative update (after ``first``, a last change to it); one of its
        writes failed: it is undone instead (the state of before the step), and the error
        raised as an update's."""
        try:
            if first is not None:
                first()
            self.optim.commit_version()
        except Exception as err:
            self.timers["rollbacks"] += 1
            try:
                self.optim.rollback_version()
                self.optim.derive_params(self.stepped)
            except Exception as exc:  # the undo failed too: refused until state is loaded
                what = f"the optimizer step failed: {err}, and its undo: {exc}"
                raise self.fail(exc, what) from exc
            raise RuntimeError(
                f"offload: the optimizer step failed: {err} (the update was undone: the state "
                "is that of before this step)"
            ) from err

    def launch(self, hyper: Hyper) -> None:
        then, self._then = self._then, None
        if then is None:
            return
        if then[0] == "after":
            super().launch(hyper)
        elif then[0] == "redo":
            with interrupts_deferred():  # a version begun with the update that ends it
                self.optim.begin_version()
                self.worker.start(
                    self.stepped,
                    Units(self.stepped),
                    hyper,
                    then=self.optim.commit_version,
                    undo=self._undo,
                )
        else:
            _, used, hyper = then
            changed = {k: (a, b) for k, a, b in _diff(used, hyper)}
            grad_scale = changed.pop("grad_scale", None)
            what = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
            if not what:  # the gradient scale alone: the loop clipped for the first time
                # (loss scaling keeps the gradients from the start); this blamed param_groups
                # until 2026-12-07, which had not changed
                raise PhaseError(
                    "offload: with offload_optimizer.step_in_backward this step's update ran "
                    "in its last backward, unclipped, and optimizer.clip_grad_norm_ clipped it "
                    f"after (a gradient scale of {grad_scale[1]!r}); no step before had asked "
                    "for the norm, so its gradients were not kept to redo the update: the step "
                    "was taken unclipped (clipping applies from the next step, whose gradients "
                    "are kept). Where the loop clips from a later step on (after a warm-up), "
                    "call optimizer.grad_norm() or clip_grad_norm_ from the first step (a "
                    "norm asked for keeps the gradients, 4 bytes a parameter written more a "
                    "step), set gradient_clipping in the config, or set step_in_backward false"
                )
            raise PhaseError(
                "offload: with offload_optimizer.step_in_backward this step used the values "
                "param_groups held when loss.backward() started, but they changed before "
                f"optimizer.step() ({what}), and the "
                "gradients were not kept to redo it: the step was taken with the earlier "
                "values (the new ones apply from the next step). Change them before the "
                "backward (an LR scheduler stepped after optimizer.step() does), or set "
                "gradient_clipping (the gradients are then kept)"
            )

    def skip(self) -> None:
        self._steps += 1
        if self.accumulation is None:
            self.accumulation = self._backwards
        self.flush()  # (a head start read for an update after the backward goes unused)
        self.abandon_step()

    def abandon_step(self) -> None:
        if self._spec is None:  # (no flush: the last step's update overlaps the forward)
            return
        self.flush()
        self.timers["updates_in_backward"] += 1
        self.timers["rollbacks"] += 1
        try:
            self._undo()
        except Exception as exc:  # the state is mixed: refused until state is loaded
            # (raised bare until 2026-12-07: the IO error, no word of the mix)
            raise self.fail(exc, f"undoing the optimizer step's update failed: {exc}") from exc

    def _undo(self) -> None:
        """Back to the state before the update: master and moments from the version's start,
        the compute params derived from them again. Whole or not at all: a Ctrl-C waits
        for its end (stopped half way, the version stays open or the params disagree with
        the master)."""
        with interrupts_deferred():
            self._spec = None
            self.grads.abandon()  # pieces handed over for units the update never took
            self.grads.take_back()
            self.optim.rollback_version()
            self.optim.derive_params(self.stepped)

    def flush(self) -> None:
        if self.feed is not None:  # a backward that failed or was interrupted: no more units
            self.feed.close()
            self.feed = None
        self.worker.join()
        self._head_after = None
        self.optim.drop_head()  # no update after this backward takes it

    def check_access(self, what: str, pending_backwards: int) -> None:
        if self._spec is not None:
            raise PhaseError(
                f"offload: {what} called between loss.backward() and optimizer.step(); with "
                "offload_optimizer.step_in_backward the last backward of the step "
                f"(gradient_accumulation_steps: {self._accumulation_said}) already updated the "
                "weights, so call it after optimizer.step() (for more gradient accumulation "
                "raise gradient_accumulation_steps, or set step_in_backward false)"
            )

    def check_grad_norm(self) -> None:
        self._norm_asked = True

    @property
    def _accumulation_said(self) -> str:
        """The count as errors say it: learned ones say so (a first step whose first backward a
        ``zero_grad()`` dropped learned one fewer, and the refusals named a count the user never
        set)."""
        if not self._learned:
            return str(self.accumulation)
        return f'{self.accumulation} ("auto": the backwards of the first step, counted then)'

    def check_accumulation(self, backwards: int, who: str) -> None:
        if self.accumulation is not None and self.accumulation != backwards:
            raise ValueError(
                f"{who} makes a step of {backwards} backwards, but offload's "
                f"gradient_accumulation_steps is {self._accumulation_said}: with "
                "offload_optimizer.step_in_backward the update runs in the step's last "
                f'backward, so they must agree (set the config\'s to {backwards} or "auto")'
            )


def _diff(a: Hyper, b: Hyper):
    """``(name, a's value, b's value)`` of every hyperparameter but the step that differs (a
    group's named by its index where there are several)."""
    out = [("grad_scale", a.grad_scale, b.grad_scale)] if a.grad_scale != b.grad_scale else []
    if len(a.groups) != len(b.groups):
        return [*out, ("param_groups", len(a.groups), len(b.groups))]
    for i, (ga, gb) in enumerate(zip(a.groups, b.groups, strict=True)):
        name = "{}" if len(a.groups) == 1 else f"param_groups[{i}].{{}}"
        out += [(name.format(k), ga[k], gb[k]) for k in ga if ga[k] != gb[k]]
    return out


def _same(a: Hyper, b: Hyper) -> bool:
    return not _diff(a, b)


def _step_size_only(a: Hyper, b: Hyper) -> bool:
    """Whether ``a`` and ``b`` differ only in what the moments do not depend on: lr, eps and
    AdamW's (decoupled) weight decay, in any group. The update's moments are then right for
    ``b`` too, and only its params need redoing (``NvmeOptim.redo_step_size``), without the
    gradients."""
    if a.grad_scale != b.grad_scale or len(a.groups) != len(b.groups):
        return False
    for ga, gb in zip(a.groups, b.groups, strict=True):
        free = {"lr", "eps"} | ({"weight_decay"} if ga["adamw_mode"] else set())
        if any(ga[k] != gb[k] for k in ga if k not in free):
            return False
    return True
