"""Where the fp32 master weights, Adam moments and fp32 gradients live
(``offload_optimizer.device``), and the per-unit optimizer step over them.

- :class:`HostOptimState` (``"cpu"``): flat fp32 host tensors per unit. The step is one native
  CPU Adam call per unit (the kernel's thread pool splits it), writing the new compute params
  straight into their home through ``out=``.
- :class:`NvmeOptimState` (``"nvme"``): one NVMe shard per (unit, piece, kind) for master,
  exp_avg, exp_avg_sq and grad, streamed through the ``offload_optimizer`` buffer pool. Host RAM
  never holds a model-sized fp32 buffer.

Note: gradients
    When a unit's backward completes its gradients are accumulated into the fp32 grad shard
    with the native one-pass kernel, which also reports inf/NaN and the sum of squares of the
    result. On the CPU they are read straight from each ``p.grad`` (:class:`GradParts`, zero
    where a parameter got no grad); on CUDA they are first flattened on the device into one
    staging buffer and copied to the host in one transfer.
    The first micro-step after ``zero_grad`` overwrites instead of adding, so nothing is ever
    zeroed and, on NVMe, the first write needs no read. The latest sum of squares per unit (or
    piece) gives the global norm for clipping without another pass.

    One special case keeps the CPU tier at the speed of plain PyTorch: with the compute device
    being the CPU, fp32 compute and the optimizer on the CPU (``KeepGrads``), gradients already
    are where the optimizer runs, so they stay in ``p.grad`` (autograd accumulates them) and the
    step reads them in place; the master is the parameter itself.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from offload.engine.params import ParamHome
from offload.engine.units import Unit
from offload.optim import accumulate_grad, adam_step
from offload.optim.kernels import AdamGroup


@dataclass(slots=True)
class Hyper:
    """The hyperparameters of one step."""

    step: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool
    grad_scale: float

    def kwargs(self) -> dict:
        return dict(
            step=self.step,
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            weight_decay=self.weight_decay,
            adamw_mode=self.adamw_mode,
            bias_correction=self.bias_correction,
            grad_scale=self.grad_scale,
        )


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


@dataclass(slots=True)
class GradRecord:
    """Latest accumulation result of one unit or piece."""

    found_inf: bool = False
    sumsq: float = 0.0


class UnitFeed:
    """Units handed to a background step while it runs: the step with
    ``offload_optimizer.step_in_backward`` gets each unit as its backward completes.
    :meth:`poll` never blocks (None: nothing yet); :meth:`take` waits (None: the feed is closed
    and empty). Iterating takes until the end."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: deque[Unit] = deque()
        self._closed = False

    def put(self, unit: Unit) -> None:
        with self._cond:
            self._items.append(unit)
            self._cond.notify_all()

    def close(self, reorder=None) -> None:
        """No more units; ``reorder`` (a sort key) reorders those not taken yet."""
        with self._cond:
            if reorder is not None:
                self._items = deque(sorted(self._items, key=reorder))
            self._closed = True
            self._cond.notify_all()

    def poll(self) -> Unit | None:
        with self._cond:
            return self._items.popleft() if self._items else None

    def take(self) -> Unit | None:
        with self._cond:
            while not self._items and not self._closed:
                self._cond.wait()
            return self._items.popleft() if self._items else None

    def __iter__(self):
        while (unit := self.take()) is not None:
            yield unit


