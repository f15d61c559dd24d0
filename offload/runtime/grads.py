"""Gradients from autograd to their owner: the one place a unit's gradients pass through when its
backward ends, and where they are reduced across ranks.

The owner (``offload.homes.grads``) is the plan's choice; so is when the reduction happens
(``offload.plan.GradReduce``), as one of the objects below:

- :class:`Grads` (one rank): the unit's device gradients go through the device's staging
  (``offload.device.GradStaging``) to their owner as its backward ends.
- :class:`ScatteredGrads` (stages 2 and 3): as a unit's backward ends its gradients are
  flattened on the device and reduce-scattered asynchronously; this rank's reduced share goes
  to the owner when the reduction has landed, which is waited for only at the next unit's end
  (or the end of the backward), so it overlaps the next unit's backward.
- :class:`StepScatteredGrads` (stage 1): a step's micro-steps are added on the device (in
  fp32 by default: Note on the accumulation dtype); each unit is reduce-scattered once, when
  the step needs the gradients (:meth:`Grads.settle`), the next unit's flattening overlapping
  the previous one's reduction.

Each tracks the first micro-step after ``zero_grad`` (whose gradients overwrite instead of
adding), and which trainable parameters got a gradient since (``seen``: the update leaves the
others alone, as torch's optimizers do; ``offload.homes.decay.StepCounts``). With several
ranks a parameter got one where any rank's backward gave it one (data parallel's: the others'
count as zero): the ranks' records are reduced (the largest of 0 / 1 per parameter) once per
step, before the norm or the update (:meth:`ScatteredGrads.settle`); where the update runs in
the backward, which takes each unit as its gradients land, each unit's record is reduced beside
its reduce-scatter instead. A small all-reduce per unit is not free: in a scratch loop (not
kept: 2 gloo ranks of a 9-unit stack on this 2-core machine, stage 2, accumulation 2, the
all-reduce replaced by a completed handle for the runs without it, alternating runs,
2026-12-06) one per unit and micro-step took 87-109 ms a step against 74-80 ms with none; one
per step, 67-80 ms against 62-81 ms.

Note: the mean over ranks
    The reductions sum. The mean of data parallel (each rank's loss is the mean over its own
    micro-batch) is applied as a factor ``mean_scale = 1 / world`` where the gradients are used:
    inside the Adam kernel's gradient scale, and on the norm (:meth:`Grads.stats` returns the
    sum of squares of the mean). In fp32 the factor is exact for a power-of-two world.
    A sum in fp16 is the exception: there each rank's gradients are divided by the world
    before the reduction (``mean_scale`` is then 1), as FSDP pre-divides. Summed first, N
    ranks' finite fp16 gradients of the one-process magnitude overflowed in the sum (65504 is
    fp16's largest): a step one process takes was skipped on every rank, and the dynamic loss
    scale settled N times lower. bf16 has fp32's range and keeps the sum.

Note: the reduce dtype
    The ranks' gradients are summed in ``Placement.reduce_dtype`` (``distributed.reduce_dtype``,
    fp32 by default), which may be wider than the compute dtype: flattening a unit's
    gradients for the reduction widens them on the device. One process adds each backward's
    16-bit gradients into its fp32 owner (``offload.homes.grads``); a sum in bf16 rounds
    once more per unit and micro-step: 2 ranks of the test model's bf16 training ended
    1.2e-2 apart in the weights from one process running the ranks' micro-batches (losses
    1.2e-2), and 1.2e-7 apart summed in fp32 (``tests/test_dist.py``). Stage 1 adds its
    micro-steps before its one reduction per step (Note on the accumulation dtype).

    The flat buffers (:class:`ScatteredGrads`) hold ``Placement.reduce_slots`` units in the
    reduce dtype: two in the compute dtype's width, one where the reduce dtype is twice as
    wide, so an fp32 reduction of a 16-bit unit takes the bytes the two 16-bit slots took
    (the largest unit's trainable elements x 4 bytes, plus this rank's share of it for the
    result). With one slot the previous unit's reduction lands before the next unit is
    flattened; it still overlaps the backward of the unit after it (a second fp32 slot did
    not make the 5M demo GPT's step on 2 ranks faster: 1.07-1.30 s against 1.07-1.11 s).

Note: the accumulation dtype
    One rank and stages 2 and 3 add each micro-step into an fp32 owner. Stage 1 keeps a
    step's gradients on the device until its one reduction, and autograd adds the micro-steps
    in ``p.grad``, in the compute dtype: with bf16 and accumulation 2, 2 ranks ended 1.2e-2
    apart in the weights from one process running the ranks' micro-batches (losses 6.9e-3).
    So they are added in ``Placement.grad_accum_dtype`` (``distributed.grad_accum_dtype``,
    fp32 by default; DeepSpeed's ``data_types.grad_accum_dtype``), and end 1.2e-7 apart
    (losses equal). The first micro-step's gradients stay in ``p.grad`` (one backward's
    16-bit gradients are what one process adds too); the second backward begins by moving
    each unit's into an fp32 sum of its own on the device, and each later backward's are
    added to it as the unit's backward ends, ``p.grad`` dropped, so autograd starts each
    unit from none (:class:`_WideSums`). A unit's sum is freed when its reduction has copied
    it. The cost is device memory: with accumulation the step's gradients take 4 bytes per
    trainable parameter where ``p.grad`` took 2 (a step of one micro-step holds ``p.grad``
    only, as before), and one device pass over them per micro-step after the first (the
    widening copy, then the adds): 11-25 ms of a 0.65-1.9 s step on the 5M demo GPT's 2 CPU
    ranks. ``"bf16"`` / ``"fp16"`` (the compute dtype) keeps them in ``p.grad``.

Note: the norm and the overflow flag
    Each rank's owner knows the sum of squares and the inf/NaN flag of its own share. Shares do
    not overlap, so the global values are one all-reduce (sum) of ``[flag, sum of squares]``;
    every rank gets the same numbers, clips with the same coefficient and skips the same fp16
    steps.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from offload.device import GradStaging, grad_parts
from offload.dist import Comm, Handle, LocalComm
from offload.homes.grads import GradHome
from offload.plan import Unit
from offload.runtime.phase import PhaseError


class Grads:
    reduces_in_backward = False
    """Whether the backward reduces (stages 2-3): the ranks' backwards must then match."""

    def __init__(
        self,
        owner: GradHome,
        staging: GradStaging,
        units: list[Unit],
        comm: Comm | None = None,
    ) -> None:
        self.owner, self.staging, self.units = owner, staging, units
        self.comm = comm or LocalComm()
        self.mean_scale = 1.0 / self.comm.world
        self.first_micro_step = True  # the next gradients overwrite instead of adding
        self._taken: list[Unit] = []  # units whose gradients the owner took, not yet told
        # told between two units' gradients handed in within one call (the runtime: the
        # schedule hears of those taken so far; see ScatteredGrads.unit_done)
        self.between: Callable[[], None] = lambda: None
        # the trainable parameters that got a gradient since the step began (a new set each
        # step: an update still running keeps the one it began with); with several ranks,
        # this rank's alone, and `seen` fills as the units' reductions land
        self.mine: set[torch.nn.Parameter] = set()
        self.seen = self.mine
        # those torch would hold a gradient tensor for since the last zero_grad() that set
        # them to None: zero_grad(set_to_none=False) zeroes torch's in place, and its next
        # step moves them with that zero gradient
        self._had: set[torch.nn.Parameter] = set()

    def note(self, unit: Unit) -> None:
        """``unit``'s backward ended: the parameters with a gradient in it got one this step."""
        self.mine.update(p for p in unit.trainable_params if p.grad is not None)

    def now_seen(self) -> set[torch.nn.Parameter]:
        """The parameters the open step's update moves: those that got a gradient (in
        ``p.grad`` where the owner leaves them there, as torch reads them at its step: a loop
        that steps twice without ``zero_grad`` steps them twice)."""
        if self.owner.kept_after_step:
            return {p for u in self.units for p in u.trainable_params if p.grad is not None}
        return self.seen

    def _fresh_seen(self, kept: set = frozenset()) -> None:
        self.mine = set(kept)
        self.seen = self.mine

    def unit_done(self, unit: Unit) -> None:
        """``unit``'s gradients of this backward are final: its owner takes them."""
        self.note(unit)
        with torch.profiler.record_function("offload::grads"):
            self.owner.absorb(unit, lambda: self.staging.host_parts(unit), self.first_micro_step)
        self._taken.append(unit)

    def unit_begins(self, unit: Unit) -> None:
        """``unit``'s backward began (its gradients come next)."""
        self.owner.expect(unit, self.first_micro_step)

    def forward_use(self, unit: Unit) -> None:
        """``unit`` runs in a forward (not a recomputation)."""

    def backward_begins(self, agree: Callable[[int], bool] | None = None) -> None:
        """A backward begins, before it reduces anything. ``agree(digest)``: the ranks' check
        before a backward (``offload.runtime.agree``), told a digest of what this rank's
        backward will reduce; whether every rank's was the same."""

    def taken(self) -> list[Unit]:
        """The units whose gradients their owner took since the last call (in that order)."""
        out, self._taken = self._taken, []
        return out

    def backward_failed(self) -> None:
        """The backward failed part way: the units it took are not told to anyone (told in
        the next backward, its update would take them before their gradients of that one)."""
        self._taken = []

    def backward_done(self) -> None:
        """The backward ended (every unit's gradients were handed in)."""
        self.first_micro_step = False

    def settle(self) -> None:
        """Every gradient of this step is with its owner (before the norm or the update)."""

    def stats(self) -> tuple[bool, float]:
        """(any inf/NaN, sum of squares) of the mean gradient over ranks (still loss-scaled),
        the same on every rank (module Note)."""
        self.settle()
        found, ss = self.owner.stats()
        if self.comm.world > 1:
            both = torch.tensor([float(found), ss], dtype=torch.float64)
            self.comm.all_reduce(both, what="the gradient norm").wait()
            found, ss = bool(both[0] > 0), float(both[1])
        return found, ss * self.mean_scale**2

    def step_ended(self) -> None:
        """A step (or a skipped one) ended: the next gradients start a new accumulation."""
        self.first_micro_step = True
        self._had = self._had | self.seen
        self._fresh_seen()

    def zero(self, set_to_none: bool = True) -> None:
        """The gradients are dropped (``set_to_none=False``: the parameters that had one keep
        a zero gradient in torch's terms, which its next step moves them with)."""
        self.first_micro_step = True
        self._had = set() if set_to_none else self._had | self.seen
        self._fresh_seen(self._had)
        for unit in self.units:
            for p in unit.trainable_params:
                p.grad = None


