"""``TieredStore``: where every shard lives, the hard host budget, asynchronous moves between
host memory and NVMe, and trace-driven prefetch.

Note: one shard, two tiers
    Each shard has a home (an NVMe file extent, or a host tensor the store holds) and, when its
    home is NVMe, at most one cached host copy in a pool buffer (``state.py``). ``fetch(key)``
    pins the shard, starts whatever it can without blocking, and returns a ``Fetch``;
    ``Fetch.wait()`` drives the remaining steps (blocking on the transfer records) and returns
    the typed host view. ``release(key, dirty=...)`` unpins; the last dirty release starts the
    write-back home at once, asynchronously. The budget, eviction and the rule that a prefetch
    never starves a demand fetch belong to the store's ``Reclaimer`` (``reclaim.py``).

Note: versions (all or nothing)
    A shard registered ``versioned`` has two NVMe extents. Between ``begin_version()`` and
    ``commit_version()`` / ``rollback_version()`` its write-backs go to the extent that does not
    hold its committed value, and reads of a shard written in the version come from there too;
    committing makes those extents the committed ones, rolling back drops every copy the
    version wrote and leaves the committed extents as they were. So a whole update can be
    computed speculatively and then either kept or undone, with the state before it intact on
    disk the whole time (``offload.runtime.schedule``, the step in backward).

Note: coherence
    ``fetch(..., read=False)`` marks the shard dirty at once (the caller promised to overwrite
    it, so the old bytes must never be mistaken for valid data). A fetch that hands out a copy
    while its write-back is in flight first waits for the write-back, unless it is
    ``readonly``: its caller only reads the copy (and does not move its pages,
    ``offload.device.pages``), which the write reads too, so it gets it at once (a forward's
    gather right behind the update that wrote the unit's params; ``writing(key)`` says
    whether the write is still in flight). A pinned copy is never written back (the last
    release starts that), so none starts under a reader. Every move is counted
    where it is issued (``stats.py``); moves to and from the compute device are not the store's
    (``offload.device``).

Note: whose error
    A call does work for other shards on its way: it completes their finished transfers (and
    waits for one to make room), pushes the wanted prefetches forward, and a last release
    starts its shard's write-back.
    A failure there is no caller's own (a prefetch's read error found by a gather's release;
    raised there, it broke the caller's loop of releases half way and left pins behind for
    good). So that work never raises: the transfer is rolled back (``_abort``: a read is
    retried by the next fetch, a failed write-back leaves its copy dirty and cached) and its
    error is kept. A failed read is its shard's (``Shard.failed_read``): the value is on disk
    as before, and only a caller that wants it has a use for the error, so it is raised by
    that shard's next ``fetch`` (before its pin) or ``wait()``, and forgotten once the value
    is replaced (``write_from``, a ``read=False`` fetch, a discard, a rollback). Until
    2026-12-07 it went to the store's next call, whoever made it: the first backward after a
    checkpoint's load that had replaced the value it was about, or the step in backward
    whose update a failed read ahead for the next step undid (``tests/test_store.py``,
    ``tests/test_faults.py``). Any other error (a write-back's: its copy is still dirty, and
    written again) is raised by the next call that can report it before it takes anything
    (and forgotten too where that copy is dropped unwritten: a rollback of the version that
    wrote it, a checkpoint's load over it):
    ``fetch`` (before its pin), ``use``, ``read_ahead``, ``begin_iteration``, a ``wait()``,
    ``settle_version`` (a write of the version failed: nothing is committed) and ``flush``
    (after writing every copy home again). ``release`` raises only its own misuse: once it
    returns or raises, the pin is given back.

Note: Ctrl-C and IO in flight
    Submitting a transfer and recording it (the shard's pending transfer, the buffer it
    holds) are one block for a Ctrl-C (``offload._interrupts``): delivered after a read was
    submitted but before it was recorded, its ``except`` gave the buffer back to the pool
    while the read still wrote into it (another shard's copy overwritten, or, once the engine
    closed and freed the pool, memory the process no longer owned: a segfault in
    ``tests/_ctrl_c_points.py``'s sweep), and a write-back submitted but not recorded was
    never waited for. The synchronous reads and writes wait for their transfer inside the
    block too: unwound before the wait, their buffer was freed under the transfer. A pool
    buffer passes from the pool to its shard inside one too (``_advance``): delivered as the
    pool's call returned, the Ctrl-C left the buffer taken with no owner, the pool a buffer
    short for good; so taking one never blocks, and a wait for room holds none
    (``Reclaimer.wait_for_room``), where a Ctrl-C may land at any line.

Note: synchronous access
    Registering a shard with its initial value and ``write_from`` / ``read[_into]`` (loading
    and exporting values, checkpoints) move a shard between a caller's tensor and its NVMe
    extent outside the pool, through a staging buffer of the store's own. That buffer used to
    be sized to the largest shard (up to ``buffer_size``) and was kept for the store's life:
    after wrap each store held one largest piece resident that the host budget (README,
    "Memory") does not count, 2 x 64 MiB for the 325M-parameter LLaMA with "auto" buffers,
    whose training then peaked at 1256-1292 MiB of RSS growth against a budget of 1200 MiB.
    Writes now go through a kept staging of at most ``STAGING_BYTES``, a chunk at a time
    (one extent is written at several offsets); a read takes the whole extent into a buffer
    of its own, so that the checksum of each write (recorded per written range) is still
    checked by the read that covers it. ``read`` returns that buffer itself as the new tensor
    (the homes' reads for checkpoints and exports): their ``read_into`` a new tensor held
    each piece twice, the caller's tensor and the buffer (128 MiB for the 325M LLaMA's root
    piece of 64 MiB while a checkpoint or an export read it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, MutableSequence
from typing import TYPE_CHECKING

import torch

from offload._interrupts import interrupts_deferred
from offload.store.budget import round_up
from offload.store.fetch import Fetch
from offload.store.prefetch import TracePrefetcher
from offload.store.reclaim import Reclaimer
from offload.store.shard import Shard, Transfer
from offload.store.state import ShardState, Tier
from offload.store.stats import StoreCounters

if TYPE_CHECKING:  # pragma: no cover  (io is imported only when NVMe is used)
    from offload.io import BufferPool, NvmeStore

STAGING_BYTES = 8 * 2**20
"""Bytes of the staging buffer a store keeps for writes outside the pool (Note: synchronous
access)."""

logger = logging.getLogger("offload.store")


class TieredStore:
    """Shards in host memory and on NVMe under a hard host budget (see the module notes).

    Args:
        pool: host buffers for NVMe-homed shards (required for NVMe homes).
        nvme: the NVMe file store (required for NVMe homes).
        prefetch_depth: accesses of the recorded trace kept in flight ahead of use (count).
        name: config section this store serves (``offload_param``...), used in error messages.
    """

    def __init__(
        self,
        *,
        pool: BufferPool | None,
        nvme: NvmeStore | None,
        prefetch_depth: int = 2,
        name: str = "store",
    ) -> None:
        self.name = name
        self._pool = pool
        self._nvme = nvme
        self._prefetcher = TracePrefetcher(prefetch_depth)
        self._shards: dict[str, Shard] = {}
        self._inflight: dict[str, Shard] = {}
        self._wanted: dict[str, Tier] = {}
        self._clock = 0
        self._lock = threading.RLock()
        self._counters = StoreCounters()
        self._room = (
            Reclaimer(name, pool, self._prefetcher, self._counters, self._lock, self)
            if pool is not None
            else None
        )
        self._staging: torch.Tensor | None = None
        self._version: dict[str, Shard] | None = None  # shards written in the open version
        # kept for the next call that reports them, with their shard's key (a write-back's
        # error is forgotten with the copy it did not write: module Note, whose error)
        self._failures: list[tuple[str, Exception]] = []
        self._closed = False

    # -- registration ----------------------------------------------------------------------------
    def register(
        self,
        key: str,
        numel: int,
        dtype: torch.dtype,
        home: Tier,
        init: torch.Tensor | None = None,
        *,
        versioned: bool = False,
    ) -> None:
        """Add a shard of ``numel`` elements of ``dtype`` homed at ``home``, filled from ``init``
        (zeros without). ``versioned`` (NVMe homes): it takes part in versions (module Note).

        Raises:
            ValueError: bad key/size/home, or a shard that cannot fit a buffer (names the key
                to change, e.g. ``offload_param.buffer_size``).
        """
        with self._lock:
            self._check_open()
            home = Tier(home)
            if not isinstance(key, str) or not key:
                raise ValueError(f"{self.name}: shard key must be a non-empty str, got {key!r}")
            if key in self._shards:
                raise ValueError(f"{self.name}: shard {key!r} is already registered")
            if not isinstance(numel, int) or numel < 1:
                raise ValueError(f"{self.name}: shard {key!r} numel={numel!r}; allowed: int >= 1")
            nbytes = numel * dtype.itemsize
            if init is not None and init.numel() != numel:
                raise ValueError(
                    f"{self.name}: shard {key!r} init has {init.numel()} elements; allowed: "
                    f"exactly numel={numel}"
                )
            shard = Shard(key=key, numel=numel, dtype=dtype, home=home, io_nbytes=nbytes)
            if home is Tier.NVME:
                self._register_nvme(shard, init)
                if versioned:
                    shard.shadow = f"{key}#v"
                    self._nvme.allocate(shard.shadow, shard.io_nbytes)
            else:
                tensor = torch.empty(numel, dtype=dtype)
                if init is None:
                    tensor.zero_()
                else:
                    tensor.copy_(init.detach().reshape(-1))
                shard.home_tensor = tensor
            self._shards[key] = shard

    def _register_nvme(self, shard: Shard, init: torch.Tensor | None) -> None:
        key, nbytes = shard.key, shard.nbytes
        if self._room is None or self._nvme is None:
            raise ValueError(
                f"{self.name}: shard {key!r} has home NVME but the store was built "
                f"without {'a pool' if self._pool is None else 'an NvmeStore'}; allowed "
                "homes: HOST"
            )
        size = self._room.budget.buffer_size
        if nbytes > size:
            raise ValueError(
                f"{self.name}.buffer_size={size} bytes is too small for shard {key!r}: it "
                f"needs {nbytes} bytes ({shard.numel} x {shard.dtype}); allowed: "
                f"{self.name}.buffer_size >= {nbytes} (or split the shard smaller)"
            )
        shard.io_nbytes = min(round_up(nbytes), size)
        self._nvme.allocate(key, shard.io_nbytes)
        self._write_staged(key, shard, None if init is None else init.detach().reshape(-1))

    def unregister(self, key: str) -> None:
        """Forget ``key``: its cached copy is dropped unwritten and its disk extent freed. It
        must not be fetched; it also leaves the recorded trace's prefetches."""
        with self._lock:
            shard = self._get(key)
            if shard.pinned():
                raise RuntimeError(f"{self.name}: unregister({key!r}) while it is fetched")
            self._drop_copies(shard)
            self._wanted.pop(key, None)
            del self._shards[key]
            for extent in (shard.extent, shard.shadow) if shard.home is Tier.NVME else ():
                if extent is not None:
                    self._nvme.free(extent)

    # -- fetch / release -------------------------------------------------------------------------
    def fetch(
        self,
        key: str,
        tier: Tier = Tier.HOST,
        *,
        read: bool = True,
        readonly: bool = False,
        held: MutableSequence[str] | None = None,
        expected: bool = False,
    ) -> Fetch:
        """Pin ``key`` in host memory and start moving it there; ``wait()`` the result to use it.

        Each pin must be matched by one ``release``, also when the ``wait`` raised, or
        ``fetch`` itself after the pin (a Ctrl-C only: an error on the way is the wait's, the
        module Note on whose error). ``held``: the caller's record of what it holds, to which
        ``key`` is appended as it is pinned, with no call in between, so the record and the
        pins agree wherever an exception lands (a Ctrl-C above all, which Python raises at a
        call or a loop's jump): the caller releases exactly what its record holds.
        ``read=False``: the caller overwrites the whole copy (no disk read; the shard counts
        as dirty from now on). ``readonly``: the caller only reads the copy, so it need not
        wait for a write-back in flight (the Note on coherence); released clean.
        ``expected``: this is the fetch an :meth:`expect` announced (its hint ends here).
        """
        if readonly and not read:
            raise ValueError(f"{self.name}: fetch({key!r}) with both read=False and readonly")
        with self._lock:
            shard = self._get(key, tier)
            self._report()
            self._report_read(shard, read)
            # pinned first, and recorded with it: held even when what follows raises (the
            # prefetches pushed below submit reads and evict; a Ctrl-C may land there)
            shard.pins += 1
            if held is not None:
                held.append(key)
            if expected and self._room is not None:
                self._room.claimed(key)
            self._poll()
            self._clock += 1
            shard.last_used = self._clock
            if not read:
                shard.dirty = True
                shard.failed_read = None  # (one the poll above found): about the old value
            elif shard.home is Tier.NVME:
                self._counters.fetched_bytes += shard.io_nbytes
            # what fails on the way is raised by the wait (the module Note on whose error)
            self._quietly(self._advance, shard, read=read, blocking=False, readonly=readonly)
            return Fetch(self, shard, read, readonly)

    def release(
        self, key: str, tier: Tier = Tier.HOST, *, dirty: bool = False, discard: bool = False
    ) -> None:
        """The caller is done with its copy; ``dirty`` = it modified it.

        ``discard``: its values are not needed any more (a gradient the step has consumed). Once
        no fetch holds the shard its cached copy is dropped without being written home, and
        its value is undefined until the next ``fetch(read=False)`` overwrites it.
        """
        if dirty and discard:
            raise ValueError(f"{self.name}: release({key!r}) with both dirty and discard")
        with self._lock:
            shard = self._get(key, tier)
            if shard.pins <= 0:
                raise RuntimeError(
                    f"{self.name}: release({key!r}, {Tier(tier).name}) without a matching fetch"
                )
            shard.pins -= 1
            if dirty:
                shard.dirty = True
            self._quietly(self._released, shard, discard)

    def _released(self, shard: Shard, discard: bool) -> None:
        """What a release starts once its pin is given back (module Note: whose error)."""
        if discard:
            if not shard.pinned():
                self._drop_copies(shard)
        elif shard.dirty and shard.pins == 0:
            self._write_back(shard)
        self._poll()

    def take(
        self,
        key: str,
        tier: Tier = Tier.HOST,
        *,
        read: bool = True,
        expected: bool = False,
        held: MutableSequence[str] | None = None,
    ) -> torch.Tensor:
        """``fetch`` + ``wait``: the host copy, pinned until the caller's ``release``. If the
        fetch or its wait fails, nothing stays pinned (a read's IO error, a Ctrl-C) and the
        copy is dropped unwritten. ``expected``: as ``fetch``'s. ``held``: the caller's record
        of its pins, as ``fetch``'s; given, the caller releases (``discard``) what it records
        when anything fails, this call included: a Ctrl-C delivered as this call returns
        (CPython runs a pending handler right after a call) loses the copy it returned, which
        only such a record still names."""
        if held is not None:
            return self.fetch(key, tier, read=read, held=held, expected=expected).wait()
        mine: list[str] = []  # empty when the fetch raised before its pin
        try:
            return self.fetch(key, tier, read=read, held=mine, expected=expected).wait()
        except BaseException:
            if mine:
                with contextlib.suppress(Exception):  # the fetch's own error is raised
                    self.release(key, tier, discard=True)
            raise

    @contextlib.contextmanager
    def borrow(self, key: str, *, read: bool = True):
        """``fetch`` + ``wait`` + ``release``: the block gets the host copy, which is released
        dirty when it ends. If the block (or the read) fails, the copy is dropped unwritten
        (the shard keeps its value from before) and the error goes up."""
        held: list[str] = []  # the pin, once taken (take's Note on a Ctrl-C as it returns)
        # One block for a Ctrl-C: the take, the caller's block (a piece's sum or copy) and the
        # release. Landing at the release's first line, it left the shard pinned for good;
        # landing in the take or the block, the release below ran in its unwinding, where a
        # second Ctrl-C (a user pressing it twice) landed first: the same (AGAIN in
        # tests/_ctrl_c_points.py). It comes out once the copy is released
        with interrupts_deferred():
            try:
                buf = self.take(key, read=read, held=held)
                yield buf
                self.release(key, Tier.HOST, dirty=True)
                held.clear()
            except BaseException:
                if held:
                    self.release(key, Tier.HOST, discard=True)
                raise

    # the Fetch's side (see fetch.Driver)
    def drive(self, shard: Shard, read: bool, blocking: bool, readonly: bool = False) -> bool:
        with self._lock:
            if blocking:
                self._check_open()
                if shard.pins <= 0:
                    raise RuntimeError(f"{self.name}: wait on {shard.key!r} after it was released")
                self._report()
                self._report_read(shard, read)
            else:
                self._poll()
            return self._advance(shard, read=read, blocking=blocking, readonly=readonly)

    def view(self, shard: Shard) -> torch.Tensor:
        return shard.host_view()

    # -- trace ------------------------------------------------------------------------------------
    def use(self, key: str, tier: Tier = Tier.HOST) -> None:
        """Record an access in the trace; while replaying, fetch the next accesses ahead."""
        with self._lock:
            shard = self._get(key, tier)
            self._report()
            self._poll()
            if self._prefetcher.replaying:
                hit = shard.heading_home() or (key in self._wanted and shard.pending is not None)
                self._counters.prefetch(hit)
            self._clock += 1
            shard.last_used = self._clock
            ahead = self._prefetcher.use((key, Tier.HOST))
            self._want(ahead)

    def read_ahead(self, keys: Iterable[str], tier: Tier = Tier.HOST) -> None:
        """A hint: ``keys`` will be fetched soon; start reading those only on NVMe now. These
        reads are prefetches (the reclaimer's Note): they take a free buffer or one a prefetch
        may take, pin nothing, a demand fetch may evict them, and a hint nobody follows costs
        its read only."""
        with self._lock:
            self._report()
            self._poll()
            for key in keys:
                shard = self._get(key, tier)  # a host-homed shard is always ready()
                if self._wants_read(shard) and shard.pending is None:  # not already on its way
                    self._prefetch(shard, hint=True)

    def begin_iteration(self) -> None:
        """Start of an iteration (replays the recorded trace if there is one)."""
        with self._lock:
            self._report()
            self._poll()
            self._prefetcher.begin_iteration()

    def expect(self, keys: Iterable[str]) -> None:
        """A hint: ``keys`` will be fetched soon, outside the trace, by a ``fetch(...,
        expected=True)``; until then eviction keeps their cached copies (the reclaimer's Note
        on expected copies). The iteration's end forgets a hint nobody followed."""
        with self._lock:
            if self._room is not None:
                self._room.expect(keys)

    def end_iteration(self) -> None:
        """End of an iteration; re-records quietly if the order changed; prefetches the head."""
        with self._lock:
            if self._room is not None:
                self._room.forget_expected()
            head = self._prefetcher.end_iteration()
            self._counters.rerecords = self._prefetcher.rerecords
            self._want(head)

    # -- versions ------------------------------------------------------------------------------
    def begin_version(self) -> None:
        """From now on versioned shards are written to their other extent (module Note)."""
        with self._lock:
            if self._version is not None:
                raise RuntimeError(f"{self.name}: begin_version() inside a version")
            self._version = {}

    def settle_version(self) -> None:
        """Waits until every write of the open version is on disk, and raises what failed
        meanwhile (a write of the version above all: the version is still open, for a
        rollback). A commit over several stores settles each first, so that no store commits
        and another then fails."""
        with self._lock:
            self._report()
            self._collect_version("commit_version", fetched_ok=True)

    def commit_version(self) -> int:
        """Keeps what the version wrote: its extents become the committed ones once every write
        is on disk (:meth:`settle_version` first, to learn of a failed write while the version
        can still be rolled back). Returns the number of shards it wrote."""
        with self._lock:
            version = self._collect_version("commit_version", fetched_ok=True)
            for shard in version:
                shard.extent, shard.shadow = shard.shadow, shard.extent
            self._version = None
            return len(version)

    def rollback_version(self) -> int:
        """Undoes the version: every copy it wrote is dropped and the committed extents, never
        written by it, hold the values from before. Returns the number of shards it wrote.

        A write of the version that failed (the usual reason for a rollback) is not raised
        again: its value is dropped all the same, and the version ends whatever happens, so
        that a store is never left inside one (every later ``write_from`` refused it, a
        checkpoint's load included). A released copy the version wrote but has not written
        back yet is dropped without being written."""
        with self._lock:
            if self._version is None:
                raise RuntimeError(f"{self.name}: rollback_version() without begin_version()")
            for shard in self._version.values():  # (refused: the version stays open)
                if shard.pinned():
                    raise RuntimeError(
                        f"{self.name}: rollback_version() while {shard.key!r} is fetched"
                    )
            try:
                for shard in self._on_versioned_dirty():
                    self._version[shard.key] = shard  # the version's value: dropped unwritten
                version = list(self._version.values())
                for shard in version:
                    self._drop_copies(shard)
            finally:
                self._version = None
            return len(version)

    def _collect_version(self, what: str, fetched_ok: bool = False) -> list[Shard]:
        """The shards the open version wrote, every write of theirs settled. ``fetched_ok``:
        one may be fetched again meanwhile (a reader of the new value: a commit keeps its copy,
        and a later dirty release writes the committed extent, as any write outside a version);
        a rollback, which must drop every copy the version wrote, refuses that."""
        if self._version is None:
            raise RuntimeError(f"{self.name}: {what}() without begin_version()")
        for shard in list(self._on_versioned_dirty()):  # released dirty, write not issued yet
            self._write_back(shard)
        shards = list(self._version.values())
        for shard in shards:
            if shard.pinned() and not fetched_ok:
                raise RuntimeError(f"{self.name}: {what}() while {shard.key!r} is fetched")
            self._settle(shard)
        return shards

    def _on_versioned_dirty(self):
        cached = self._room.cached.values() if self._room is not None else ()
        return [s for s in cached if s.shadow is not None and s.dirty and not s.pinned()]

    def _source(self, shard: Shard) -> str:
        """The extent holding the shard's newest value: the version's, once it wrote it."""
        if self._version is not None and shard.key in self._version:
            return shard.shadow
        return shard.extent

    # -- synchronous access (checkpoints) ----------------------------------------------------------
    def read_into(self, key: str, out: torch.Tensor, *, committed: bool = False) -> None:
        """Copy the newest data of ``key`` into ``out`` (``numel`` elements), synchronously.
        ``committed``: inside a version, the value a rollback would restore (the committed
        extent) rather than the one the version wrote. A transfer of the shard in flight is
        waited out and its failure kept, not raised here: a read ahead's is the next fetch's
        (this read reads the extent itself), and a failed write-back's copy is the newest
        value, read here all the same."""
        with self._lock:
            shard = self._get(key)
            self._check_out(shard, out, "read_into")
            self._quietly(self._settle, shard)  # kept, whoever it concerns (Note: whose error)
            written = self._version is not None and shard.key in self._version
            if shard.state is ShardState.HOST and not (committed and written):
                out.copy_(shard.host_view().reshape(out.shape))
                return
            out.copy_(self._read_extent(shard, committed).reshape(out.shape))

    def read(self, key: str, *, committed: bool = False) -> torch.Tensor:
        """A new 1-D host tensor with the newest data of ``key`` (``committed`` as in
        :meth:`read_into`). Read from NVMe, it is the buffer the read went into, not a copy of
        it (Note: synchronous access)."""
        with self._lock:
            shard = self._get(key)
            self._quietly(self._settle, shard)  # as read_into's
            written = self._version is not None and shard.key in self._version
            if shard.state is ShardState.HOST and not (committed and written):
                return shard.host_view().reshape(-1).clone()
            return self._read_extent(shard, committed)

    def _read_extent(self, shard: Shard, committed: bool) -> torch.Tensor:
        """The shard's elements read from its NVMe extent (the committed one with
        ``committed``) into a buffer of this call's own (Note: synchronous access)."""
        from offload.io import aligned_empty  # noqa: PLC0415 (only needed with NVMe)

        whole = aligned_empty(round_up(shard.io_nbytes))[: shard.io_nbytes]
        with interrupts_deferred():  # (the Note on Ctrl-C and IO in flight)
            self._nvme.read(shard.extent if committed else self._source(shard), whole).wait()
        self._counters.moved(Tier.NVME, Tier.HOST, shard.io_nbytes)
        return whole[: shard.nbytes].view(shard.dtype)

    def write_from(self, key: str, src: torch.Tensor) -> None:
        """Overwrite ``key`` at its home with ``src`` (``numel`` elements), synchronously.

        A cached copy is dropped; the shard must not be fetched by anyone.
        """
        with self._lock:
            shard = self._get(key)
            self._check_out(shard, src, "write_from")
            if shard.pinned():
                raise RuntimeError(f"{self.name}: write_from({key!r}) while it is fetched")
            if self._version is not None and shard.shadow is not None:
                raise RuntimeError(f"{self.name}: write_from({key!r}) inside a version")
            self._drop_copies(shard)
            flat = src.detach().reshape(-1)
            if shard.home_tensor is not None:
                shard.home_tensor.copy_(flat)
                return
            self._write_staged(shard.extent, shard, flat)

    # -- housekeeping --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for every transfer in flight; afterwards every released dirty copy is home.

        A copy whose write-back failed earlier is written again here (errors are raised).
        """
        with self._lock:
            self._drain()
            cached = list(self._room.cached.values()) if self._room is not None else []
            for shard in cached:  # a transfer an interrupt left unrecorded (see finish)
                self._settle(shard)
            for shard in cached:
                if shard.dirty and not shard.pinned() and shard.pending is None:
                    self._write_back(shard)
            self._drain()
            self._report()

    def _drain(self) -> None:
        """Waits for every transfer in flight; what fails is kept (the module Note on whose
        error): a read ahead's for its shard, a write-back's for the flush's report."""
        while self._inflight:
            self._quietly(self.finish, next(iter(self._inflight.values())))

    def writing(self, key: str) -> bool:
        """Whether ``key``'s copy is being written home now (a ``readonly`` fetch may hold it
        meanwhile; its pages must then stay where they are)."""
        with self._lock:
            return self._get(key).state is ShardState.WRITING_BACK

    def state(self, key: str) -> ShardState:
        """The shard's current state (for tests and telemetry)."""
        with self._lock:
            return self._get(key).state

    def __contains__(self, key: object) -> bool:
        return key in self._shards

    def stats(self) -> dict:
        """Counters as a plain dict (JSON-able).

        Keys: ``tiers`` -> ``{"nvme->host"|"host->nvme": {bytes, transfers, wait_seconds}}``;
        ``prefetch_hits``, ``prefetch_misses``, ``prefetch_hit_rate``, ``prefetches_started``
        (the trace's), ``read_aheads_started`` (``read_ahead`` hints'), ``prefetches_deferred``
        (either's), ``rerecords``; ``evictions`` -> ``{host}``; ``budget_waits``;
        ``fetched_bytes``;
        ``host_buffers``, ``host_buffer_size``, ``host_reserved_bytes`` (the pool: count x size),
        ``host_buffers_in_use``, ``peak_host_buffers``, ``peak_host_bytes`` (the most bytes of
        shards held in buffers at once: what the pool's pages held, not what it reserved).
        """
        with self._lock:
            host = self._room.stats() if self._room is not None else _NO_POOL
            return self._counters.as_dict(host=host)

    def close(self) -> None:
        """Finish transfers, return every buffer (the pool and NvmeStore stay open)."""
        with self._lock:
            if self._closed:
                return
            try:
                self.flush()
            finally:  # what failed was raised; the buffers go back all the same, once
                # nothing in flight may still write into one (a flush stopped between two
                # transfers left the rest in flight; given back under a read, another user of
                # the pool had its copy overwritten). One block: stopped inside it, the next
                # close flushed a store half given back
                with interrupts_deferred():
                    self._wait_out()
                    if self._room is not None:
                        self._room.close()
                    self._shards.clear()
                    self._staging = None
                    self._closed = True

    def _wait_out(self) -> None:
        """Waits for every transfer in flight, dropping its error (the caller has its own)."""
        while self._inflight:
            with contextlib.suppress(Exception):
                self.finish(next(iter(self._inflight.values())))

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the state machine driver --------------------------------------------------------------------
    def _advance(
        self,
        shard: Shard,
        *,
        read: bool,
        blocking: bool,
        prefetch: bool = False,
        readonly: bool = False,
    ) -> bool:
        """Take every step toward a usable host copy; True once there (for a ``readonly``
        fetch, a copy being written back is one: the Note on coherence).

        Non-blocking calls stop at the first transfer in flight or missing buffer.
        """
        since = None  # when this call began waiting for the pool
        while True:
            if readonly and shard.state is ShardState.WRITING_BACK:
                return True
            if shard.pending is not None:
                if not shard.pending.done():
                    if not blocking:
                        return False
                    self._room.block_on(shard.pending)
                    continue  # another thread may have finished it meanwhile: look again
                if read or shard.state is not ShardState.TO_HOST:
                    self.finish(shard)
                else:  # a read of the value this caller overwrites: its failure is moot
                    with contextlib.suppress(Exception):
                        self.finish(shard)
                continue
            if shard.ready():
                return True
            # NVME: take a buffer and read into it (unless the caller overwrites it), the
            # buffer passing from the pool to the shard in one block (the Note on Ctrl-C and
            # IO in flight); waiting for room, none is held
            with interrupts_deferred():
                buf = self._room.take(shard, prefetch=prefetch)
                if buf is not None:
                    self._load(shard, buf, read)
                    continue
            if not blocking:
                return False
            since = self._room.wait_for_room(shard, since)  # (the lock let go: look again)

    def _load(self, shard: Shard, buf: torch.Tensor, read: bool) -> None:
        """``shard`` (on NVMe) takes ``buf``, and the read of its values into it is submitted
        unless ``read`` is False; inside the caller's block for a Ctrl-C."""
        transfer = None
        if read:
            try:
                handle = self._nvme.read(self._source(shard), buf[: shard.io_nbytes])
            except BaseException:
                self._room.budget.give(buf)  # refused at submission: it goes back
                raise
            transfer = Transfer(Tier.NVME, Tier.HOST, shard.io_nbytes, handle, keep=buf)
        shard.load_host(buf, transfer)
        self._room.took(shard)
        self._issued(shard, transfer)

    def _issued(self, shard: Shard, transfer: Transfer | None) -> None:
        if transfer is not None:
            self._inflight[shard.key] = shard
            self._counters.moved(transfer.src, transfer.dst, transfer.nbytes)

    # the reclaimer's side (see reclaim.Transfers)
    def in_flight(self) -> Iterable[Shard]:
        return self._inflight.values()

    def finish_other(self, shard: Shard) -> None:
        self._quietly(self.finish, shard)

    def finish(self, shard: Shard) -> None:
        """Wait for the shard's pending transfer and apply its transition."""
        transfer = shard.pending
        assert transfer is not None
        try:
            waited = transfer.wait()
        except BaseException:
            with interrupts_deferred():  # (as below)
                self._inflight.pop(shard.key, None)
                self._abort(shard)
            raise
        # the transition whole: a Ctrl-C inside it (the shard's state moved after its
        # transfer was dropped) left the shard in flight with no transfer, its buffer lost
        # for good; a pool a buffer short then deadlocked the next step's update against
        # the backward (tests/_ctrl_c_points.py)
        with interrupts_deferred():
            self._counters.waited(transfer.src, transfer.dst, waited)
            self._inflight.pop(shard.key, None)
            shard.finish_pending()

    def _settle(self, shard: Shard) -> None:
        while shard.pending is not None:
            self.finish(shard)

    def _poll(self) -> None:
        """Complete finished transfers and push wanted prefetches forward; never blocks, and
        never raises what failed there (module Note: whose error)."""
        for shard in list(self._inflight.values()):
            if shard.pending is not None and shard.pending.done():
                self._quietly(self.finish, shard)
        for key in list(self._wanted):
            shard = self._shards[key]
            if shard.ready():
                del self._wanted[key]
            elif self._wants_read(shard):
                self._quietly(self._advance, shard, read=True, blocking=False, prefetch=True)

    def _quietly(self, step, shard: Shard, *args, **kwargs) -> None:
        """Runs work on ``shard`` done for no caller in particular; an error is kept, a failed
        read's for the shard's next fetch, any other for :meth:`_report` (the module Note on
        whose error; a Ctrl-C is the caller's: it goes up)."""
        try:
            step(shard, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - kept, and raised by the next call that reports
            if shard.state is ShardState.NVME:  # its read failed: nothing changed on disk
                shard.failed_read = shard.failed_read or exc
            else:
                self._failures.append((shard.key, exc))

    @staticmethod
    def _report_read(shard: Shard, read: bool = True) -> None:
        """Raises the failed read kept for ``shard``, once (the next fetch reads it again);
        forgets it for a caller that overwrites the value (``read`` False)."""
        failure, shard.failed_read = shard.failed_read, None
        if failure is not None and read:
            raise failure

    def _report(self) -> None:
        """Raises the first error :meth:`_quietly` kept since the last report, if any (a
        failed read is its shard's: :meth:`_report_read`)."""
        if not self._failures:
            return
        (_, failure), more = self._failures[0], len(self._failures) - 1
        self._failures.clear()
        if more:
            failure.add_note(f"{self.name}: {more} more transfer(s) failed after it")
        raise failure

    def _want(self, items: list) -> None:
        wanted: dict[str, Tier] = {}
        for key, tier in items:
            shard = self._shards.get(key)
            if shard is not None and shard.home is Tier.NVME:
                wanted[key] = tier
        self._wanted = wanted
        for key in wanted:
            shard = self._shards[key]
            if self._wants_read(shard):
                self._prefetch(shard)

    @staticmethod
    def _wants_read(shard: Shard) -> bool:
        """Whether a prefetch may read ``shard``: not in memory already, nor in a caller's hands
        (pinned, or dirty: its host copy is the newest), nor waiting to report a failed read to
        its next fetch, which reads it again."""
        return not (shard.pinned() or shard.dirty or shard.ready() or shard.failed_read)

    def _prefetch(self, shard: Shard, hint: bool = False) -> None:
        """Start reading ``shard`` as a prefetch (never blocks, never raises: the module Note
        on whose error); counted started (the trace's, or a ``read_ahead`` ``hint``'s) or
        deferred."""
        before = shard.state
        self._quietly(self._advance, shard, read=True, blocking=False, prefetch=True)
        self._counters.prefetch_started(shard.state is not before, hint)

    # -- write-back ------------------------------------------------------------------------------------
    def _write_back(self, shard: Shard) -> None:
        """Start writing a dirty, fully released host copy home (asynchronously)."""
        self._settle(shard)  # an earlier write-back of this shard goes first (same extent)
        if shard.home is Tier.HOST or not shard.dirty:
            shard.dirty = False  # the host copy is the home: nothing to move
            return
        # refused at submission (an error; a Ctrl-C waits for the block's end): nothing was
        # written, the copy stays dirty and cached, and the error goes up
        target = shard.extent
        with interrupts_deferred():  # (the Note on Ctrl-C and IO in flight)
            if self._version is not None and shard.shadow is not None:
                target = shard.shadow  # the version's own extent (see the Note)
                self._version[shard.key] = shard
            handle = self._nvme.write(target, shard.host_io_view())
            transfer = Transfer(Tier.HOST, Tier.NVME, shard.io_nbytes, handle, keep=shard.host_buf)
            shard.write_back(transfer)
            self._issued(shard, transfer)

    def _abort(self, shard: Shard) -> None:
        """Roll a failed transfer back to a consistent state (the error is re-raised by the
        caller): a failed read frees its buffer (NVME again, retried on the next fetch); a failed
        write-back leaves the copy dirty and cached, so no byte is lost and the next dirty
        release writes it again."""
        buf = shard.abort_pending()
        if buf is not None:
            self._room.give_aborted(shard, buf)

    def _drop_copies(self, shard: Shard) -> None:
        """A released shard whose value is not needed (replaced, discarded, rolled back): a
        transfer in flight is waited for, its failure dropped with the value it moved (the
        module Note on whose error); the cached copy goes, nothing is written, and a failed
        read of the old value or write of the copy is forgotten."""
        with contextlib.suppress(Exception):  # (a Ctrl-C goes up)
            self._settle(shard)
        shard.dirty, shard.failed_read = False, None
        if self._failures:  # a failed write-back of the copy that goes
            self._failures = [(key, exc) for key, exc in self._failures if key != shard.key]
        if shard.state is ShardState.HOST and shard.home is Tier.NVME:
            self._room.give_buf(shard)

    # -- helpers -------------------------------------------------------------------------------------------
    def _get(self, key: str, tier: Tier | None = None) -> Shard:
        self._check_open()
        shard = self._shards.get(key)
        if shard is None:
            raise KeyError(f"{self.name}: unknown shard {key!r} (register it first)")
        if tier is not None and Tier(tier) is not Tier.HOST:
            raise ValueError(
                f"{self.name}: cannot fetch {key!r} at {Tier(tier).name}: shards are fetched "
                "into host memory; allowed tiers: HOST"
            )
        return shard

    def _check_out(self, shard: Shard, t: torch.Tensor, what: str) -> None:
        if t.numel() != shard.numel:
            raise ValueError(
                f"{self.name}: {what}({shard.key!r}) got {t.numel()} elements; allowed: exactly "
                f"{shard.numel}"
            )

    def _write_staged(self, extent: str, shard: Shard, flat: torch.Tensor | None) -> None:
        """Writes ``flat`` (the shard's elements in any dtype, zeros when None), padded with
        zeros to ``shard.io_nbytes``, to the NVMe extent ``extent``, through the kept staging
        a chunk of at most ``STAGING_BYTES`` at a time (Note: synchronous access)."""
        from offload.io import aligned_empty  # noqa: PLC0415 (io is only needed with NVMe)

        chunk = min(STAGING_BYTES, round_up(max(shard.io_nbytes, 1)))
        if self._staging is None or self._staging.numel() < chunk:
            self._staging = aligned_empty(chunk)
        size = shard.dtype.itemsize
        numel = 0 if flat is None else flat.numel()
        for offset in range(0, shard.io_nbytes, chunk):
            staging = self._staging[: min(chunk, shard.io_nbytes - offset)]
            first = offset // size  # (chunks are whole elements: 4096-aligned)
            n = max(0, min(numel - first, staging.numel() // size))
            if n:
                staging[: n * size].view(shard.dtype).copy_(flat[first : first + n])
            staging[n * size :].zero_()
            with interrupts_deferred():  # (the Note on Ctrl-C and IO in flight)
                self._nvme.write(extent, staging, offset).wait()
        self._counters.moved(Tier.HOST, Tier.NVME, shard.io_nbytes)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name}: the store is closed")


_NO_POOL = {
    "host_buffers": 0,
    "host_buffer_size": 0,
    "host_reserved_bytes": 0,
    "host_buffers_in_use": 0,
    "peak_host_buffers": 0,
    "peak_host_bytes": 0,
}
