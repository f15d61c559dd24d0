"""Where each unit's compute parameters live between uses (``offload_param.device``).

One home is built at wrap time (from the plan); the runtime calls the same methods whatever it
is. "Load my shard" and "unshard" are separate calls: :meth:`ParamHome.create` and
:meth:`ParamHome.load_shard` fill the home's own bytes (this rank's share, piece by piece, from
any source of values), :meth:`ParamHome.unshard` makes the unit usable on the compute device and
:meth:`ParamHome.reshard` drops that working copy.

- :class:`DeviceParams` (``"none"``): a flat device buffer per unit; the parameters are views
  into it and never released. The optimizer writes updated values into it through the device's
  writer (``offload.device.DeviceWriter``).
- :class:`HostParams` (``"cpu"``): the home is a flat host buffer (pinned on CUDA); a forward or
  backward gathers the unit into the parameters' own storages and releases them after.
- :class:`NvmeParams` (``"nvme"``): the home is NVMe, one shard per piece, streamed through the
  ``offload_param`` buffer pool by the tiered store (whose trace-driven prefetcher brings the next
  units in while this one computes).

Note: gather and release keep the Parameter objects
    Releasing frees a parameter's storage in place; gathering gives it back and copies into
    ``p.data``, which does not bump the autograd version counter, so tensors that autograd
    saved in forward stay valid for backward. Nobody outside sees a new tensor. How the storage
    is freed and given back is the device's (``offload.device.storage_for``: page-released
    blocks on the CPU, resized storages on CUDA).

Note: the gather's window
    An NVMe gather keeps at most ``param_window`` pieces in flight (the pool must keep a buffer
    free for the trace prefetcher's demand, and the update's share when these shards are the
    master: ``offload.plan.placement``'s Note on the param pool). A pool buffer goes back to
    the store once its copy to the device has completed; the host waits for those copies once
    per unit, not per piece. On the CPU a unit released after each use is not copied into:
    each piece's buffer lends its pages to the unit's storage until the release
    (``offload.device.pages``, Note on lent pages), in buffers the pool has on top of
    ``offload_param.buffer_count`` (:meth:`NvmeParams.lend_slots`: the largest such unit's
    pieces; a unit that finds them taken, by another one gathered meanwhile, is copied).

Note: the pool's buffer size
    Everything the param store holds in a buffer is one of ``Plan.pieces``' pieces (a gather's,
    a read ahead's, the update's where these shards are the master; reads and writes outside
    the pool, a checkpoint's, have buffers of their own: ``offload.store.store``, Note on
    synchronous access), so no buffer is filled beyond the largest of them. The pool's buffers
    are that piece's bytes, rounded up to the IO alignment, at most ``offload_param.buffer_size``
    and at least one IO request, as "auto" sizes them (:meth:`NvmeParams.buffer_bytes`;
    ``offload.config.auto_size``: a model of units below ``aio.block_size``, 1 MiB by default,
    keeps buffers of that, at most 1 MiB more a lent buffer than its unit). They were
    ``buffer_size`` each, allocated and populated whole (``offload.io.aligned``), the lent ones
    too, so a ``buffer_size`` larger than a unit (DeepSpeed configs set 1e8 elements) made each
    lent buffer cost that size instead of the piece of the unit it stands in for: params and
    optimizer on NVMe, fp32, 8 blocks of 8 MiB, ``buffer_count`` 1, 128 MiB buffers, training's
    peak RSS growth was 366-374 MiB against README's budget of 256 (a lent buffer of 128 MiB for
    a unit of 8), and is 126-130 now (8 MiB buffers, which this leaves as they were: 126-138
    against 136; 2026-12-08, ``tests/test_lent_slots.py``).

Note: across ranks
    Stages 1 and 2 (:class:`DeviceParams`, :class:`HostParams`, :class:`NvmeParams` with more
    than one rank): the home holds the whole unit, but each rank's update writes only its own
    share of the trainable prefix, so after an update (or a load) the other shares are stale.
    :meth:`ParamHome.refresh`, called before the unit's next use in a forward, all-gathers them
    (a broadcast per rank and piece on NVMe, where the pool cannot hold every rank's piece at
    once), with the next unit's all-gather in flight while this one computes. Whether the next
    unit is gathered ahead is asked only once its own update is done on this rank (``gate``):
    its update marks it stale, so the answer must not depend on how far each rank's
    background update has got.

    Stage 3 (:class:`ShardedParams`): an inner home of any of the three kinds holds this rank's
    share only (``Plan.home_regions``, packed at ``Plan.home_slice``); ``unshard`` brings the
    share to the compute device and all-gathers the trainable prefix and the frozen suffix
    into the unit's storage, and starts the next unit's gather before returning, so it runs
    while this one computes. The next unit comes from :class:`Lookahead` (the order of the
    first iteration, the same on every rank, so every rank issues the same collectives in the
    same order) and is gathered only once its pending update is done on this rank (``gate``,
    set by the runtime).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable

import torch

from offload._interrupts import interrupts_deferred
from offload.device import COMPLETED, Event, HostMemory, Transfers, pages, storage_for
from offload.dist import Comm, Handle, LocalComm, completed
from offload.homes.piece_prints import NoPrints, PiecePrints
from offload.plan import Plan, Residency, ShardSpec, Unit, split

PieceValues = Callable[[int, int], torch.Tensor]
"""``(lo, hi) -> values`` of a unit's elements ``[lo, hi)`` in the compute dtype."""