class OptimState:
    """Interface of the optimizer-state placement strategies."""

    keeps_grads = False  # grads stay in p.grad (see the module Note)
    defers = False  # the step runs in the background into the next forward (engine Note)
    in_backward = False  # each unit is updated as its backward completes (engine Note)

    def setup(self, unit: Unit, params: ParamHome, master: torch.Tensor | None) -> None:
        """Creates the unit's state; ``master`` holds the fp32 initial values of ``[0, trainable)``."""
        raise NotImplementedError

    def sink_grads(self, unit: Unit, grad: GradParts, first: bool) -> None:
        """Accumulates the unit's host gradient into its fp32 grads (overwrites when ``first``)."""
        raise NotImplementedError

    def grad_stats(self) -> tuple[bool, float]:
        """(any inf/NaN, sum of squares) over all accumulated grads."""
        recs = [r for rs in self.records.values() for r in rs]
        return any(r.found_inf for r in recs), sum(r.sumsq for r in recs)

    def step_units(
        self, units: Iterable[Unit], params: ParamHome, hyper: Hyper, on_unit_done=None
    ) -> None:
        """One optimizer step over every unit's state, writing new compute params home;
        ``on_unit_done(unit)`` is called as each unit's update is complete. ``units`` may be a
        :class:`UnitFeed` that is still being filled."""
        for unit in units:
            self.step(unit, params, hyper)
            if on_unit_done is not None:
                on_unit_done(unit)

    def step(self, unit: Unit, params: ParamHome, hyper: Hyper) -> None:
        raise NotImplementedError

    def pieces(self, unit: Unit) -> list[tuple[int, int]]:
        raise NotImplementedError

    def master_is_compute(self, unit: Unit) -> bool:
        """Whether the master is the compute params' own buffer (writing one writes both)."""
        return False

    def read(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor:
        """Host fp32 copy of ``kind`` in {"master", "exp_avg", "exp_avg_sq"} over a piece."""
        raise NotImplementedError

    def write(self, unit: Unit, kind: str, lo: int, hi: int, values: torch.Tensor) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


KINDS = ("master", "exp_avg", "exp_avg_sq")


class _Ready:
    """A fetch that is already complete: a grad piece handed over in its buffer."""

    __slots__ = ("buf",)

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf

    def wait(self) -> torch.Tensor:
        return self.buf


class HostOptimState(OptimState):
    def __init__(self, *, pin: bool, keep_grads: bool, transfers) -> None:
        self.pin, self.keeps_grads, self.transfers = pin, keep_grads, transfers
        self.bufs: dict[int, dict[str, torch.Tensor]] = {}
        self.aliased: dict[int, bool] = {}  # master is the compute params' own fp32 buffer
        self._groups: dict[int, tuple] = {}  # unit -> (AdamGroup, segments), keep_grads only
        self.records: dict[int, list[GradRecord]] = {}

    def setup(self, unit: Unit, params: ParamHome, master: torch.Tensor | None) -> None:
        n = unit.layout.trainable
        if n == 0:
            return
        alias = params.master_alias(unit)
        master = alias if alias is not None else master
        bufs = {
            "master": master,
            "exp_avg": torch.zeros(n, dtype=torch.float32),
            "exp_avg_sq": torch.zeros(n, dtype=torch.float32),
        }
        if not self.keeps_grads:
            bufs["grad"] = self.transfers.host_empty(n, torch.float32, self.pin)
        self.bufs[unit.index] = bufs
        self.records[unit.index] = [GradRecord()]
        self.aliased[unit.index] = alias is not None

    def sink_grads(self, unit: Unit, grad: GradParts, first: bool) -> None:
        self.records[unit.index][0] = grad.accumulate(self.bufs[unit.index]["grad"], 0, first)

    def pieces(self, unit: Unit) -> list[tuple[int, int]]:
        n = unit.layout.trainable
        return [(0, n)] if n else []

    def master_is_compute(self, unit: Unit) -> bool:
        return self.aliased.get(unit.index, False)

    def step(self, unit: Unit, params: ParamHome, hyper: Hyper) -> None:
        bufs = self.bufs.get(unit.index)
        if bufs is None:
            return
        n = unit.layout.trainable
        aliased = self.aliased[unit.index]
        if self.keeps_grads:  # per parameter, grads in place (see the module Note)
            group, segs = self._group(unit, params, aliased)
            grads = [s.param.grad for s in segs]
            if any(g is None for g in grads):  # some parameter got no grad: skip it this step
                live = [i for i, g in enumerate(grads) if g is not None]
                sub = AdamGroup(
                    *[[t[i] for i in live] if t is not None else None for t in group.tensors]
                )
                group, grads, segs = sub, [grads[i] for i in live], [segs[i] for i in live]
            group.step([g.view(-1) for g in grads], **hyper.kwargs())
            if not aliased:
                for s in segs:
                    params.commit(unit, s.offset, s.end)
            return
        if aliased:
            adam_step(
                bufs["master"], bufs["grad"], bufs["exp_avg"], bufs["exp_avg_sq"], **hyper.kwargs()
            )
            return
        for lo, hi in params.pieces_in(unit, 0, n):
            adam_step(
                bufs["master"][lo:hi],
                bufs["grad"][lo:hi],
                bufs["exp_avg"][lo:hi],
                bufs["exp_avg_sq"][lo:hi],
                **hyper.kwargs(),
                out=params.out_buffer(unit, lo, hi),
            )
            params.commit(unit, lo, hi)

    def _group(self, unit: Unit, params: ParamHome, aliased: bool) -> tuple[AdamGroup, list]:
        """The unit's trainable segments as one prepared AdamGroup (built on first use)."""
        cached = self._groups.get(unit.index)
        if cached is None:
            bufs = self.bufs[unit.index]
            segs = [s for s in unit.layout.segments if s.trainable]
            sl = [slice(s.offset, s.end) for s in segs]
            outs = None if aliased else [params.out_buffer(unit, s.offset, s.end) for s in segs]
            group = AdamGroup(
                [bufs["master"][x] for x in sl],
                [bufs["exp_avg"][x] for x in sl],
                [bufs["exp_avg_sq"][x] for x in sl],
                outs,
            )
            cached = self._groups[unit.index] = (group, segs)
        return cached

    def read(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor:
        return self.bufs[unit.index][kind][lo:hi].clone()

    def write(self, unit: Unit, kind: str, lo: int, hi: int, values: torch.Tensor) -> None:
        self.bufs[unit.index][kind][lo:hi].copy_(values)


class NvmeOptimState(OptimState):
    defers = True  # disk-bound: see offload.engine.engine, Note: the background NVMe step

    def __init__(
        self, store, piece_numel: int, lookahead: int, *, in_backward: bool = False, hold: int = 0
    ) -> None:
        from offload.store import Tier  # noqa: PLC0415

        self.lookahead = lookahead  # pieces whose reads are issued ahead of the one updated
        # step_in_backward: grad pieces the backward hands to the step still in their buffers
        # (at most `hold` at a time; see sink_grads)
        self.in_backward, self.hold = in_backward, hold
        self._handoff: dict[str, torch.Tensor] = {}
        self._held = 0
        self._held_cond = threading.Condition()
        self.store, self.piece_numel, self.tier, self._nvme = (
            store,
            piece_numel,
            Tier.HOST,
            Tier.NVME,
        )
        self._pieces: dict[int, list[tuple[int, int]]] = {}
        self.records: dict[int, list[GradRecord]] = {}

    @staticmethod
    def key(unit: Unit, kind: str, lo: int) -> str:
        return f"{kind}.u{unit.index}.{lo}"

    def setup(self, unit: Unit, params: ParamHome, master: torch.Tensor | None) -> None:
        n = unit.layout.trainable
        pieces = unit.layout.pieces(self.piece_numel, n)
        self._pieces[unit.index] = pieces
        self.records[unit.index] = [GradRecord() for _ in pieces]
        for lo, hi in pieces:
            self.store.register(
                self.key(unit, "master", lo), hi - lo, torch.float32, self._nvme, init=master[lo:hi]
            )
            for kind in ("exp_avg", "exp_avg_sq", "grad"):
                self.store.register(self.key(unit, kind, lo), hi - lo, torch.float32, self._nvme)

    def pieces(self, unit: Unit) -> list[tuple[int, int]]:
        return self._pieces.get(unit.index, [])

    def sink_grads(self, unit: Unit, grad: GradParts, first: bool) -> None:
        if self.in_backward:
            self._hand_off(unit, grad)
            return
        recs = self.records[unit.index]
        for j, (lo, hi) in enumerate(self.pieces(unit)):
            key = self.key(unit, "grad", lo)
            if not first:  # an overwrite reads nothing: keep it out of the prefetch trace
                self.store.use(key, self.tier)
            buf = self.store.fetch(key, self.tier, read=not first).wait()
            recs[j] = grad.accumulate(buf[: hi - lo], lo, first)
            self.store.release(key, self.tier, dirty=True)

    def _hand_off(self, unit: Unit, grad: GradParts) -> None:
        """step_in_backward: writes the unit's gradient into its grad pieces and leaves up to
        ``hold`` of them in their buffers for the step (no disk write, no read back). The rest
        are released dirty (written, and read back by the step). Waits while the step still
        holds earlier pieces and this unit's would exceed ``hold``: the backward then runs at
        the step's pace instead of taking every buffer."""
        pieces = self.pieces(unit)
        with self._held_cond:
            while self._held and self._held + len(pieces) > self.hold:
                self._held_cond.wait()
        recs = self.records[unit.index]
        for j, (lo, hi) in enumerate(pieces):
            key = self.key(unit, "grad", lo)
            buf = self.store.fetch(key, self.tier, read=False).wait()
            recs[j] = grad.accumulate(buf[: hi - lo], lo, True)
            with self._held_cond:
                keep = self._held < self.hold
                if keep:
                    self._held += 1
                    self._handoff[key] = buf
            if not keep:
                self.store.release(key, self.tier, dirty=True)

    def _grad_future(self, key: str):
        with self._held_cond:
            buf = self._handoff.pop(key, None)
        return self.store.fetch(key, self.tier) if buf is None else _Ready(buf)

    def _drop_grad(self, key: str, fut) -> None:
        if not self.in_backward:
            self.store.release(key, self.tier)
            return
        self.store.release(key, self.tier, discard=True)  # consumed: never written
        if isinstance(fut, _Ready):  # one of the `hold` buffers the backward filled
            with self._held_cond:
                self._held -= 1
                self._held_cond.notify_all()

    def step_units(
        self, units: Iterable[Unit], params: ParamHome, hyper: Hyper, on_unit_done=None
    ) -> None:
        """Streams every piece through the pool: the reads of the next ``lookahead`` pieces are
        in flight while piece ``j`` is updated and piece ``j - 1`` is written back (the store
        writes released dirty shards asynchronously). The step's order is known exactly, so it
        issues its own fetches instead of going through the store's trace prefetcher. From a
        :class:`UnitFeed` it looks ahead only over units already handed in."""
        feed = units if isinstance(units, UnitFeed) else None
        source = None if feed is not None else iter(units)
        queued: deque = deque()  # (unit, lo, hi, last piece of its unit), not fetched yet
        ahead: deque = deque()  # the same with (keys, futures), fetches issued

        def more(block: bool) -> bool:
            if feed is None:
                unit = next(source, None)
            else:
                unit = feed.take() if block else feed.poll()
            if unit is None:
                return False
            pieces = self.pieces(unit)
            queued.extend((unit, lo, hi, j + 1 == len(pieces)) for j, (lo, hi) in enumerate(pieces))
            return True

        try:
            while True:
                while len(ahead) <= self.lookahead:
                    if not queued and not more(block=not ahead):
                        break
                    if queued:
                        unit, lo, hi, last = queued.popleft()
                        keys = [self.key(unit, k, lo) for k in (*KINDS, "grad")]
                        futs = [self.store.fetch(k, self.tier) for k in keys[:3]]
                        futs.append(self._grad_future(keys[3]))
                        ahead.append((unit, lo, hi, last, keys, futs))
                if not ahead:
                    return
                unit, lo, hi, last, keys, futs = ahead.popleft()
                master, exp_avg, exp_avg_sq, grad = (f.wait() for f in futs)
                out = params.out_buffer(unit, lo, hi)
                adam_step(master, grad, exp_avg, exp_avg_sq, **hyper.kwargs(), out=out)
                params.commit(unit, lo, hi)
                for k in keys[:3]:
                    self.store.release(k, self.tier, dirty=True)
                self._drop_grad(keys[3], futs[3])
                if on_unit_done is not None and last:
                    on_unit_done(unit)
        finally:
            if self.in_backward:  # a failed step: the backward must not wait on it any more
                with self._held_cond:
                    left, self._handoff = list(self._handoff), {}
                    self._held = 0
                    self._held_cond.notify_all()
                for key in left:
                    self.store.release(key, self.tier, discard=True)

    def read(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=torch.float32)
        self.store.read_into(self.key(unit, kind, lo), out)
        return out

    def write(self, unit: Unit, kind: str, lo: int, hi: int, values: torch.Tensor) -> None:
        self.store.write_from(self.key(unit, kind, lo), values.to(torch.float32).contiguous())
