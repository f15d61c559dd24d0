"""The owners of the fp32 gradients (``offload.plan.ownership``, ``GradOwner``).

Each owner takes a unit's gradients when its backward ends (``absorb``), reports their global
inf/NaN flag and sum of squares for clipping and fp16 overflow (``stats``), and feeds them to
the update (``update`` for the host state; ``fetch`` / ``drop`` for the NVMe step's pipeline).

Note: accumulation
    A unit's device gradients are accumulated into the fp32 owner with the native one-pass
    kernel, which also reports inf/NaN and the sum of squares of the result. The first
    micro-step after ``zero_grad`` overwrites instead of adding, so nothing is ever zeroed and,
    on NVMe, the first write needs no read. The latest sum of squares per unit (or piece)
    gives the global norm for clipping without another pass.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from offload._interrupts import interrupts_deferred, wait
from offload.homes.decay import StepCounts, UpdateRuns
from offload.optim import accumulate_grad, adam_step
from offload.optim.kernels import AdamGroup
from offload.plan import Plan, Unit

PartsSource = Callable[[], list]
"""Yields a unit's gradients on the host as ``(begin, end, tensor | None)`` parts."""


@dataclass(slots=True)
class Hyper:
    """The hyperparameters of one step."""

    step: int
    groups: tuple[dict, ...]
    """Each param group's ``lr``, ``betas``, ``eps``, ``weight_decay``, ``adamw_mode`` and
    ``bias_correction``, in the optimizer's order."""
    grad_scale: float
    runs_of: UpdateRuns = field(default_factory=UpdateRuns)
    """Each parameter's group and whether it decays (``offload.homes.decay``)."""
    counts: StepCounts = field(default_factory=StepCounts)
    """Which parameters got a gradient, and each one's step count (``offload.homes.decay``)."""

    def kwargs(self, group: int = 0, decayed: bool = True, step: int | None = None) -> dict:
        """The kernels' keyword arguments for a run of ``group``'s parameters (``decayed=False``:
        of parameters weight decay leaves alone; ``step``: their own step count, where it is
        not the optimizer's)."""
        out = dict(self.groups[group], step=step or self.step, grad_scale=self.grad_scale)
        if not decayed:
            out["weight_decay"] = 0.0
        return out

    def runs(self, unit: Unit, lo: int, hi: int):
        """``(slice of the piece [lo, hi), kernel kwargs)`` for each run of it
        (:meth:`UpdateRuns.runs`): the update makes one kernel call per run; kwargs None for a
        run of parameters that got no gradient this step, which the update leaves alone."""
        if self.counts.uniform(unit):
            for a, b, group, decayed in self.runs_of.runs(unit, lo, hi):
                yield slice(a - lo, b - lo), self.kwargs(group, decayed)
            return
        for a, b, group, decayed, step in self.runs_of.counted_runs(
            unit, lo, hi, self.counts, self.step
        ):
            yield slice(a - lo, b - lo), self.kwargs(group, decayed, step) if step else None


def adam_runs(
    unit: Unit,
    lo: int,
    hi: int,
    state: tuple[torch.Tensor, ...],
    out: torch.Tensor | None,
    hyper: Hyper,
) -> None:
    """``adam_step`` of the piece ``[lo, hi)`` of ``unit`` (``state``: its master, gradient and
    moments, each holding exactly that range; ``out``: its compute params or None), one call
    per run of ``hyper.runs`` (one call in all where every parameter decays). A run the update
    leaves alone keeps its master and moments; its compute params are the master's (``out``
    is a fresh buffer the update fills)."""
    runs = list(hyper.runs(unit, lo, hi))
    if len(runs) == 1 and runs[0][1] is not None:
        adam_step(*state, **runs[0][1], out=out)
        return
    flat = [t.view(-1) for t in state]
    out = None if out is None else out.view(-1)
    for sl, kwargs in runs:
        if kwargs is not None:
            adam_step(*(t[sl] for t in flat), **kwargs, out=None if out is None else out[sl])
        elif out is not None:
            out[sl].copy_(flat[0][sl])