def _param_view(seg) -> torch.Tensor:
    return seg.param.data.view(-1)


class Lookahead:
    """The order in which units are used, learned in the first iteration and replayed, so a
    collective can be issued one unit ahead (see the module Note on ranks). Every call is
    recorded, repeated units included, so the prediction depends only on the sequence of
    calls, never on timing."""

    __slots__ = ("trace", "learning", "pos")

    def __init__(self) -> None:
        self.trace: list[int] = []
        self.learning = True
        self.pos = 0

    def record(self, index: int) -> int | None:
        """Unit ``index`` is used now; returns the unit expected next (None: not known)."""
        if self.learning:
            self.trace.append(index)
            return None
        n = len(self.trace)
        for k in range(n):
            j = (self.pos + k) % n
            if self.trace[j] == index:
                self.pos = j + 1
                return self.trace[self.pos] if self.pos < n else None
        return None

    def end_iteration(self) -> None:
        if self.trace:
            self.learning = False
        self.pos = 0


def _no_gate(unit: Unit) -> None:
    pass


class GatheredFlag:
    """Whether one unit's parameters are gathered; written by its home alone."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


class _Gathered:
    """The gathered units, as a set of unit indices reads, kept as one flag per unit: a hook
    traced by ``torch.compile`` that checks its unit's flag (``ParamHome.flag``) is guarded on
    that flag alone. A membership test of a set was guarded on the whole set's contents, and
    of a list on the unit's index: every unit recompiled the user's block forward."""

    def __init__(self, units: int) -> None:
        self.flags = [GatheredFlag() for _ in range(units)]

    def __contains__(self, index: int) -> bool:
        return self.flags[index].on

    def add(self, index: int) -> None:
        self.flags[index].on = True

    def discard(self, index: int) -> None:
        self.flags[index].on = False


class ParamHome:
    """Interface of the parameter homes (see the module docstring)."""

    def __init__(
        self, plan: Plan, transfers: Transfers, memory: HostMemory, comm: Comm | None = None
    ) -> None:
        self.plan, self.transfers, self.memory = plan, transfers, memory
        self.comm = comm or LocalComm()
        self.device, self.dtype = plan.placement.device, plan.placement.dtype
        self._gathered = _Gathered(len(plan.units))
        self._pending: Event = COMPLETED  # the last copy out of a host home
        # stages 1-2 across ranks (module Note): units whose other ranks' shares are stale
        self._replicated = plan.shard.world > 1 and not plan.placement.shard_params
        self._stale: set[int] = set()
        self._refreshing: dict[int, Handle] = {}
        self.order = Lookahead()
        self.gate: Callable[[Unit], None] = _no_gate  # waits for the unit's pending update

    def create(self, unit: Unit, values: PieceValues) -> None:
        """Builds the unit's home from ``values`` of each piece (wrap time). The parameters
        keep their own storage until :meth:`attach`, so their values can be read meanwhile."""
        raise NotImplementedError

    def attach(self, unit: Unit) -> None:
        """Points the unit's parameters at their working storage (wrap time, after every other
        home has read their old values)."""
        raise NotImplementedError

    def load_shard(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        """Overwrites compute values of elements ``[lo, hi)`` (a piece) in the home; a gathered
        copy of the unit is stale afterwards (the caller reshards it). ``values`` may be in any
        dtype (a load passes the fp32 master): the home converts them as it writes them, on
        NVMe a staging chunk at a time. The callers' compute-dtype copy of each piece went
        through glibc's heap, and the next unit's did not fit the hole it left (small blocks
        were taken from it meanwhile): a load grew the heap by a piece per unit, pages that a
        resumed run's steps then touched and kept (``offload.api.checkpoint``, Note: what a
        load leaves in host memory)."""
        out = self.out_buffer(unit, lo, hi)
        out.copy_(values)
        self.commit(unit, lo, hi)

    def unshard(self, unit: Unit) -> None:
        """Makes the unit's parameters usable on the compute device (idempotent)."""

    def reshard(self, unit: Unit) -> None:
        """Drops the unit's working copy (idempotent)."""

    # -- stages 1 and 2 across ranks (module Note) -----------------------------------------------
    def _written(self, unit: Unit, lo: int) -> None:
        """Elements from ``lo`` were written by this rank: other ranks' shares are stale."""
        if self._replicated and lo < unit.layout.trainable:
            self._stale.add(unit.index)

    def loaded(self, unit: Unit) -> None:
        """A load gave values to some of the unit's trainable parameters: every rank calls it
        for the same units, whichever share each wrote (a rank whose share held none of them
        wrote nothing, and the ranks' next forwards would gather different units)."""
        self._written(unit, 0)

    _views = False  # whether the parameters view the home (then they are always "gathered")

    @property
    def releases(self) -> bool:
        """Whether a released unit's parameters lose their values (their storage dropped)."""
        return not self._views

    keeps_across_the_turn = True
    """Whether the forward's last unit may stay gathered into the backward that starts with it
    (``offload.runtime.state``): not where each gather also starts the next one's."""

    def refresh(self, unit: Unit) -> None:
        """Before a use in a forward: the other ranks' shares of the unit's trainable prefix
        are all-gathered into the home if an update or a load made them stale; the next unit's
        all-gather is started (after its own update, ``gate``)."""
        if not self._replicated:
            return
        nxt = self.order.record(unit.index)
        self._finish_refresh(unit)
        if nxt is not None and nxt not in self._refreshing:
            ahead = self.plan.units[nxt]
            # its pending update done before asking whether it is stale: the update marks it
            # so, and where it ran on one rank and not yet on another, the ranks issued
            # different gathers (when the unit did not come next after all, a unit called a
            # varying number of times, gloo aborted a rank on their sizes)
            self.gate(ahead)
            if nxt in self._stale:
                self._refreshing[nxt] = self._start_refresh(ahead)

    def _finish_refresh(self, unit: Unit) -> None:
        handle = self._refreshing.pop(unit.index, None)
        if handle is None and unit.index in self._stale:
            if self.gathered(unit) and not self._views:
                self.reshard(unit)  # a copy of stale values
            handle = self._start_refresh(unit)
        if handle is not None:
            handle.wait()
            self._stale.discard(unit.index)

    def _start_refresh(self, unit: Unit) -> Handle:
        """Issues the all-gather of the unit's trainable shares into the home."""
        raise NotImplementedError

    def end_iteration(self) -> None:
        """A step ended: the order of use is known from now on."""
        self.order.end_iteration()

    def settle(self) -> None:
        """Waits for every collective in flight into the home (before it is rewritten)."""
        for index in list(self._refreshing):
            self._finish_refresh(self.plan.units[index])

    def held(self) -> dict[str, int]:
        """Bytes of compute params this home holds, by where: ``device``, ``host``, ``nvme``."""
        return {}

    def gathered(self, unit: Unit) -> bool:
        return unit.index in self._gathered

    def overwritten(self, unit: Unit) -> list[tuple[int, int]]:
        """Element ranges of ``unit`` that code outside offload wrote and offload then wrote
        over before a check saw it (``offload.homes.piece_prints``' Note); each reported once."""
        return []

    def looked(self, unit: Unit) -> bool:
        """Whether a write into ``unit``'s live storage was looked for since offload last
        wrote it (``DeviceParams``)."""
        return False

    def touched(self, unit: Unit) -> list[tuple[int, int, bool]]:
        """Where code outside offload read or wrote the released ``unit``'s storage since its
        release (``offload.device.pages``, Note on touched blocks): ``(lo, hi, written)``
        element ranges, ``written`` where it was written (not only read); each reported once.
        None where the unit is gathered, or its storage cannot tell."""
        return []

    def flag(self, unit: Unit) -> GatheredFlag:
        """``unit``'s gathered flag, for a hook to read (``_Gathered``)."""
        return self._gathered.flags[unit.index]

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        """Where the optimizer writes updated compute values of elements ``[lo, hi)``."""
        raise NotImplementedError

    def expect_update(self, unit: Unit, pieces: list[tuple[int, int]]) -> None:
        """The update in this backward takes these pieces of ``unit`` next (their
        :meth:`out_buffer`, or the master the home holds), once the unit's gradients are in: a
        home that caches pieces keeps their copies for it."""

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        """The optimizer finished writing ``out_buffer(unit, lo, hi)``."""

    def give_up_out(self, unit: Unit, lo: int, hi: int) -> None:
        """The optimizer failed before committing ``out_buffer(unit, lo, hi)``: the home keeps
        its values from before where it can (an NVMe piece's buffer is dropped unwritten)."""

    def changed(self, unit: Unit, lo: int, hi: int) -> None:
        """Elements ``[lo, hi)`` were updated in place (the home's buffer is the master)."""
        self._written(unit, lo)

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        """Current compute values of elements ``[lo, hi)`` as a new host tensor."""
        raise NotImplementedError

    def master_view(self, unit: Unit) -> torch.Tensor:
        """The home's fp32 host buffer over this rank's trainable share, when it is the master
        (``MasterOwner.PARAMS``; only built then)."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold the fp32 master")

    def quiesce(self, unit: Unit | None = None) -> None:
        """Waits until no copy out of the home is in flight (before the update rewrites it:
        ``unit``'s share only, when given; every share otherwise)."""
        self.settle()
        self.transfers.wait(self._pending, "host->device")
        self._pending = COMPLETED

    def share_on_device(self, unit: Unit) -> torch.Tensor:
        """This rank's share of the unit (its home regions, packed) as a tensor on the compute
        device, for an all-gather (stage 3); valid until the next update of the unit."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class DeviceParams(ParamHome):
    """A flat device buffer per unit (the module docstring). Where ``watch_writes`` (the master
    is apart), a write into it by code outside offload is looked for through
    :class:`~offload.homes.piece_prints.PiecePrints` (its module Note)."""

    _views = True

    def __init__(
        self,
        plan: Plan,
        transfers: Transfers,
        memory: HostMemory,
        writer,
        comm=None,
        watch_writes: bool = False,
    ):
        super().__init__(plan, transfers, memory, comm)
        self.writer = writer
        self.flat: dict[int, torch.Tensor] = {}
        self.prints = PiecePrints(self._piece, writer) if watch_writes else NoPrints()

    def create(self, unit: Unit, values: PieceValues) -> None:
        flat = torch.empty(self.plan.home_numel(unit), dtype=self.dtype, device=self.device)
        for lo, hi in self.plan.pieces(unit):
            dst = flat[self.plan.home_slice(unit, lo, hi)]
            self.transfers.wait(self.transfers.to_device([(dst, values(lo, hi))]), "host->device")
        self.flat[unit.index] = flat
        self.prints.created(unit, self.plan.pieces(unit))

    def _piece(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.flat[unit.index][self.plan.home_slice(unit, lo, hi)]

    def looked(self, unit: Unit) -> bool:
        return self.prints.looked(unit)

    def touched(self, unit: Unit) -> list[tuple[int, int, bool]]:
        """The pieces written by code outside offload since offload last wrote them, each said
        once (none where the home does not watch)."""
        return self.prints.touched(unit, self.plan.pieces(unit))

    def overwritten(self, unit: Unit) -> list[tuple[int, int]]:
        return self.prints.overwritten(unit)

    def attach(self, unit: Unit) -> None:
        flat = self.flat[unit.index]
        for seg in unit.layout.segments:
            seg.param.data = flat[seg.offset : seg.end].view(seg.shape)
        self._gathered.add(unit.index)

    def _slice(self, unit: Unit, lo: int, hi: int) -> tuple[int, int]:
        sl = self.plan.home_slice(unit, lo, hi)
        return sl.start, sl.stop

    def load_shard(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        self.prints.loading(unit, lo)
        super().load_shard(unit, lo, hi, values)

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        self.prints.writing(unit, lo, hi)
        return self.writer.out(self.flat[unit.index], *self._slice(unit, lo, hi))

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        flat, (a, b) = self.flat[unit.index], self._slice(unit, lo, hi)
        self.writer.commit(flat, a, b)
        self.prints.committed(unit, lo, flat, a, b)
        self._written(unit, lo)

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        self.transfers.count("device->host", (hi - lo) * self.dtype.itemsize)
        return self.flat[unit.index][self.plan.home_slice(unit, lo, hi)].to("cpu", copy=True)

    def master_view(self, unit: Unit) -> torch.Tensor:
        return self.flat[unit.index][self.plan.home_slice(unit, *unit.layout.local_trainable)]

    def quiesce(self, unit: Unit | None = None) -> None:
        self.settle()
        self.writer.quiesce()

    def _start_refresh(self, unit: Unit) -> Handle:
        self.writer.quiesce()  # the update's last writes into this buffer have landed
        return _all_gather_trainable(self.comm, unit, self.flat[unit.index])

    def share_on_device(self, unit: Unit) -> torch.Tensor:
        return self.flat[unit.index]

    def held(self) -> dict[str, int]:
        return {"device": sum(t.numel() * t.element_size() for t in self.flat.values())}


def _all_gather_trainable(comm: Comm, unit: Unit, flat: torch.Tensor) -> Handle:
    """Every rank's share of the trainable prefix of a whole-unit home ``flat``, in place."""
    lo, hi = unit.layout.local_trainable
    return comm.all_gather(flat[: unit.layout.trainable], flat[lo:hi], what=f"{unit.label} params")


class _Released(ParamHome):
    """A home whose unit is gathered into the parameters' own storage and released after."""

    def __init__(self, plan: Plan, transfers: Transfers, memory: HostMemory, comm=None) -> None:
        super().__init__(plan, transfers, memory, comm)
        self.storage = storage_for(self.device, self.dtype)

    def attach(self, unit: Unit) -> None:
        """The unit's parameters get their storage and start released."""
        self.storage.attach(unit)
        self.storage.drop(unit)

    def reshard(self, unit: Unit) -> None:
        if unit.index in self._gathered:
            self.storage.drop(unit)
            self._gathered.discard(unit.index)

    def touched(self, unit: Unit) -> list[tuple[int, int, bool]]:
        if unit.index in self._gathered:
            return []
        return self.storage.touched(unit)

    def close(self) -> None:
        self.storage.close()


class HostParams(_Released):
    def __init__(
        self, plan: Plan, transfers: Transfers, memory: HostMemory, pin: bool, comm=None
    ) -> None:
        super().__init__(plan, transfers, memory, comm)
        self.pin = pin
        self.flat: dict[int, torch.Tensor] = {}

    def create(self, unit: Unit, values: PieceValues) -> None:
        flat = self.memory.empty(self.plan.home_numel(unit), self.dtype, self.pin)
        for lo, hi in self.plan.pieces(unit):
            flat[self.plan.home_slice(unit, lo, hi)].copy_(values(lo, hi))
        self.flat[unit.index] = flat

    def unshard(self, unit: Unit) -> None:
        if unit.index in self._gathered:
            return
        self.storage.make_room(unit)
        flat = self.flat[unit.index]
        self._pending = self.transfers.to_device(
            unit.layout.pairs(0, unit.layout.total, flat, _param_view)
        )
        self._gathered.add(unit.index)

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.flat[unit.index][self.plan.home_slice(unit, lo, hi)]

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        self._written(unit, lo)

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.flat[unit.index][self.plan.home_slice(unit, lo, hi)].clone()

    def master_view(self, unit: Unit) -> torch.Tensor:
        return self.flat[unit.index][self.plan.home_slice(unit, *unit.layout.local_trainable)]

    def _start_refresh(self, unit: Unit) -> Handle:
        return _all_gather_trainable(self.comm, unit, self.flat[unit.index])

    def share_on_device(self, unit: Unit) -> torch.Tensor:
        flat = self.flat[unit.index]
        if self.device.type == "cpu":  # the home is already where the collective runs
            self.transfers.count("host->device", flat.numel() * flat.element_size())
            return flat
        out = torch.empty(flat.numel(), dtype=self.dtype, device=self.device)
        self._pending = self.transfers.to_device([(out, flat)])
        return out

    def held(self) -> dict[str, int]:
        return {"host": sum(t.numel() * t.element_size() for t in self.flat.values())}


class NvmeParams(_Released):
    """Compute params on NVMe, one store shard ``param.u<unit>.<lo>`` per piece."""

    def __init__(self, plan: Plan, transfers: Transfers, memory: HostMemory, store, comm=None):
        from offload.store import Tier  # noqa: PLC0415

        super().__init__(plan, transfers, memory, comm)
        self.store, self.tier, self._nvme = store, Tier.HOST, Tier.NVME
        self.window = plan.placement.param_window
        self._lend_slots = self.lend_slots(plan)  # buffers lent pages may hold (module Note)
        # unit -> keys of the pieces whose pages it holds (or may, after an interrupted gather),
        # held until their pages are home (_take_back)
        self._lent: dict[int, list[str]] = {}

    @staticmethod
    def lend_slots(plan: Plan) -> int:
        """Buffers the param store needs beyond ``offload_param.buffer_count`` so that a
        gather can lend its pieces' pages to the unit (module Note on lent pages): the pieces
        of the largest unit released after each use, where the unit's storage is page blocks."""
        if plan.placement.shard_params or not pages.lends(plan.placement.device):
            return 0
        transient = [u for u in plan.units if u.residency is Residency.TRANSIENT]
        return max((len(plan.pieces(u)) for u in transient), default=0)

    @staticmethod
    def buffer_bytes(plan: Plan, block_size: int) -> int:
        """Bytes per buffer of the param store's pool (module Note on the pool's buffer
        size): the largest piece, rounded up to the IO alignment, at least one IO request
        (``aio.block_size``, as "auto" is), at most ``offload_param.buffer_size``."""
        from offload.store.budget import round_up  # noqa: PLC0415

        size = plan.placement.buffer_sizes["offload_param"]
        largest = max((b - a for u in plan.units for a, b in plan.pieces(u)), default=0)
        return min(size, max(round_up(largest * plan.placement.dtype.itemsize), block_size))

    @property
    def _lend_room(self) -> int:
        """Buffers that may be lent now."""
        return self._lend_slots - sum(len(keys) for keys in self._lent.values())

    @staticmethod
    def key(unit: Unit, lo: int) -> str:
        return f"param.u{unit.index}.{lo}"

    def create(self, unit: Unit, values: PieceValues) -> None:
        versioned = self.plan.placement.versioned_params  # the master of speculative updates
        for lo, hi in self.plan.pieces(unit):
            self.store.register(
                self.key(unit, lo),
                hi - lo,
                self.dtype,
                self._nvme,
                init=values(lo, hi),
                versioned=versioned,
            )

    def unshard(self, unit: Unit) -> None:
        if unit.index in self._gathered:
            return
        # One block for a Ctrl-C: it comes out once the unit is gathered, its reads and copies
        # done (a unit's reads at most). Stopped inside, the gather let go of its pieces in the
        # Ctrl-C's unwinding, where a second Ctrl-C (a user pressing it twice) landed before
        # that cleanup's own block and left them pinned for good: 50 of 152 trials of
        # tests/_ctrl_c_points.py with AGAIN 1. Now only an error takes the except below
        with interrupts_deferred():
            self._unshard(unit)

    def _unshard(self, unit: Unit) -> None:
        lend = (
            self.storage.lends
            and unit.residency is Residency.TRANSIENT
            and len(self.plan.pieces(unit)) <= self._lend_room
        )
        if not lend:
            self.storage.make_room(unit)  # lent pages need no room made (they replace it)
        try:
            self._stream(
                unit, lambda a, b, buf: unit.layout.pairs(a, b, buf, _param_view), lend=lend
            )
            self._gathered.add(unit.index)
        except BaseException:  # a failed read: the unit stays released
            self._gathered.discard(unit.index)
            try:
                self._take_back(unit)
            finally:  # failed: the drop moves what is still lent back first
                self.storage.drop(unit)
            raise

    def reshard(self, unit: Unit) -> None:
        with interrupts_deferred():  # the pages go home whole (offload._interrupts' Note)
            try:
                self._take_back(unit)
            finally:  # failed: the drop moves what is still lent back first
                super().reshard(unit)

    def _lend(self, unit: Unit, a: int, b: int, buf: torch.Tensor) -> bool:
        """Lends the pages of the piece ``[a, b)`` in ``buf`` to the unit (module Note on lent
        pages): True when they are its parameters' now, the piece held until the release.
        Counted as the copy it replaces (the parameters' bytes, not the padding)."""
        if not self.storage.lend(unit, a, buf[: b - a]):
            return False
        self._lent.setdefault(unit.index, []).append(self.key(unit, a))
        nbytes = sum(hi - lo for _, lo, hi in unit.layout.overlaps(a, b)) * buf.element_size()
        self.transfers.count("host->device", nbytes)
        return True

    def _take_back(self, unit: Unit) -> None:
        """The pages lent to the unit go back to their buffers, which go back to the store
        (still holding their pieces). Interrupted, a buffer whose pages may still be the
        unit's stays held (recorded here) rather than go back reading zeros."""
        keys = self._lent.get(unit.index)
        if keys is None:
            return
        self.storage.take_back(unit)
        del self._lent[unit.index]
        for key in keys:
            self.store.release(key, self.tier)

    def _not_lent(self, unit: Unit) -> None:
        """A piece whose pages are lent must not be fetched for an update (its buffer reads
        zeros): nothing rewrites a unit's home while it is gathered (:meth:`read` reads the
        unit)."""
        if self.storage.holds_lent(unit):
            raise RuntimeError(
                f"offload: an update of {unit.label}'s params while the unit is gathered "
                "(a bug in offload: the home is rewritten only while the unit is released)"
            )

    def share_on_device(self, unit: Unit) -> torch.Tensor:
        out = torch.empty(self.plan.home_numel(unit), dtype=self.dtype, device=self.device)
        self._stream(
            unit, lambda a, b, buf: [(out[self.plan.home_slice(unit, a, b)], buf[: b - a])]
        )
        return out

    def _stream(self, unit: Unit, pairs, lend: bool = False) -> None:
        """Copies every piece of the home to the device through ``pairs(lo, hi, buffer)``
        (``(device destination, host source)`` pairs of the piece in its pool buffer), or,
        with ``lend``, lends its pages to the unit where it can (module Note on lent pages)."""
        pieces = self.plan.pieces(unit)
        fetching: deque = deque()  # the keys of the pieces pinned, not copied yet
        copying: deque = deque()  # (key, event): a pool buffer whose copy up is in flight
        try:
            self._stream_in(unit, pieces, fetching, copying, pairs, lend)
        except BaseException:  # a failed read (or an interrupt): let go of every piece
            with interrupts_deferred():  # a second Ctrl-C once all are let go of
                self._let_go(unit, fetching, copying, lend)
            raise

    def _let_go(self, unit: Unit, fetching: deque, copying: deque, lend: bool) -> None:
        """A failed gather's pieces: those fetched are released (with ``lend``, any may be
        lent already: they are given back with the unit's, pages home first, by unshard's
        ``_take_back``), the copies in flight waited for and released."""
        keys = list(fetching)
        if lend:
            held = self._lent.setdefault(unit.index, [])
            held += [k for k in keys if k not in held]
            keys = []
        steps = [lambda k=k: self.store.release(k, self.tier) for k in keys]
        steps += [lambda c=c: self._give_back(*c) for c in copying]
        for step in steps:
            with contextlib.suppress(Exception):  # the read's own error is the one raised
                step()

    def _stream_in(
        self, unit: Unit, pieces, fetching: deque, copying: deque, pairs, lend: bool
    ) -> None:
        """The gather's loop (see the module Note on its window); what it holds is in
        ``fetching``, ``copying`` and ``_lent`` at any moment."""
        futures: deque = deque()  # the fetches of ``fetching``, once made
        ahead = copied = 0
        while copied < len(pieces):
            while ahead < len(pieces) and len(fetching) + len(copying) < self.window:
                a, b = pieces[ahead]
                key = self.key(unit, a)
                # the use is recorded as the piece is pinned: a recorded, unpinned piece would
                # look used already to the eviction planner and be the first given up
                self.store.use(key, self.tier)
                # held once pinned (the fetch records it), also if the fetch then raises; read
                # only: a piece the update just wrote is copied while its write-back runs
                futures.append(self.store.fetch(key, self.tier, readonly=True, held=fetching))
                ahead += 1
            if not fetching:  # the window is full of copies: the oldest gives its buffer back
                self._give_back_oldest(copying)
                continue
            a, b = pieces[copied]  # fetching[0]'s piece: fetched and copied in order
            buf = futures[0].wait()
            # a copy being written home keeps its pages (the write reads them): it is copied
            lent = lend and not self.store.writing(futures[0].key) and self._lend(unit, a, b, buf)
            if lend and not lent:  # copied into recycled pages (pages.py, recycled pages)
                self.storage.make_room_for(unit, a, b)
            key = self.key(unit, a)
            # the piece moves from fetching to copying whole: a Ctrl-C between the two (as the
            # copy or a popleft returned) left it in neither, pinned for good
            # (tests/_ctrl_c_points.py, 2026-12-07: param.u0.0 after the next step)
            with interrupts_deferred():
                event = None if lent else self.transfers.to_device(pairs(a, b, buf))
                fetching.popleft()
                futures.popleft()
                if event is not None:
                    copying.append((key, event))
            copied += 1
            while copying and copying[0][1].done():
                self._give_back_oldest(copying)
        while copying:
            self._give_back_oldest(copying)

    def _give_back_oldest(self, copying: deque) -> None:
        """The oldest copy's buffer goes back to the store once the copy is done, and out of
        ``copying`` with it: a Ctrl-C between the release and the popleft would have the
        failed gather's cleanup release it again (another holder's pin, if any)."""
        key, event = copying[0]
        self.transfers.wait(event, "host->device")
        with interrupts_deferred():
            copying.popleft()
            self.store.release(key, self.tier)

    def _give_back(self, key: str, event: Event) -> None:
        self.transfers.wait(event, "host->device")
        self.store.release(key, self.tier)

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        self._not_lent(unit)
        return self.store.take(self.key(unit, lo), self.tier, read=False, expected=True)

    def master_piece(self, unit: Unit, lo: int, hi: int):
        """The piece's current values, fetched for an update in place (the shards are the fp32
        master: ``homes.optim.ParamShardsMaster``); :meth:`commit` or :meth:`give_up_out`
        releases it."""
        self._not_lent(unit)
        return self.store.fetch(self.key(unit, lo), self.tier, expected=True)

    def expect_update(self, unit: Unit, pieces: list[tuple[int, int]]) -> None:
        """The update in this backward fetches these pieces (:meth:`master_piece`) or takes
        them to overwrite (:meth:`out_buffer`) once the unit's gradients are in: the store
        keeps their copies for it (``TieredStore.expect``) rather than let the backward's
        prefetches take their buffers first (a copy kept is a buffer the update need not
        evict another's for)."""
        self.store.expect(self.key(unit, lo) for lo, _ in pieces)

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        self.store.release(self.key(unit, lo), self.tier, dirty=True)
        self._written(unit, lo)

    def give_up_out(self, unit: Unit, lo: int, hi: int) -> None:
        self.store.release(self.key(unit, lo), self.tier, discard=True)

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        if self.storage.holds_lent(unit, lo):  # its pages are the unit's
            return self.storage.flat(unit)[lo:hi].clone()  # (a state_dict before a backward)
        return self.store.read(self.key(unit, lo))[: hi - lo]

    def read_committed(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        """:meth:`read` of the value an open version of the store would roll back to (the
        shards are the master of a speculative update: ``ParamShardsMaster``)."""
        return self.store.read(self.key(unit, lo), committed=True)[: hi - lo]

    def load_shard(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        self.reshard(unit)  # stale from here on (the caller reshards it too)
        self.store.write_from(self.key(unit, lo), values)  # converted a chunk at a time
        self._written(unit, lo)

    def _start_refresh(self, unit: Unit) -> Handle:
        """One broadcast per rank and piece (the pool holds one piece at a time; module Note):
        piece ``j`` of every rank's share has the same length (``Plan``'s Note)."""
        self.reshard(unit)  # its gathered copy is stale once the broadcasts land
        piece, world, me = self.plan.placement.piece_numel, self.plan.shard.world, self.comm.rank
        shares = [ShardSpec(r, world).share(0, unit.layout.trainable) for r in range(world)]
        for j in range(len(split(*shares[0], piece))):
            for r, share in enumerate(shares):
                lo, hi = split(*share, piece)[j]
                key = self.key(unit, lo)
                held: list[str] = []  # the pin, once taken (TieredStore.take's held)
                try:
                    buf = self.store.take(key, self.tier, read=r == me, held=held)
                    self.comm.broadcast(buf[: hi - lo], r, what=f"{unit.label} params").wait()
                    with interrupts_deferred():  # released and its record cleared together
                        self.store.release(key, self.tier, dirty=r != me)
                        held.clear()
                except BaseException:  # what it received is dropped, the home keeps its values
                    if held:
                        self.store.release(key, self.tier, discard=True)
                    raise
        return completed(self.comm, "broadcast")

    def close(self) -> None:
        try:
            for index in list(self._lent):
                with contextlib.suppress(Exception):  # closing: the store goes next
                    self._take_back(self.plan.units[index])
        finally:
            super().close()

    def held(self) -> dict[str, int]:
        """On disk: every piece, twice when versioned (each shard's second extent)."""
        item = self.dtype.itemsize * (2 if self.plan.placement.versioned_params else 1)
        return {
            "nvme": sum((b - a) * item for u in self.plan.units for a, b in self.plan.pieces(u))
        }


class ShardedParams(_Released):
    """Stage 3: ``inner`` holds this rank's share; a unit is all-gathered into its storage for
    use, with the next unit's gather in flight (module Note on ranks)."""

    keeps_across_the_turn = False  # the backward's first gather starts the second one's

    def __init__(self, plan: Plan, transfers: Transfers, memory: HostMemory, inner, comm):
        super().__init__(plan, transfers, memory, comm)
        self.inner = inner
        self._inflight: dict[int, _Gather] = {}

    # the share itself is the inner home's
    def create(self, unit: Unit, values: PieceValues) -> None:
        self.inner.create(unit, values)

    def load_shard(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        self.inner.load_shard(unit, lo, hi, values)

    def out_buffer(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.inner.out_buffer(unit, lo, hi)

    def expect_update(self, unit: Unit, pieces: list[tuple[int, int]]) -> None:
        self.inner.expect_update(unit, pieces)

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        self.inner.commit(unit, lo, hi)

    def give_up_out(self, unit: Unit, lo: int, hi: int) -> None:
        self.inner.give_up_out(unit, lo, hi)

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.inner.read(unit, lo, hi)

    def master_view(self, unit: Unit) -> torch.Tensor:
        return self.inner.master_view(unit)

    def held(self) -> dict[str, int]:
        return self.inner.held()

    # the gather
    def unshard(self, unit: Unit) -> None:
        if unit.index in self._gathered:
            return
        nxt = self.order.record(unit.index)
        gather = self._inflight.pop(unit.index, None) or self._start(unit)
        try:
            gather.finish()
            self._gathered.add(unit.index)  # (inside the try: NvmeParams.unshard's comment)
        except BaseException:
            self._gathered.discard(unit.index)
            self.storage.drop(unit)
            raise
        if nxt is not None and nxt not in self._gathered and nxt not in self._inflight:
            ahead = self.plan.units[nxt]
            self.gate(ahead)
            self._inflight[nxt] = self._start(ahead)

    def _start(self, unit: Unit) -> _Gather:
        """Issues the unit's all-gathers: its trainable prefix and its frozen suffix, each
        from this rank's share (packed in that order, ``Plan.home_slice``)."""
        layout = unit.layout
        self.storage.make_room(unit)
        send = self.inner.share_on_device(unit)
        flat = self.storage.flat(unit)
        out = (
            flat
            if flat is not None
            else torch.empty(layout.total, dtype=self.dtype, device=self.device)
        )
        n = layout.local_trainable[1] - layout.local_trainable[0]
        what = f"{unit.label} params"
        handles = []
        if layout.trainable:
            handles.append(self.comm.all_gather(out[: layout.trainable], send[:n], what))
        if layout.total > layout.trainable:
            handles.append(
                self.comm.all_gather(out[layout.trainable : layout.total], send[n:], what)
            )
        copy_out = None
        if flat is None:  # each parameter has storage of its own: copy the gathered unit in

            def copy_out() -> None:
                for dst, src in layout.pairs(0, layout.total, out, _param_view):
                    dst.copy_(src)

        return _Gather(handles, send, copy_out)

    def touched(self, unit: Unit) -> list[tuple[int, int, bool]]:
        if unit.index in self._inflight:
            return []  # the gather ahead is writing its block
        return super().touched(unit)

    def reshard(self, unit: Unit) -> None:
        gather = self._inflight.pop(unit.index, None)
        if gather is not None:  # a gather ahead that was not used: let it land, then drop
            gather.finish()
            self.storage.drop(unit)
        super().reshard(unit)

    def settle(self, unit: Unit | None = None) -> None:
        """Drops the gathers in flight: they read shares about to be rewritten. With ``unit``
        (the step in backward, before that unit's update) only its own: another unit's gather
        reads a share this update leaves alone, and stays ready for its ``unshard`` (dropping
        it gathered the next unit twice: 15% more stage-3 traffic, benchmarks/bench_dist.py)."""
        for index in list(self._inflight):
            if unit is None or index == unit.index:
                self.reshard(self.plan.units[index])

    def quiesce(self, unit: Unit | None = None) -> None:
        self.settle(unit)
        self.inner.quiesce()

    def close(self) -> None:
        try:
            for gather in self._inflight.values():
                with contextlib.suppress(Exception):
                    gather.finish()
            self._inflight.clear()
            self.inner.close()
        finally:
            super().close()


class _Gather:
    """One unit's all-gathers in flight: their handles, the share they read (kept alive until
    they complete) and the copy into the parameters' own storages, if any."""

    __slots__ = ("handles", "send", "copy_out")

    def __init__(self, handles: list[Handle], send: torch.Tensor, copy_out) -> None:
        self.handles, self.send, self.copy_out = handles, send, copy_out

    def finish(self) -> None:
        handles, self.handles = self.handles, []
        for h in handles:
            h.wait()
        self.send = None
        copy_out, self.copy_out = self.copy_out, None
        if copy_out is not None:
            copy_out()
