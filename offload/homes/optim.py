"""Where the fp32 master weights and Adam moments live (``offload_optimizer.device``), and the
per-unit update over them. Both homes cover this rank's share of each unit's trainable prefix,
in the plan's pieces.

- :class:`HostOptim` (``"cpu"``): flat fp32 host tensors per unit; the master is owned by a
  :class:`ParamsMaster` (the param home's own fp32 buffer) or a :class:`HostMaster` (a buffer
  of its own, the compute params derived from it). The update is one native CPU Adam call per
  piece (the kernel's thread pool splits it).
- :class:`NvmeOptim` (``"nvme"``): one NVMe shard per (unit, piece, kind) for exp_avg and
  exp_avg_sq, streamed through the ``offload_optimizer`` buffer pool; host RAM never holds a
  model-sized fp32 buffer. The master is an :class:`NvmeMaster` (shards of its own beside the
  moments, the compute params derived) or a :class:`ParamShardsMaster` (the param home's fp32
  NVMe shards: one copy of the weights on disk).

Which owns the master and which owns the gradients is the plan's decision
(``offload.plan.ownership``); the update reads gradients from their owner.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable
from itertools import islice

import torch

from offload._interrupts import interrupts_deferred
from offload.homes.grads import GradHome, Hyper, adam_runs
from offload.homes.params import ParamHome
from offload.optim.kernels import adam_params_from_moments
from offload.plan import Plan, Unit
from offload.store import Tier

KINDS = ("master", "exp_avg", "exp_avg_sq")
MOMENTS = KINDS[1:]


Part = tuple[Unit, int, "int | None"]
"""``(unit, first, stop)``: the unit's pieces ``[first, stop)`` (``stop`` None: to its last)."""


class Units:
    """The units an update goes over, in order, as :data:`Part` s: whole units of a known list
    here; the step in backward's feed (``offload.runtime.schedule.UnitFeed``) has the same
    methods and is filled as it runs, a unit's first pieces possibly before the backward has
    handed in the rest (the NVMe update, which alone takes a feed, goes piece by piece).
    :meth:`poll` never blocks (None: nothing yet); :meth:`take` waits (None: no more)."""

    def __init__(self, units: Iterable[Unit]) -> None:
        self._it = iter(units)

    def take(self) -> Part | None:
        unit = next(self._it, None)
        return None if unit is None else (unit, 0, None)

    poll = take

    def __iter__(self):
        """The units (of whole parts: a list's)."""
        while (part := self.take()) is not None:
            yield part[0]


MasterValues = Callable[[int, int], torch.Tensor]
"""``(lo, hi) -> fp32 values`` of a unit's trainable elements ``[lo, hi)``."""