class GradRecord:
    """Latest accumulation result of one unit or piece."""

    found_inf: bool = False
    sumsq: float = 0.0


class GradParts:
    """A unit's gradient over ``[0, trainable)`` of its flat layout, as it arrives from backward:
    ``(begin, end, tensor)`` parts in order, ``tensor`` None where there is no gradient (padding,
    or a parameter that got none). Accumulating a range reads the parts in place: no flat copy."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[tuple[int, int, torch.Tensor | None]]) -> None:
        self.parts = parts

    @staticmethod
    def of_flat(flat: torch.Tensor) -> GradParts:
        return GradParts([(0, flat.numel(), flat)])

    def accumulate(self, acc: torch.Tensor, lo: int, overwrite: bool) -> GradRecord:
        """``acc`` holds elements ``[lo, lo + acc.numel())``: adds (or, with ``overwrite``,
        writes) the gradient there; returns inf/NaN and the sum of squares of the new ``acc``."""
        hi = lo + acc.numel()
        rec = GradRecord()
        for a, b, g in self.parts:
            a2, b2 = max(a, lo), min(b, hi)
            if a2 >= b2:
                continue
            dst = acc[a2 - lo : b2 - lo]
            if g is not None:
                inf, ss = accumulate_grad(dst, g[a2 - a : b2 - a], overwrite=overwrite)
            elif overwrite:
                dst.zero_()
                inf, ss = False, 0.0
            else:  # no gradient this micro-step: the accumulated values stay and still count
                ss = float(dst.double().square().sum())
                inf = not torch.isfinite(dst).all().item()
            rec.found_inf |= inf
            rec.sumsq += ss
        return rec


def _drop_device_grads(unit: Unit) -> None:
    for p in unit.trainable_params:
        p.grad = None


class GradHome:
    """Interface of the gradient owners."""

    # whether a step leaves the gradients it used where they were, for a next backward to
    # add to (``p.grad``, as in PyTorch) until ``zero_grad``; an owner of its own hands them to
    # the update, and the first backward after a step overwrites them
    kept_after_step = False
    # whether an update running in this backward takes each unit's gradients as they come
    # (``HeldNvmeGrads`` while the step in backward speculates)
    handing = False

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.records: dict[int, list[GradRecord]] = {}

    def create(self, unit: Unit) -> None:
        """Makes room for the unit's gradients (wrap time)."""

    def absorb(self, unit: Unit, parts: PartsSource, first: bool) -> None:
        """The unit's backward ended: take its gradients (overwrite when ``first``)."""
        raise NotImplementedError

    def expect(self, unit: Unit, first: bool) -> None:
        """The unit's backward began: its gradients come next (``first``: they overwrite)."""

    def update_many(self, pieces: list[tuple], hyper: Hyper) -> None:
        """:meth:`update` of every ``(unit, lo, hi, master, exp_avg, exp_avg_sq, out)``; an
        owner that can reach all of them at once makes it one kernel call."""
        for piece in pieces:
            self.update(*piece, hyper)

    def stats(self) -> tuple[bool, float]:
        """(any inf/NaN, sum of squares) over all accumulated gradients (still loss-scaled)."""
        recs = [r for rs in self.records.values() for r in rs]
        return any(r.found_inf for r in recs), sum(r.sumsq for r in recs)

    def held(self) -> dict[str, int]:
        """Bytes of fp32 gradients this owner holds, by where (``host``, ``nvme``)."""
        return {}

    def close(self) -> None:
        pass