def _digest(order: list[int]) -> int:
    """A signed 64-bit digest of a list of unit indices, the same in every process."""
    raw = hashlib.blake2b(repr(order).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


class UnitOrderError(PhaseError):
    """The ranks' forwards ran different units (:meth:`ScatteredGrads.backward_begins`): the
    backward is refused before it takes anything, as a misuse of the phases is."""


class _Flight:
    """One unit's reduce-scatter in flight, and the reduction of which of its parameters got a
    gradient on any rank (``seen``): what the owner takes when they land."""

    __slots__ = ("unit", "handle", "share", "first", "slot", "seen", "seen_handle")

    def __init__(self, unit: Unit, handle: Handle, share: torch.Tensor, first: bool, slot: int):
        self.unit, self.handle, self.share, self.first, self.slot = unit, handle, share, first, slot
        self.seen: torch.Tensor | None = None
        self.seen_handle: Handle | None = None


class ScatteredGrads(Grads):
    """Stages 2 and 3 (see the module docstring): one reduce-scatter per unit and micro-step,
    the previous unit's in flight while the next one's backward runs. Device slots of the
    largest unit's gradients: two in the compute dtype's width (one being reduced, one being
    filled), one in a reduce dtype twice as wide.

    Every rank must issue the reductions in one order (gloo pairs them by call order, and units
    padded alike pair without a word). The order units complete is not always the same: one
    whose parameter went unused on one rank (a branch taken by its data) completes only at the
    backward's end there, and its gradients were summed with another unit's (2e-2 off, the
    probe). So they go out in the reverse of the units' first use in the forwards (the same on
    every rank, as the forwards are), then the units no forward used; a unit that completes
    ahead of its turn waits in ``p.grad`` for the ones before it.

    The sums are in ``placement.reduce_dtype`` (module Note on the reduce dtype)."""

    reduces_in_backward = True

    def __init__(self, owner, staging, units, comm, placement) -> None:
        super().__init__(owner, staging, units, comm)
        dtype, device = placement.reduce_dtype, placement.device
        # a sum in fp16: the ranks' mean is taken before the sum, not after it (module Note)
        self._predivide = float(comm.world) if dtype == torch.float16 else 1.0
        self.mean_scale = self._predivide / comm.world
        largest = max((u.layout.trainable for u in units), default=0)
        slots = range(placement.reduce_slots)
        self._send = [torch.empty(largest, dtype=dtype, device=device) for _ in slots]
        self._recv = [torch.empty(largest // comm.world, dtype=dtype, device=device) for _ in slots]
        self._flight: _Flight | None = None
        self._next_slot = 0
        self._used: dict[int, None] = {}  # units by first use in this micro-step's forwards
        self._turns: list[Unit] | None = None  # this backward's order, from its first unit
        self._done: set[int] = set()  # units complete, their reduction not issued yet
        self.seen: set[torch.nn.Parameter] = set()  # got a gradient on some rank
        # whether this backward's reductions carry their units' records (the update in the
        # backward takes each unit as it lands), decided at its first: None until then
        self._carry_seen: bool | None = None
        # whether the last reductions carried their units' records, and whether `seen` is the
        # ranks' agreed record of every gradient so far
        self._seen_with_units = False
        self._seen_agreed = False

    def _fresh_seen(self, kept: set = frozenset()) -> None:
        self.mine, self.seen = set(kept), set(kept)
        self._seen_agreed = False

    def note(self, unit: Unit) -> None:
        super().note(unit)
        self._seen_agreed = False

    def _agree_seen(self) -> None:
        """``seen`` from every rank's record, once per step (after its last reductions): one
        all-reduce over every unit, where the reductions did not carry them."""
        if self._seen_agreed:
            return
        self._seen_agreed = True
        if self._seen_with_units:
            return
        units = [u for u in self.units if u.layout.trainable]
        if units:
            seen, handle = self._reduce_seen(units)
            handle.wait()
            self._add_seen(units, seen)

    def forward_use(self, unit: Unit) -> None:
        self._used.setdefault(unit.index)

    def backward_begins(self, agree: Callable[[int], bool] | None = None) -> None:
        """The order this backward reduces in, the same on every rank or an error on each
        before any reduction. A rank whose forwards skipped a whole unit (a data-dependent
        branch around it: MoE experts made units) reduced it last, so the ranks' reductions
        paired units of the same size silently and the rest ended in gloo aborting one
        process (``EnforceNotMet``) or in ``distributed.timeout``. One small gather of each
        rank's order, not counted with the gradients' collectives (``offload.dist``). Where the
        forward gathers (stage 3; at stage 2 the first forward after a step, which gathers each
        unit's updated shares as it uses it) the ranks' gathers already differ (one rank
        gathers a unit the other does not), so the check is reached only where they happened
        to pair (the look-ahead gathered the skipped unit anyway); otherwise the ranks stop at
        ``distributed.timeout`` or gloo aborts a process, as before. The ranks' check before
        the backward (``agree``) carries a digest of the order: the orders themselves are
        gathered, to name the units, only where the digests differ."""
        if self._turns is not None:
            return  # (a backward that was entered twice before its first unit)
        used = [self.units[i] for i in reversed(self._used)]
        rest = [u for u in reversed(self.units) if u.index not in self._used]
        self._turns = [u for u in used + rest if u.layout.trainable]
        mine = [u.index for u in self._turns]
        if agree is not None and agree(_digest(mine)):
            return
        orders = self.comm.all_gather_object(mine, what="the units of this backward's forwards")
        for rank, theirs in enumerate(orders):
            if theirs != mine:
                raise UnitOrderError(self._describe(orders, rank))

    def _describe(self, orders: list[list[int]], other: int) -> str:
        me = self.comm.rank
        label = {u.index: u.label for u in self.units}
        used = {r: [label[i] for i in order] for r, order in enumerate(orders)}
        return (
            f"offload: the ranks' forwards ran different units before this backward (units "
            f"in the order their gradients are reduced, those no forward ran last: rank {me} "
            f"{used[me]}, rank {other} {used[other]}). Stages 2 and 3 reduce each unit's "
            "gradients across ranks in the order the forwards used them, which must be the "
            "same on every rank: a data-dependent branch around a whole unit is not "
            "supported. Keep such branches inside one unit (wrap.module_classes: a parent "
            "module of the branch)"
        )

    def unit_done(self, unit: Unit) -> None:
        if not unit.layout.trainable:
            return  # nothing to reduce: no turn (a frozen unit must not hold the others)
        self.note(unit)
        if self._turns is None:
            self.backward_begins()
        self._done.add(unit.index)
        with torch.profiler.record_function("offload::grads"):
            while self._turns and self._turns[0].index in self._done:
                turn = self._turns.pop(0)
                self._done.discard(turn.index)
                self._reduce(turn, self.first_micro_step)
                # the update in the backward takes each unit landed before the next lands: its
                # owner's hand-over holds few pieces, and one call reducing the units that
                # waited for their turn (a parameter some rank left unused) stopped in the
                # second's hand-over, the update waiting for the first (both ranks hung)
                self.between()

    def _new_order(self) -> None:
        """The next micro-step's forwards record their order afresh (and its backward asks
        afresh whether its reductions carry their records)."""
        self._used, self._turns, self._done = {}, None, set()
        self._carry_seen = None

    def _reduce(self, unit: Unit, first: bool) -> None:
        """Flattens the unit's gradients, starts their reduce-scatter, then hands the previous
        unit's reduced share to the owner (its reduction overlapped this unit's backward)."""
        n = unit.layout.trainable
        if n == 0:
            return
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self._send)
        if self._flight is not None and self._flight.slot == slot:
            self.drain()  # one slot (a wider reduce dtype): the previous one lands first
        send = self._send[slot][:n]
        self._flatten(unit, send)
        if self._predivide != 1.0:
            send.div_(self._predivide)
        for p in unit.trainable_params:
            p.grad = None  # flattened: the device copy is not needed any more
        share = self._recv[slot][: n // self.comm.world]
        handle = self.comm.reduce_scatter(share, send, what=f"{unit.label} gradients")
        flight = _Flight(unit, handle, share, first, slot)
        # Whether the update takes the units as they land is asked once a backward: every
        # rank's collectives must be the same, and a rank whose update fails ends its
        # hand-over (HeldNvmeGrads.abandon, on the update's thread) in the middle of its
        # backward, before the error that stops it is recorded. Asked per unit, that rank
        # left out the next unit's record and went on to the reduction after it, which the
        # other rank received as that record: gloo aborted it ("Received data size doesn't
        # match", 8192 vs 2 bytes) instead of its collective naming the failed rank
        # (tests/test_dist.py, ..._update_fails_does_not_hang_the_others, 2026-12-07)
        if self._carry_seen is None:
            self._carry_seen = self.owner.handing
        if self._carry_seen:  # the update takes this unit as it lands: its record with it
            flight.seen, flight.seen_handle = self._reduce_seen([unit])
        self._seen_with_units = self._carry_seen
        previous, self._flight = self._flight, flight
        if previous is not None:
            self._land(previous)

    def _flatten(self, unit: Unit, out: torch.Tensor) -> None:
        """``out[:trainable]`` becomes the unit's gradients to reduce (a device-side copy)."""
        self.staging.flatten(unit, out)

    def _reduce_seen(self, units: list[Unit]) -> tuple[torch.Tensor, Handle]:
        """Starts the all-reduce (max) of which trainable parameters of ``units`` got a gradient
        on this rank: after it, on any."""
        seen = torch.tensor(
            [p in self.mine for u in units for p in u.trainable_params], dtype=torch.uint8
        )
        label = units[0].label if len(units) == 1 else f"{len(units)} units'"
        return seen, self.comm.all_reduce(
            seen, op="max", what=f"{label} parameters with a gradient"
        )

    def _add_seen(self, units: list[Unit], seen: torch.Tensor) -> None:
        params = [p for u in units for p in u.trainable_params]
        self.seen.update(p for p, got in zip(params, seen.tolist(), strict=True) if got)

    def _land(self, flight: _Flight) -> None:
        flight.handle.wait()
        if flight.seen_handle is not None:
            flight.seen_handle.wait()
            self._add_seen([flight.unit], flight.seen)
        host = self.staging.share_to_host(flight.share)
        lo, hi = flight.unit.layout.local_trainable
        self.owner.absorb(flight.unit, lambda: [(lo, hi, host)], flight.first)
        self._taken.append(flight.unit)

    def drain(self) -> None:
        flight, self._flight = self._flight, None
        if flight is not None:
            self._land(flight)

    def backward_done(self) -> None:
        self.drain()
        self._new_order()
        super().backward_done()

    def backward_failed(self) -> None:
        super().backward_failed()
        self._new_order()

    def settle(self) -> None:
        self.drain()
        self._agree_seen()


class _GradSums:
    """Where stage 1 adds a step's micro-steps: autograd adds them in ``p.grad``, in the
    compute dtype (``distributed.grad_accum_dtype`` the compute dtype, or fp32 compute)."""

    def __init__(self, staging: GradStaging) -> None:
        self.staging = staging

    def later_backward(self, units: list[Unit]) -> None:
        """A backward of the step after its first begins (before it adds anything)."""

    def unit_done(self, unit: Unit) -> None:
        """``unit``'s gradients of this backward are final."""

    def flatten(self, unit: Unit, out: torch.Tensor) -> None:
        """``out[:trainable]`` becomes the unit's sum of this step's micro-steps (the input of
        its reduction)."""
        self.staging.flatten(unit, out)

    def clear(self) -> None:
        """The step's gradients were reduced or dropped."""


class _WideSums(_GradSums):
    """A step's micro-steps added in a dtype wider than the compute dtype (fp32; module Note
    on the accumulation dtype): the first stays in ``p.grad``; the next backward begins by
    moving every unit's into a flat sum of its own on the device, into which each later
    micro-step's gradients are added as its unit's backward ends. A unit's sum is freed once
    its reduction has copied it, so a step of one micro-step holds nothing more than
    ``p.grad``."""

    def __init__(self, staging: GradStaging, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(staging)
        self.dtype, self.device = dtype, device
        self._sums: dict[int, torch.Tensor] = {}  # unit index -> its micro-steps' sum so far

    def later_backward(self, units: list[Unit]) -> None:
        for unit in units:
            self._add(unit)

    def unit_done(self, unit: Unit) -> None:
        if unit.index in self._sums:
            self._add(unit)
        # (else this is the unit's first micro-step with gradients: they stay in p.grad)

    def _add(self, unit: Unit) -> None:
        """Adds the unit's ``p.grad`` into its sum (the first it takes becomes the sum) and
        drops it, so that autograd's next micro-step starts from none."""
        parts = [(a, b, g) for a, b, g in grad_parts(unit) if g is not None]
        if not parts:
            return
        total = self._sums.get(unit.index)
        if total is None:
            total = torch.empty(unit.layout.trainable, dtype=self.dtype, device=self.device)
            self.staging.flatten(unit, total)
            self._sums[unit.index] = total
        else:
            for a, b, g in parts:
                total[a:b].add_(g)
        for p in unit.trainable_params:
            p.grad = None

    def flatten(self, unit: Unit, out: torch.Tensor) -> None:
        total = self._sums.pop(unit.index, None)
        if total is None:
            super().flatten(unit, out)  # one micro-step's gradients, still in p.grad
        else:
            out.copy_(total)

    def clear(self) -> None:
        self._sums.clear()


class StepScatteredGrads(ScatteredGrads):
    """Stage 1 (see the module docstring): a step's gradients stay on the device across its
    micro-steps, added in ``placement.grad_accum_dtype`` (:class:`_WideSums` where that is
    wider than the compute dtype, else in ``p.grad``), and are reduce-scattered once per
    step."""

    reduces_in_backward = False

    def __init__(self, owner, staging, units, comm, placement) -> None:
        super().__init__(owner, staging, units, comm, placement)
        self._settled = True  # no gradient on the device that the owner has not taken
        self._fresh = True  # the owner's next reduced gradients overwrite
        wide = placement.grad_accum_dtype.itemsize > placement.dtype.itemsize
        self._sums = (
            _WideSums(staging, placement.grad_accum_dtype, placement.device)
            if wide
            else _GradSums(staging)
        )

    def unit_begins(self, unit: Unit) -> None:
        pass  # its gradients go to the owner at the step, not at the end of this backward

    def backward_begins(self, agree: Callable[[int], bool] | None = None) -> None:
        # every unit is reduced at the step, in the units' own order: no order to agree on
        if not self.first_micro_step:
            self._sums.later_backward(self.units)

    def unit_done(self, unit: Unit) -> None:
        self._settled = False  # autograd accumulated this backward's gradients in p.grad
        self.note(unit)
        self._sums.unit_done(unit)

    def _flatten(self, unit: Unit, out: torch.Tensor) -> None:
        self._sums.flatten(unit, out)

    def backward_done(self) -> None:
        Grads.backward_done(self)

    def settle(self) -> None:
        if self._settled:
            return
        with torch.profiler.record_function("offload::grads"):
            for unit in self.units:
                if unit.trainable_params:
                    self._reduce(unit, first=self._fresh)
            self.drain()
            self._agree_seen()
        self._settled, self._fresh = True, False

    def step_ended(self) -> None:
        super().step_ended()
        self._fresh = True
        self._sums.clear()

    def zero(self, set_to_none: bool = True) -> None:
        super().zero(set_to_none)
        self._settled, self._fresh = True, True
        self._sums.clear()