class OptimHome:
    """Interface of the optimizer-state homes."""

    def __init__(self, plan: Plan, params: ParamHome, grads: GradHome) -> None:
        self.plan, self.params, self.grads = plan, params, grads

    def pieces(self, unit: Unit) -> list[tuple[int, int]]:
        """The ranges :meth:`read` and :meth:`load` accept: the plan's trainable pieces."""
        return self.plan.trainable_pieces(unit)

    def create(self, unit: Unit, master: MasterValues) -> None:
        """Creates the unit's state: the master from ``master``, zero moments (wrap time; after
        the param home's ``create``)."""
        raise NotImplementedError

    def read(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor:
        """A new host fp32 tensor with ``kind`` (one of ``KINDS``) over a piece."""
        raise NotImplementedError

    def load(self, unit: Unit, kind: str, lo: int, hi: int, values: torch.Tensor) -> None:
        """Overwrites ``kind`` over a piece; loading the master also writes the compute params
        derived from it, through whichever owns them."""
        raise NotImplementedError

    def step_units(self, units: Units, hyper: Hyper, on_unit_done=None) -> None:
        """One update of every unit's state, writing new compute params home;
        ``on_unit_done(unit)`` is called as each unit's update is complete. ``units`` may be a
        feed that is still being filled (``offload.runtime.schedule``)."""
        for unit in units:
            self.step(unit, hyper)
            if on_unit_done is not None:
                on_unit_done(unit)

    def step(self, unit: Unit, hyper: Hyper) -> None:
        raise NotImplementedError

    def held(self) -> dict[str, int]:
        """Bytes of optimizer state this home holds (the master when it owns it), by where."""
        return {}

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- host
class ParamsMaster:
    """The param home's fp32 host buffer is the master: the update writes it in place."""

    writes_out = False  # the update writes no compute copy (HostMaster: piece by piece)

    def __init__(self, params: ParamHome) -> None:
        self.params = params

    def create(self, unit: Unit, values: MasterValues) -> torch.Tensor:
        return self.params.master_view(unit)  # already filled by the param home

    def load(self, unit: Unit, buf: torch.Tensor, lo: int, hi: int, values: torch.Tensor) -> None:
        self.params.load_shard(unit, lo, hi, values)

    def out(self, unit: Unit, lo: int, hi: int) -> torch.Tensor | None:
        return None

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        self.params.changed(unit, lo, hi)

    def give_up(self, unit: Unit, lo: int, hi: int) -> None:
        """The piece's update stopped before :meth:`commit`: what :meth:`out` took goes back
        unwritten."""


class HostMaster(ParamsMaster):
    """A flat fp32 host buffer of its own; the update writes the compute params out of it,
    through the param home's buffers (pool buffers with params on NVMe: one piece at a time)."""

    writes_out = True

    def create(self, unit: Unit, values: MasterValues) -> torch.Tensor:
        lo, hi = unit.layout.local_trainable
        buf = torch.empty(hi - lo, dtype=torch.float32)
        for a, b in self.params.plan.trainable_pieces(unit):
            buf[a - lo : b - lo].copy_(values(a, b))
        return buf

    def load(self, unit: Unit, buf: torch.Tensor, lo: int, hi: int, values: torch.Tensor) -> None:
        base = unit.layout.local_trainable[0]
        buf[lo - base : hi - base].copy_(values)
        self.params.load_shard(unit, lo, hi, values)

    def out(self, unit: Unit, lo: int, hi: int) -> torch.Tensor | None:
        return self.params.out_buffer(unit, lo, hi)

    def commit(self, unit: Unit, lo: int, hi: int) -> None:
        self.params.commit(unit, lo, hi)

    def give_up(self, unit: Unit, lo: int, hi: int) -> None:
        self.params.give_up_out(unit, lo, hi)


class HostOptim(OptimHome):
    def __init__(self, plan: Plan, params: ParamHome, grads: GradHome, master) -> None:
        super().__init__(plan, params, grads)
        self.master = master
        self.bufs: dict[int, dict[str, torch.Tensor]] = {}

    def create(self, unit: Unit, master: MasterValues) -> None:
        lo, hi = unit.layout.local_trainable
        if hi == lo:
            return
        self.bufs[unit.index] = {
            "master": self.master.create(unit, master),
            "exp_avg": torch.zeros(hi - lo, dtype=torch.float32),
            "exp_avg_sq": torch.zeros(hi - lo, dtype=torch.float32),
        }

    def _view(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor:
        base = unit.layout.local_trainable[0]
        return self.bufs[unit.index][kind][lo - base : hi - base]

    def read(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor:
        return self._view(unit, kind, lo, hi).clone()

    def load(self, unit: Unit, kind: str, lo: int, hi: int, values: torch.Tensor) -> None:
        if kind == "master":
            self.master.load(unit, self.bufs[unit.index]["master"], lo, hi, values)
        else:
            self._view(unit, kind, lo, hi).copy_(values)

    def held(self) -> dict[str, int]:
        kinds = KINDS if isinstance(self.master, HostMaster) else MOMENTS
        n = sum(b[k].numel() * b[k].element_size() for b in self.bufs.values() for k in kinds)
        return {"host": n}

    def step_units(self, units: Units, hyper: Hyper, on_unit_done=None) -> None:
        """The whole update at once when nobody waits for single units (``optimizer.step()``)
        and no piece holds a buffer of the param home: the gradients' owner may then make it
        one kernel call."""
        if on_unit_done is not None or self.master.writes_out:
            super().step_units(units, hyper, on_unit_done)
            return
        pieces = [self._piece(unit, lo, hi) for unit in units for lo, hi in self.pieces(unit)]
        self.grads.update_many(pieces, hyper)
        for unit, lo, hi, *_ in pieces:
            self.master.commit(unit, lo, hi)

    def step(self, unit: Unit, hyper: Hyper) -> None:
        for lo, hi in self.pieces(unit):
            # a piece whole: a Ctrl-C between taking its out buffer (the param home's, on
            # NVMe a pool buffer) and committing it left that buffer pinned for good, and the
            # load that was then needed (``offload.runtime.schedule.Immediate``) failed on it
            with interrupts_deferred():
                piece = self._piece(unit, lo, hi)
                try:
                    self.grads.update(*piece, hyper)
                except BaseException:
                    with contextlib.suppress(Exception):  # the update's error is raised
                        self.master.give_up(unit, lo, hi)
                    raise
                self.master.commit(unit, lo, hi)

    def _piece(self, unit: Unit, lo: int, hi: int) -> tuple:
        """What the gradients' owner's ``update`` takes for a piece, before ``hyper``."""
        master, exp_avg, exp_avg_sq = (self._view(unit, k, lo, hi) for k in KINDS)
        return unit, lo, hi, master, exp_avg, exp_avg_sq, self.master.out(unit, lo, hi)


# ---------------------------------------------------------------------------- nvme
def _key(unit: Unit, kind: str, lo: int) -> str:
    return f"{kind}.u{unit.index}.{lo}"


class NvmeMaster:
    """``MasterOwner.NVME``: fp32 master shards ``master.u<unit>.<lo>`` in the optimizer store,
    fetched with the moments; the update writes the compute params out through the param home,
    and after a rollback they are derived from the master again."""

    kinds = KINDS  # the optimizer store's shards of a piece

    def __init__(self, params: ParamHome, store) -> None:
        self.params, self.store = params, store

    def hold(self, unit: Unit, lo: int, hi: int):
        """What the update holds of the param home from ``param_ahead`` pieces before the
        piece's turn: nothing (its out buffer is taken at its turn)."""
        return None

    def expect(self, unit: Unit, pieces: list[tuple[int, int]]) -> None:
        """The update in the backward will take these pieces: the param home keeps what it
        caches of them (the copies its out buffers overwrite, or here, the master)."""
        self.params.expect_update(unit, pieces)

    def tensors(self, item: _Piece, fetched: list[torch.Tensor]) -> tuple:
        """``(master, exp_avg, exp_avg_sq, out)`` of a piece whose ``kinds`` are ``fetched``;
        what the piece holds of the param home is ``item.out`` until it is committed."""
        item.out = self.params.out_buffer(item.unit, item.lo, item.hi)
        return (*fetched, item.out)

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.store.read(_key(unit, "master", lo))[: hi - lo]

    def load(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        self.store.write_from(_key(unit, "master", lo), values)
        self.params.load_shard(unit, lo, hi, values)

    def stores(self) -> tuple:
        """Every store whose shards an update writes (its versions are theirs)."""
        return (self.store,)

    def derive_params(self, unit: Unit, pieces: list[tuple[int, int]]) -> None:
        """Writes the unit's compute params from the master (after a rollback)."""
        for lo, hi in pieces:
            self.params.load_shard(unit, lo, hi, self.read(unit, lo, hi))

    def read_committed(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        """The piece's master as an open version would roll it back (before the update)."""
        return self.store.read(_key(unit, "master", lo), committed=True)[: hi - lo]

    def rewrite(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        """Replaces what the open version wrote of the piece's master, and its compute
        params."""
        with self.store.borrow(_key(unit, "master", lo), read=False) as buf:
            buf[: hi - lo].copy_(values)
        self.params.load_shard(unit, lo, hi, values)


class ParamShardsMaster(NvmeMaster):
    """``MasterOwner.PARAMS`` with fp32 params on NVMe: the param home's shards are the master
    (one copy of the weights on disk). The update fetches a piece's params ``param_ahead``
    pieces before its turn (``offload.plan.placement``'s Note on the param pool) and updates
    them in place; they take part in the update's versions, so a rollback restores them with
    the moments and there is nothing to derive."""

    kinds = MOMENTS

    def hold(self, unit: Unit, lo: int, hi: int):
        return self.params.master_piece(unit, lo, hi)

    def tensors(self, item: _Piece, fetched: list[torch.Tensor]) -> tuple:
        return (item.out.wait()[: item.hi - item.lo], *fetched, None)

    def read(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.params.read(unit, lo, hi)

    def load(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        self.params.load_shard(unit, lo, hi, values)

    def stores(self) -> tuple:
        return (self.store, self.params.store)

    def derive_params(self, unit: Unit, pieces: list[tuple[int, int]]) -> None:
        pass  # rolled back with the moments

    def read_committed(self, unit: Unit, lo: int, hi: int) -> torch.Tensor:
        return self.params.read_committed(unit, lo, hi)

    def rewrite(self, unit: Unit, lo: int, hi: int, values: torch.Tensor) -> None:
        out = self.params.out_buffer(unit, lo, hi)
        out[: hi - lo].copy_(values)
        self.params.commit(unit, lo, hi)  # into the version, as the update's own write


class NvmeOptim(OptimHome):
    """The moments (and an :class:`NvmeMaster`'s master) as fp32 shards ``<kind>.u<unit>.<lo>``
    in the optimizer store."""

    def __init__(self, plan: Plan, params: ParamHome, grads: GradHome, store, master) -> None:
        super().__init__(plan, params, grads)
        self.store, self.master = store, master
        self.lookahead = plan.placement.step_lookahead
        self.param_ahead = plan.placement.param_ahead
        self._head: deque[_Piece] = deque()  # read_head's pieces, until an update takes them

    key = staticmethod(_key)

    def create(self, unit: Unit, master: MasterValues) -> None:
        versioned = self.plan.placement.versioned_state  # speculative updates
        for lo, hi in self.pieces(unit):
            for kind in self.master.kinds:
                self.store.register(
                    self.key(unit, kind, lo),
                    hi - lo,
                    torch.float32,
                    Tier.NVME,
                    init=master(lo, hi) if kind == "master" else None,
                    versioned=versioned,
                )

    # -- speculative updates (the step in backward; offload.store's Note on versions) ---------
    def begin_version(self) -> None:
        """The next update's writes of master and moments can still be undone."""
        for store in self.master.stores():
            store.begin_version()

    def commit_version(self) -> None:
        """Keeps the update since :meth:`begin_version`; raises, with every store's version
        still open (for :meth:`rollback_version`), when a write of it failed."""
        stores = self.master.stores()
        for store in stores:  # all settled first: no store commits before another fails
            store.settle_version()
        for store in stores:
            store.commit_version()

    def rollback_version(self) -> None:
        """Undoes the update since :meth:`begin_version`: master and moments are as before (with
        an :class:`NvmeMaster` the compute params it wrote are not: :meth:`derive_params` or a
        new update rewrites them)."""
        first = None
        for store in self.master.stores():  # every store, even after one failed
            try:
                store.rollback_version()
            except Exception as exc:  # noqa: BLE001 - raised once all are back
                first = first or exc
        if first is not None:
            raise first

    def derive_params(self, units: Iterable[Unit]) -> None:
        """Writes the compute params of ``units`` from their master (after a rollback)."""
        for unit in units:
            self.master.derive_params(unit, self.pieces(unit))

    @property
    def redoes_step_size(self) -> bool:
        """Whether :meth:`redo_step_size` can run here: one rank (with several, the shares'
        compute params would need their collectives; not built)."""
        return self.plan.placement.world == 1

    def redo_step_size(self, units: Iterable[Unit], hyper: Hyper) -> None:
        """Inside the open version of an update whose step size changed after it ran (lr,
        eps, AdamW's weight decay; not what the moments depend on): every piece's master is
        made again from its value before the update and the moments the update wrote, with
        ``hyper`` (``adam_params_from_moments``: bit for bit the update with ``hyper``), and
        its compute params from that. No gradient is needed. Synchronous, one piece at a time
        (host memory: three pieces); a late change is rare, so it is not pipelined."""
        for unit in units:
            for lo, hi in self.pieces(unit):
                values = self.master.read_committed(unit, lo, hi)
                moments = [self.read(unit, kind, lo, hi) for kind in MOMENTS]
                for sl, kwargs in hyper.runs(unit, lo, hi):
                    if kwargs is not None:  # (else left alone by the update)
                        adam_params_from_moments(values[sl], *(m[sl] for m in moments), **kwargs)
                self.master.rewrite(unit, lo, hi, values)

    def read(self, unit: Unit, kind: str, lo: int, hi: int) -> torch.Tensor:
        if kind == "master":
            return self.master.read(unit, lo, hi)
        return self.store.read(self.key(unit, kind, lo))[: hi - lo]

    def held(self) -> dict[str, int]:
        """On disk: the shards of ``master.kinds``, twice with versions (each one's second
        extent; the param home counts its own)."""
        n = sum(b - a for u in self.plan.units for a, b in self.pieces(u))
        extents = 2 if self.plan.placement.versioned_state else 1
        return {"nvme": 4 * len(self.master.kinds) * n * extents}

    def load(self, unit: Unit, kind: str, lo: int, hi: int, values: torch.Tensor) -> None:
        values = values.to(torch.float32).contiguous()
        if kind == "master":
            self.master.load(unit, lo, hi, values)
        else:
            self.store.write_from(self.key(unit, kind, lo), values)

    def expect(self, unit: Unit) -> None:
        """The update in this backward takes ``unit`` once its gradients are in: what it will
        read or overwrite of the param home is kept for it meanwhile."""
        self.master.expect(unit, self.pieces(unit))

    # -- the head start (offload.plan.placement, Note: the NVMe step's buffers) --------------
    def head_pieces(self, units: list[Unit], buffers: int) -> list[_Piece]:
        """The first pieces of ``units`` (the next update's order) whose optimizer store shards
        fit in ``buffers`` buffers: what :meth:`read_head` reads."""
        room, pieces = buffers // len(self.master.kinds), []
        for unit in units:
            if len(pieces) >= room:
                break
            ranges = self.pieces(unit)
            pieces += [
                _Piece(unit, lo, hi, j + 1 == len(ranges)) for j, (lo, hi) in enumerate(ranges)
            ]
        return pieces[:room]

    def read_head(self, units: list[Unit], buffers: int) -> None:
        """Starts reading :meth:`head_pieces`, held for the next update: it takes them if it
        starts with those pieces; :meth:`drop_head` lets them go otherwise."""
        self.drop_head()
        for item in self.head_pieces(units, buffers):
            self._head.append(item)
            self._fetch(item)

    def drop_head(self) -> None:
        """Lets go of what :meth:`read_head` read (clean: it is what the store holds)."""
        head, self._head = self._head, deque()
        for key in (key for item in head for key in item.held):
            self.store.release(key, Tier.HOST)

    def _fetch(self, item: _Piece) -> None:
        """Fetches the piece's shards (whoever holds ``item`` releases what ``item.held``
        records: each shard from its pin on, also when its fetch then raised)."""
        for k in self.master.kinds:
            item.futs.append(self.store.fetch(self.key(item.unit, k, item.lo), held=item.held))

    def _from_head(self, unit: Unit, lo: int) -> _Piece | None:
        """The head start's piece when it is the next one there (any other order drops the
        head start)."""
        if self._head and (self._head[0].unit is not unit or self._head[0].lo != lo):
            self.drop_head()
        return self._head.popleft() if self._head else None

    def step_units(self, units: Units, hyper: Hyper, on_unit_done=None) -> None:
        """Streams every piece through the pool: the reads of the next ``lookahead`` pieces are
        in flight while piece ``j`` is updated and piece ``j - 1`` is written back (the store
        writes released dirty shards asynchronously). The update's order is known exactly, so it
        issues its own fetches instead of going through the store's trace prefetcher. ``units``
        may be a feed still being filled: it looks ahead only over the pieces already handed in
        (``poll`` never blocks; ``take`` waits for the next part or the feed's end). Its first
        pieces may have been read already (:meth:`read_head`)."""
        queued: deque = deque()  # (unit, lo, hi, last piece of its unit), not fetched yet
        ahead: deque = deque()  # the same with the futures of its fetches

        def more(block: bool) -> bool:
            part = units.take() if block else units.poll()
            if part is None:
                return False
            unit, first, stop = part
            pieces = self.pieces(unit)
            queued.extend(
                (unit, lo, hi, j + 1 == len(pieces))
                for j, (lo, hi) in enumerate(pieces[first:stop], first)
            )
            return True

        current = None  # the piece being updated: what it still holds
        try:
            while True:
                while len(ahead) <= self.lookahead:
                    if not queued and not more(block=not ahead):
                        break
                    if queued:
                        unit, lo, hi, last = queued.popleft()
                        item = self._from_head(unit, lo) or _Piece(unit, lo, hi, last)
                        ahead.append(item)
                        if not item.futs:
                            self._fetch(item)
                        item.grad = self.grads.fetch(unit, lo)
                if not ahead:
                    self.drop_head()  # an update over fewer units than were read
                    return
                for item in islice(ahead, self.param_ahead + 1):  # placement's Note on the
                    if item.out is None:  # param pool: the params of fewer pieces ahead
                        item.out = self.master.hold(item.unit, item.lo, item.hi)
                current = ahead.popleft()
                unit, lo, hi = current.unit, current.lo, current.hi
                fetched = [f.wait() for f in current.futs]
                master, exp_avg, exp_avg_sq, out = self.master.tensors(current, fetched)
                grad = current.grad.wait()
                adam_runs(unit, lo, hi, (master, grad, exp_avg, exp_avg_sq), out, hyper)
                self.params.commit(unit, lo, hi)
                current.out = None
                while current.held:
                    self.store.release(current.held[0], Tier.HOST, dirty=True)
                    current.held.pop(0)
                grad, current.grad = current.grad, None
                self.grads.drop(unit, lo, grad)
                if on_unit_done is not None and current.last:
                    on_unit_done(unit)
                current = None
        except BaseException:
            for item in [current, *ahead] if current is not None else ahead:
                self._give_up(item)
            with contextlib.suppress(Exception):  # the error raised is the update's
                self.drop_head()
            raise
        finally:
            self.grads.abandon()

    def _give_up(self, item: _Piece) -> None:
        """A failed update lets go of what a piece holds; copies it changed are dropped
        unwritten, so the shards keep their values from before (as far as it got, the update
        is then half done: see ``offload.runtime.schedule``'s failure)."""
        steps = [lambda k=key: self.store.release(k, Tier.HOST, discard=True) for key in item.held]
        if item.out is not None:
            steps.append(lambda: self.params.give_up_out(item.unit, item.lo, item.hi))
        if item.grad is not None:
            steps.append(lambda: self.grads.drop(item.unit, item.lo, item.grad))
        for step in steps:
            with contextlib.suppress(Exception):  # a read that failed too: the error is raised
                step()


class _Piece:
    """One piece of the NVMe update in flight: the fetches it holds until it is done."""

    __slots__ = ("unit", "lo", "hi", "last", "held", "futs", "grad", "out")

    def __init__(self, unit: Unit, lo: int, hi: int, last: bool) -> None:
        self.unit, self.lo, self.hi, self.last = unit, lo, hi, last
        self.held: list[str] = []  # shard keys fetched and not released yet
        self.futs: list = []
        self.grad = None  # the grad piece's future, until dropped
        self.out = None  # what it holds of the param home (NvmeMaster.hold), until committed