class AutogradGrads(GradHome):
    """Gradients stay in ``p.grad``: autograd accumulates them and the update reads them in
    place (only where they already sit where the optimizer runs; see the ownership Note)."""

    kept_after_step = True

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self._groups: dict[tuple[int, int], tuple[AdamGroup, list]] = {}
        # a group's parts (by param group, decayed) for the step's UpdateRuns: (group, runs, parts)
        self._parts: dict[int, tuple[AdamGroup, object, list]] = {}

    def absorb(self, unit: Unit, parts: PartsSource, first: bool) -> None:
        pass  # autograd has put them where they stay

    def stats(self) -> tuple[bool, float]:
        grads = [p.grad for u in self.plan.units for p in u.trainable_params if p.grad is not None]
        if not grads:
            return False, 0.0
        norms = torch._foreach_norm(grads, 2.0)
        if all(torch.isfinite(n) for n in norms):
            return False, float(sum(float(n.double() ** 2) for n in norms))
        # an fp32 norm is inf also where every element is finite but their squares pass
        # 3.4e38 (a loss scale grown past ~2**64 over a norm of a few): the step was skipped
        # as an overflow and the scale halved, where the other homes (fp64 sums) and torch's
        # GradScaler (per-element checks) step. The elements decide; the sum then in fp64.
        if not all(torch.isfinite(n) for n in torch._foreach_norm(grads, math.inf)):
            return True, float(sum(float(n.double() ** 2) for n in norms))  # (NaN stays NaN)
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
        return False, float(sum(float(n) ** 2 for n in norms))

    def update(self, unit, lo, hi, master, exp_avg, exp_avg_sq, out, hyper: Hyper) -> None:
        """Adam over the parameters inside ``[lo, hi)`` whose ``p.grad`` is set, in one native
        call (the group of slices is prepared once per piece and reused; the state buffers stay
        put for the whole run). A parameter that got no gradient is not updated this step."""
        self._step(*self._group(unit, lo, hi, master, exp_avg, exp_avg_sq, out), hyper)

    def update_many(self, pieces: list[tuple], hyper: Hyper) -> None:
        """Every piece's parameters in one native call: the kernel's pool splits the whole
        model's tensors into tasks at once, where a call per piece pays a dispatch and a tail
        each (~10% of a step of the 50M demo GPT on 2 cores: ``bench_adam_phase``)."""
        if not pieces:
            return
        key = tuple((unit.index, lo) for unit, lo, *_ in pieces)
        cached = self._groups.get(key)
        if cached is None:
            groups = [self._group(*piece) for piece in pieces]
            kinds = range(len(groups[0][0].tensors))  # params, moments, outs (or None)
            tensors = [
                None
                if groups[0][0].tensors[k] is None
                else [t for g, _ in groups for t in g.tensors[k]]
                for k in kinds
            ]
            segs = [s for _, ss in groups for s in ss]
            cached = self._groups[key] = (AdamGroup(*tensors), segs)
        self._step(*cached, hyper)

    def _step(self, group: AdamGroup, segs: list, hyper: Hyper) -> None:
        """One call for the whole group; where its tensors take different hyperparameters
        (``hyper.runs_of``: undecayed ones, param groups), one per set of them (the parts kept
        while every tensor gets a gradient and has the optimizer's step count); with some
        gradients missing, over those present, each with its own step count."""
        grads = [s.param.grad for s in segs]
        runs_of, counts = hyper.runs_of, hyper.counts
        complete = all(g is not None for g in grads) and not counts.missed
        if not runs_of.no_decay and not runs_of.group_of and complete:
            group.step([g.view(-1) for g in grads], **hyper.kwargs())
            return
        cached = self._parts.get(id(group)) if complete else None
        if cached is not None and cached[0] is group and cached[1] is runs_of:
            parts = cached[2]
        else:
            # (a parameter's own step count where some differ; None: the optimizer's, which
            # the cached parts must take afresh each step)
            keys: dict[tuple[int, bool, int | None], list[int]] = {}
            for i, (s, g) in enumerate(zip(segs, grads, strict=True)):
                if g is not None:
                    own = counts.step_of(s.param, hyper.step) if counts.missed else None
                    keys.setdefault((*runs_of.key(s.param), own), []).append(i)
            parts = []
            for key, live in keys.items():
                tensors = [None if t is None else [t[i] for i in live] for t in group.tensors]
                parts.append((AdamGroup(*tensors), live, key))
            if complete:  # (the entry holds its group: its id stays its own)
                self._parts[id(group)] = (group, runs_of, parts)
        for part, live, key in parts:
            part.step([grads[i].view(-1) for i in live], **hyper.kwargs(*key))

    def _group(self, unit, lo, hi, master, exp_avg, exp_avg_sq, out) -> tuple[AdamGroup, list]:
        cached = self._groups.get((unit.index, lo))
        if cached is None:
            segs = [s for s, _, _ in unit.layout.overlaps(lo, hi, trainable_only=True)]
            sl = [slice(s.offset - lo, s.end - lo) for s in segs]
            outs = None if out is None else [out[x] for x in sl]
            group = AdamGroup(
                [master[x] for x in sl], [exp_avg[x] for x in sl], [exp_avg_sq[x] for x in sl], outs
            )
            cached = self._groups[(unit.index, lo)] = (group, segs)
        return cached


class HostGrads(GradHome):
    """One flat fp32 host buffer per unit over its trainable share."""

    def __init__(self, plan: Plan, memory, pin: bool) -> None:
        super().__init__(plan)
        self.memory, self.pin = memory, pin
        self.bufs: dict[int, torch.Tensor] = {}

    def create(self, unit: Unit) -> None:
        lo, hi = unit.layout.local_trainable
        if hi > lo:
            self.bufs[unit.index] = self.memory.empty(hi - lo, torch.float32, self.pin)
            self.records[unit.index] = [GradRecord()]

    def absorb(self, unit: Unit, parts: PartsSource, first: bool) -> None:
        buf = self.bufs.get(unit.index)
        if buf is None:
            return
        lo = unit.layout.local_trainable[0]
        self.records[unit.index][0] = GradParts(parts()).accumulate(buf, lo, first)
        _drop_device_grads(unit)

    def update(self, unit, lo, hi, master, exp_avg, exp_avg_sq, out, hyper: Hyper) -> None:
        base = unit.layout.local_trainable[0]
        grad = self.bufs[unit.index][lo - base : hi - base]
        adam_runs(unit, lo, hi, (master, grad, exp_avg, exp_avg_sq), out, hyper)

    def held(self) -> dict[str, int]:
        return {"host": sum(t.numel() * t.element_size() for t in self.bufs.values())}


class _Ready:
    """A fetch that is already complete: a grad piece handed over in its buffer."""

    __slots__ = ("buf",)

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf

    def wait(self) -> torch.Tensor:
        return self.buf


class NvmeGrads(GradHome):
    """fp32 shards ``grad.u<unit>.<lo>`` in the optimizer store, one per piece."""

    def __init__(self, plan: Plan, store) -> None:
        from offload.store import Tier  # noqa: PLC0415

        super().__init__(plan)
        self.store, self.tier, self._nvme = store, Tier.HOST, Tier.NVME

    @staticmethod
    def key(unit: Unit, lo: int) -> str:
        return f"grad.u{unit.index}.{lo}"

    def create(self, unit: Unit) -> None:
        pieces = self.plan.trainable_pieces(unit)
        self.records[unit.index] = [GradRecord() for _ in pieces]
        for lo, hi in pieces:
            self.store.register(self.key(unit, lo), hi - lo, torch.float32, self._nvme)

    def expect(self, unit: Unit, first: bool) -> None:
        """Reads the earlier micro-steps' sum of the unit's pieces while its backward runs, so
        that ``absorb`` finds it in memory. The reads are prefetches (``TieredStore.read_ahead``):
        nothing is pinned or counted against the update's buffers. It matters with the step in
        backward, whose optimizer store reads nothing ahead by its trace in the backward (the
        background step's does): read at ``absorb`` instead, the sum held the last backward of
        the 50M demo GPT's recipe (accumulation 2, the update in that backward) ~70 ms an
        iteration (benchmarks/README.md, bench_e2e)."""
        if not first:
            self.store.read_ahead(self.key(unit, lo) for lo, _ in self.plan.trainable_pieces(unit))

    def absorb(self, unit: Unit, parts: PartsSource, first: bool) -> None:
        pieces = self.plan.trainable_pieces(unit)
        if not pieces:
            return
        grad = GradParts(parts())
        recs = self.records[unit.index]
        for j, (lo, hi) in enumerate(pieces):
            key = self.key(unit, lo)
            if not first:  # an overwrite reads nothing: keep it out of the prefetch trace
                self.store.use(key, self.tier)
            with self.store.borrow(key, read=not first) as buf:
                recs[j] = grad.accumulate(buf[: hi - lo], lo, first)
        _drop_device_grads(unit)

    def fetch(self, unit: Unit, lo: int):
        """A future of the piece's accumulated gradient, for the update."""
        return self.store.fetch(self.key(unit, lo), self.tier)

    def drop(self, unit: Unit, lo: int, future) -> None:
        """The update consumed the piece."""
        self.store.release(self.key(unit, lo), self.tier)

    def abandon(self) -> None:
        """The update stopped early (an error): nothing is held for it."""

    def held(self) -> dict[str, int]:
        return {
            "nvme": 4
            * sum(b - a for u in self.plan.units for a, b in self.plan.trainable_pieces(u))
        }


class PieceSink:
    """Where :class:`HeldNvmeGrads` tells the update of the grad pieces it hands over (the step
    in backward's schedule)."""

    def takes_pieces(self, unit: Unit) -> bool:
        """Whether the update takes ``unit``'s pieces as they are handed over (else only once
        the unit's gradients are all in: it then waits for room for all of them)."""
        raise NotImplementedError

    def pieces_in(self, unit: Unit, upto: int) -> None:
        """``unit``'s pieces ``[0, upto)`` are handed over (``takes_pieces``)."""
        raise NotImplementedError


class HeldNvmeGrads(NvmeGrads):
    """The step in backward's gradients. Between :meth:`hand_over` and :meth:`take_back` (the last
    backward of a step and the update that runs in it) each unit's gradients are accumulated
    into its grad pieces and up to ``hold`` pieces stay in their buffers for the update,
    which consumes them without a disk read; the rest are released dirty (written, and read
    back by the update). The backward waits while the update still holds earlier pieces and
    this unit's would exceed ``hold``: it then runs at the update's pace instead of taking
    every buffer. A unit of more pieces than ``hold`` (``PieceSink.takes_pieces``; the root
    too, at the backward's end) waits piece by piece instead, the update taking its pieces
    as they come: its first pieces are updated while the backward hands in the next, and
    none waits on disk (before 2026-12-06 the update heard of a unit only once it was all
    in, so its pieces beyond ``hold`` were written and read back, 8 bytes more disk traffic
    a parameter of them: a 2B Llama in 64 MiB buffers, 5 and 10 pieces a unit, one held,
    wrote 15.2 bytes a parameter a step instead of 12.3; ``benchmarks/README.md``,
    beyond_ram). A consumed piece is dropped unwritten, unless ``retain``: then it is
    written, so that a redo of the update (clipping, a changed learning rate) can read it
    again. Outside a hand-over they are accumulated on NVMe like :class:`NvmeGrads`'s."""

    def __init__(self, plan: Plan, store, hold: int) -> None:
        super().__init__(plan, store)
        self.hold = hold
        self.handing = False
        self.retain = False
        self._sink: PieceSink | None = None
        self._handed: dict[str, torch.Tensor] = {}
        self._held = 0
        self._lock = threading.Lock()  # entered directly: see BufferPool's
        self._cond = threading.Condition(self._lock)

    def hand_over(self, retain: bool, sink: PieceSink | None = None) -> None:
        """The next units' gradients go to the update running in this backward (told to
        ``sink`` piece by piece where it takes them so)."""
        self.handing, self.retain, self._sink = True, retain, sink

    def take_back(self) -> None:
        """The update is over: gradients are kept on NVMe again."""
        self.handing, self._sink = False, None

    def _wait_for_room(self, pieces: int) -> bool:
        """Waits until ``pieces`` more can be held, or none can wait: nothing held (a unit of
        more pieces than ``hold`` then keeps ``hold``), or no hand-over (an update that failed
        ended it); whether the hand-over goes on."""
        with self._lock:
            while self.handing and self._held and self._held + pieces > self.hold:
                wait(self._cond)  # (offload._interrupts, Note: waits)
            return self.handing

    def absorb(self, unit: Unit, parts: PartsSource, first: bool) -> None:
        pieces = self.plan.trainable_pieces(unit)
        sink = self._sink
        streamed = self.handing and sink is not None and sink.takes_pieces(unit)
        if not self._wait_for_room(1 if streamed else len(pieces)):
            super().absorb(unit, parts, first)
            return
        if not pieces:
            return
        grad = GradParts(parts())
        recs = self.records[unit.index]
        for j, (lo, hi) in enumerate(pieces):
            if streamed and j:  # the update takes the pieces before this one meanwhile
                self._wait_for_room(1)
            key = self.key(unit, lo)
            if not first:  # added to what the earlier backwards of this step left on NVMe
                self.store.use(key, self.tier)
            held: list[str] = []  # the pin, once taken; cleared once handed over or released
            # One block for a Ctrl-C, the piece's take, sum and hand-over (or release): landing
            # between the sum and the release, it left the buffer neither handed over nor
            # released; landing in the take or the sum, the release below ran in its unwinding,
            # where a second Ctrl-C landed first (AGAIN in tests/_ctrl_c_points.py): pinned for
            # good either way. It comes out between pieces, where nothing is held
            with interrupts_deferred():
                try:
                    buf = self.store.take(key, self.tier, read=not first, held=held)
                    recs[j] = grad.accumulate(buf[: hi - lo], lo, first)
                    with self._lock:
                        keep = self.handing and self._held < self.hold
                        if keep:
                            self._held += 1
                            self._handed[key] = buf
                    if not keep:
                        self.store.release(key, self.tier, dirty=True)
                    held.clear()
                except BaseException:  # a failed backward: zero_grad() overwrites its sums
                    if held:
                        self.store.release(key, self.tier, discard=True)
                    raise
            if keep and streamed:
                sink.pieces_in(unit, j + 1)
        _drop_device_grads(unit)

    def fetch(self, unit: Unit, lo: int):
        key = self.key(unit, lo)
        with self._lock:
            buf = self._handed.pop(key, None)
        return self.store.fetch(key, self.tier) if buf is None else _Ready(buf)

    def drop(self, unit: Unit, lo: int, future) -> None:
        key = self.key(unit, lo)
        handed = isinstance(future, _Ready)  # one of the `hold` buffers the backward filled
        if self.handing and not self.retain:
            self.store.release(key, self.tier, discard=True)  # consumed: never written
        else:  # kept for a redo (written, if it was still only in its buffer)
            self.store.release(key, self.tier, dirty=handed)
        if handed:
            with self._lock:
                self._held -= 1
                self._cond.notify_all()

    def abandon(self) -> None:
        """The update stopped (failed, or went over every unit): the backward must not wait
        on it, nor hand it more pieces; the rest of a backward accumulates on NVMe (its error
        is raised once the worker has recorded it, at the next unit or the backward's end)."""
        with self._lock:
            left, self._handed = list(self._handed), {}
            self._held = 0
            self.handing = False
            self._cond.notify_all()
        for key in left:
            self.store.release(key, self.tier, discard=True)
