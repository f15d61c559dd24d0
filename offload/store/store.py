"""``TieredStore``: where every shard lives, hard budgets, asynchronous moves, trace-driven prefetch.

Note: one shard, three tiers
    Each shard has a home (NVMe file, host tensor or device tensor) and at most one cached copy
    on each tier above it, in an inclusive hierarchy (``state.py``). ``fetch(key, tier)`` pins the
    shard at ``tier``, starts whatever transfers it can without blocking, and returns a ``Fetch``;
    ``Fetch.wait()`` drives the remaining steps (blocking on the transfer records) and returns the
    typed view. ``release(key, tier, dirty=...)`` unpins; the last dirty release starts the
    write-back home (device -> host copy, then host -> NVMe) at once, asynchronously. Budgets,
    eviction and the rule that a prefetch never starves a demand fetch: ``reclaim.py``.

Note: coherence
    A dirty release at the host tier drops a device copy (it is stale); ``fetch(..., read=False)``
    marks the shard dirty at once (the caller promised to overwrite it, so the old bytes must
    never be mistaken for valid data), and at the host tier it drops the device copy too. A fetch
    that hands out a copy while its write-back is in flight first waits for the write-back.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import torch

from offload.store.budget import DeviceBudget, HostBudget, round_up
from offload.store.device import DeviceCopier
from offload.store.fetch import Fetch
from offload.store.prefetch import TracePrefetcher
from offload.store.reclaim import Reclaimer
from offload.store.shard import Shard, Transfer
from offload.store.state import ShardState, Tier
from offload.store.stats import StoreCounters

if TYPE_CHECKING:  # pragma: no cover  (io is imported only when NVMe is used)
    from offload.io import BufferPool, NvmeStore

logger = logging.getLogger("offload.store")


class TieredStore(Reclaimer):
    """Shards across device, host and NVMe with hard budgets (see the module notes).

    Args:
        device: the compute device (``cpu`` or ``cuda:N``); the DEVICE tier lives there.
        pool: host buffers for NVMe-homed shards (required for NVMe homes).
        nvme: the NVMe file store (required for NVMe homes).
        device_budget: bytes of device slabs for cached device copies; 0 = no cap, and then
            released device copies are not kept.
        prefetch_depth: accesses of the recorded trace kept in flight ahead of use (count).
        name: config section this store serves (``offload_param``...), used in error messages.
    """

    def __init__(
        self,
        *,
        device: torch.device | str,
        pool: BufferPool | None,
        nvme: NvmeStore | None,
        device_budget: int = 0,
        prefetch_depth: int = 2,
        name: str = "store",
    ) -> None:
        self.name = name
        self._copier = DeviceCopier(device)
        self.device = self._copier.device
        self._pool = pool
        self._nvme = nvme
        self._host = HostBudget(pool) if pool is not None else None
        self._slabs = DeviceBudget(device_budget, self._copier.empty)
        self._prefetcher = TracePrefetcher(prefetch_depth)
        self._shards: dict[str, Shard] = {}
        self._inflight: dict[str, Shard] = {}
        self._wanted: dict[str, Tier] = {}
        # shards holding a pool buffer / a device slab: the only eviction candidates
        self._on_host: dict[str, Shard] = {}
        self._on_device: dict[str, Shard] = {}
        self._clock = 0
        self._lock = threading.RLock()
        self._counters = StoreCounters()
        self._staging: torch.Tensor | None = None
        self._closed = False

    # -- registration ----------------------------------------------------------------------------
    def register(
        self,
        key: str,
        numel: int,
        dtype: torch.dtype,
        home: Tier,
        init: torch.Tensor | None = None,
    ) -> None:
        """Add a shard of ``numel`` elements of ``dtype`` homed at ``home``, filled from ``init``.

        Raises:
            ValueError: bad key/size/home, or a shard that cannot fit its budget (names the key
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
            if home is not Tier.DEVICE and not self._slabs.fits(nbytes):
                raise ValueError(
                    f"{self.name}.device_budget={self._slabs.budget} bytes is too small for shard "
                    f"{key!r} ({nbytes} bytes = {numel} x {dtype}); allowed: device_budget >= "
                    f"{round_up(nbytes)} (or 0 for no cap)"
                )
            io_nbytes = nbytes
            if home is Tier.NVME:
                if self._pool is None or self._nvme is None:
                    raise ValueError(
                        f"{self.name}: shard {key!r} has home NVME but the store was built "
                        f"without {'a pool' if self._pool is None else 'an NvmeStore'}; allowed "
                        "homes: HOST, DEVICE"
                    )
                size = self._host.buffer_size
                if nbytes > size:
                    raise ValueError(
                        f"{self.name}.buffer_size={size} bytes is too small for shard {key!r}: "
                        f"it needs {nbytes} bytes ({numel} x {dtype}); allowed: "
                        f"{self.name}.buffer_size >= {nbytes} (or split the shard smaller)"
                    )
                io_nbytes = min(round_up(nbytes), size)
            shard = Shard(key=key, numel=numel, dtype=dtype, home=home, io_nbytes=io_nbytes)
            if home is Tier.NVME:
                self._nvme.allocate(key, io_nbytes)
                staging = self._staging_bytes(io_nbytes)
                staging.zero_()
                if init is not None:
                    staging[:nbytes].view(dtype).copy_(init.detach().reshape(-1))
                self._nvme.write(key, staging).wait()
                self._counters.moved(Tier.HOST, Tier.NVME, io_nbytes)
            else:
                if home is Tier.HOST:
                    tensor = torch.empty(numel, dtype=dtype, pin_memory=self._copier.is_cuda)
                else:
                    tensor = torch.empty(numel, dtype=dtype, device=self.device)
                if init is None:
                    tensor.zero_()
                else:
                    tensor.copy_(init.detach().reshape(-1))
                shard.home_tensor = tensor
            self._shards[key] = shard

    # -- fetch / release -------------------------------------------------------------------------
    def fetch(self, key: str, tier: Tier, *, read: bool = True) -> Fetch:
        """Pin ``key`` at ``tier`` and start moving it there; ``wait()`` the result to use it.

        Each ``fetch`` must be matched by one ``release``. ``read=False``: the caller overwrites
        the whole copy (no disk read; the shard counts as dirty from now on).
        """
        with self._lock:
            tier = Tier(tier)
            shard = self._get(key, tier)
            self._poll()
            self._clock += 1
            shard.last_used = self._clock
            if not read:
                shard.dirty = True
            shard.pins[tier] += 1
            self._advance(shard, tier, read=read, blocking=False)
            return Fetch(self, shard, tier, read)

    def release(self, key: str, tier: Tier, *, dirty: bool = False, discard: bool = False) -> None:
        """The caller is done with its copy at ``tier``; ``dirty`` = it modified it.

        ``discard``: its values are not needed any more (a gradient the step has consumed). Once
        no fetch holds the shard its cached copies are dropped without being written home, and
        its value is undefined until the next ``fetch(read=False)`` overwrites it.
        """
        if dirty and discard:
            raise ValueError(f"{self.name}: release({key!r}) with both dirty and discard")
        with self._lock:
            tier = Tier(tier)
            shard = self._get(key, tier)
            if shard.pins[tier] <= 0:
                raise RuntimeError(
                    f"{self.name}: release({key!r}, {tier.name}) without a matching fetch"
                )
            shard.pins[tier] -= 1
            if tier is Tier.DEVICE and shard.slab is not None:
                shard.slab.fence = self._copier.fence()  # see device.py, Note: streams and events
            if discard:
                if not shard.pinned():
                    self._drop_copies(shard)
                self._poll()
                return
            if dirty:
                shard.dirty = True
                if tier is Tier.HOST:
                    self._settle(shard)
                    if shard.state is ShardState.DEVICE and shard.home is not Tier.DEVICE:
                        self._drop_device_for_write(shard, "release(dirty=True) at HOST")
            if shard.dirty and shard.pins[tier] == 0:
                self._write_back(shard)
            if (
                tier is Tier.DEVICE
                and self._slabs.budget == 0
                and shard.home is not Tier.DEVICE
                and not shard.pinned()
            ):
                self._settle(shard)
                if shard.state is ShardState.DEVICE and not shard.dirty:
                    self._give_slab(shard)  # no cap: nothing cached on device
            self._poll()

    # -- trace ------------------------------------------------------------------------------------
    def use(self, key: str, tier: Tier) -> None:
        """Record an access in the trace; while replaying, fetch the next accesses ahead."""
        with self._lock:
            tier = Tier(tier)
            shard = self._get(key, tier)
            self._poll()
            if self._prefetcher.replaying:
                hit = shard.heading_to(tier) or (
                    self._wanted.get(key, Tier.NVME) >= tier and shard.pending is not None
                )
                self._counters.prefetch(hit)
            self._clock += 1
            shard.last_used = self._clock
            ahead = self._prefetcher.use((key, tier))
            self._want(ahead)

    def begin_iteration(self) -> None:
        """Start of an iteration (replays the recorded trace if there is one)."""
        with self._lock:
            self._poll()
            self._prefetcher.begin_iteration()

    def end_iteration(self) -> None:
        """End of an iteration; re-records quietly if the order changed; prefetches the head."""
        with self._lock:
            head = self._prefetcher.end_iteration()
            self._counters.rerecords = self._prefetcher.rerecords
            self._want(head)

    # -- synchronous access (checkpoints) ----------------------------------------------------------
    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Copy the newest data of ``key`` into ``out`` (``numel`` elements), synchronously."""
        with self._lock:
            shard = self._get(key, None)
            self._check_out(shard, out, "read_into")
            self._settle(shard)
            if shard.state is ShardState.DEVICE:
                out.copy_(shard.device_view().reshape(out.shape))
            elif shard.state is ShardState.HOST:
                out.copy_(shard.host_view().reshape(out.shape))
            else:
                staging = self._staging_bytes(shard.io_nbytes)
                self._nvme.read(key, staging).wait()
                self._counters.moved(Tier.NVME, Tier.HOST, shard.io_nbytes)
                out.copy_(staging[: shard.nbytes].view(shard.dtype).reshape(out.shape))

    def write_from(self, key: str, src: torch.Tensor) -> None:
        """Overwrite ``key`` at its home with ``src`` (``numel`` elements), synchronously.

        Cached copies are dropped; the shard must not be fetched by anyone.
        """
        with self._lock:
            shard = self._get(key, None)
            self._check_out(shard, src, "write_from")
            if shard.pinned():
                raise RuntimeError(f"{self.name}: write_from({key!r}) while it is fetched")
            self._settle(shard)
            if shard.state is ShardState.DEVICE and shard.home is not Tier.DEVICE:
                self._give_slab(shard)
            if shard.state is ShardState.HOST and shard.home is Tier.NVME:
                self._give_buf(shard)
            shard.dirty = False
            flat = src.detach().reshape(-1)
            if shard.home_tensor is not None:
                shard.home_tensor.copy_(flat)
                return
            staging = self._staging_bytes(shard.io_nbytes)
            staging.zero_()
            staging[: shard.nbytes].view(shard.dtype).copy_(flat)
            self._nvme.write(key, staging).wait()
            self._counters.moved(Tier.HOST, Tier.NVME, shard.io_nbytes)

    # -- housekeeping --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for every transfer in flight; afterwards every released dirty copy is home.

        A copy whose write-back failed earlier is written again here (errors are raised).
        """
        with self._lock:
            self._drain()
            cached = [*self._on_host.values(), *self._on_device.values()]
            for shard in cached:  # a transfer an interrupt left unrecorded (see _finish)
                self._settle(shard)
            for shard in cached:
                if shard.dirty and not shard.pinned() and shard.pending is None:
                    self._write_back(shard)
            self._drain()

    def _drain(self) -> None:
        while self._inflight:
            self._finish(next(iter(self._inflight.values())))

    def state(self, key: str) -> ShardState:
        """The shard's current state (for tests and telemetry)."""
        with self._lock:
            return self._get(key, None).state

    def __contains__(self, key: object) -> bool:
        return key in self._shards

    def stats(self) -> dict:
        """Counters as a plain dict (JSON-able).

        Keys: ``tiers`` -> ``{"nvme->host"|"host->nvme"|"host->device"|"device->host": {bytes,
        transfers, wait_seconds}}``; ``prefetch_hits``, ``prefetch_misses``, ``prefetch_hit_rate``,
        ``prefetches_started``, ``prefetches_deferred``, ``rerecords``; ``evictions`` ->
        ``{host, device}``; ``budget_waits``; ``host_buffers``, ``host_buffer_size``,
        ``host_buffers_in_use``, ``peak_host_buffers``, ``peak_host_bytes``; ``device_budget``,
        ``device_allocated_bytes``, ``device_in_use_bytes``, ``peak_device_bytes``,
        ``peak_device_in_use_bytes``, ``device_slab_allocations``.
        """
        with self._lock:
            host = self._host
            count = host.capacity if host else 0
            size = host.buffer_size if host else 0
            slabs = self._slabs
            return self._counters.as_dict(
                host={
                    "host_buffers": count,
                    "host_buffer_size": size,
                    "host_buffers_in_use": host.in_use if host else 0,
                    "peak_host_buffers": host.peak if host else 0,
                    "peak_host_bytes": (host.peak if host else 0) * size,
                },
                device={
                    "device_budget": slabs.budget,
                    "device_allocated_bytes": slabs.allocated,
                    "device_in_use_bytes": slabs.in_use,
                    "peak_device_bytes": slabs.peak_allocated,
                    "peak_device_in_use_bytes": slabs.peak_in_use,
                    "device_slab_allocations": slabs.allocations,
                },
            )

    def close(self) -> None:
        """Finish transfers, return every buffer and slab (the pool and NvmeStore stay open)."""
        with self._lock:
            if self._closed:
                return
            self.flush()
            for shard in self._shards.values():
                if shard.slab is not None and shard.home is not Tier.DEVICE:
                    self._slabs.give(shard.slab)
                    shard.slab = None
                if shard.host_buf is not None:
                    self._host.give(shard.host_buf)
                    shard.host_buf = None
            self._slabs.release_all()
            self._on_host.clear()
            self._on_device.clear()
            self._shards.clear()
            self._staging = None
            self._closed = True

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the state machine driver --------------------------------------------------------------------
    def _wait(self, shard: Shard, tier: Tier, read: bool) -> torch.Tensor:
        with self._lock:
            self._check_open()
            if shard.pins[tier] <= 0:
                raise RuntimeError(f"{self.name}: wait on {shard.key!r} after it was released")
            self._advance(shard, tier, read=read, blocking=True)
            return shard.device_view() if tier is Tier.DEVICE else shard.host_view()

    def _try(self, shard: Shard, tier: Tier, read: bool) -> bool:
        with self._lock:
            self._poll()
            return self._advance(shard, tier, read=read, blocking=False)

    def _advance(
        self, shard: Shard, tier: Tier, *, read: bool, blocking: bool, prefetch: bool = False
    ) -> bool:
        """Take every step toward a usable copy at ``tier``; True once there.

        Non-blocking calls stop at the first transfer in flight or missing buffer.
        """
        while True:
            if shard.pending is not None:
                if not shard.pending.done():
                    if not blocking:
                        return False
                    self._block_on(shard.pending)
                    continue  # another thread may have finished it meanwhile: look again
                self._finish(shard)
                continue
            state = shard.state
            if tier is Tier.HOST and not read and state is ShardState.DEVICE:
                if shard.home is not Tier.DEVICE:
                    self._drop_device_for_write(shard, "fetch(read=False) at HOST")
                    continue
            if shard.ready_at(tier):
                return True
            if state is ShardState.NVME:
                host = self._host
                assert host is not None
                buf = self._take_host(shard, blocking=blocking, prefetch=prefetch)
                if buf is None:
                    return False
                if shard.state is not ShardState.NVME or shard.pending is not None:
                    host.give(buf)  # another thread loaded it while this one waited unlocked
                    continue
                transfer = None
                if read:
                    try:
                        handle = self._nvme.read(shard.key, buf[: shard.io_nbytes])
                    except BaseException:
                        host.give(buf)  # refused at submission: the buffer goes back
                        raise
                    transfer = Transfer(Tier.NVME, Tier.HOST, shard.io_nbytes, handle, keep=buf)
                shard.load_host(buf, transfer)
                self._on_host[shard.key] = shard
                self._issued(shard, transfer)
                continue
            # state is HOST and the target is DEVICE
            slab = self._take_slab(shard, blocking=blocking, prefetch=prefetch)
            if slab is None:
                return False
            transfer = None
            if read:
                event = self._copier.to_device(
                    slab.memory[: shard.nbytes], shard.host_view().view(torch.uint8), slab.fence
                )
                transfer = Transfer(Tier.HOST, Tier.DEVICE, shard.nbytes, event)
            shard.load_device(slab, transfer)
            self._on_device[shard.key] = shard
            self._issued(shard, transfer)

    def _issued(self, shard: Shard, transfer: Transfer | None) -> None:
        if transfer is not None:
            self._inflight[shard.key] = shard
            self._counters.moved(transfer.src, transfer.dst, transfer.nbytes)

    def _finish(self, shard: Shard) -> None:
        """Wait for the shard's pending transfer and apply its transition (chains the disk write
        after a device -> host flush of an NVMe-homed shard)."""
        transfer = shard.pending
        assert transfer is not None
        try:
            waited = transfer.wait()
        except BaseException:
            self._inflight.pop(shard.key, None)
            self._abort(shard)
            raise
        self._counters.waited(transfer.src, transfer.dst, waited)
        # dropped from the in-flight set first: an interrupt between the two lines leaves a
        # completed transfer on the shard, which the next _settle (or flush) finishes; the
        # other order would leave an in-flight record with no transfer
        self._inflight.pop(shard.key, None)
        shard.finish_pending()
        if shard.state is ShardState.FLUSHING:
            self._start_disk_write(shard)

    def _settle(self, shard: Shard) -> None:
        while shard.pending is not None:
            self._finish(shard)

    def _poll(self) -> None:
        """Complete finished transfers and push wanted prefetches forward; never blocks."""
        for shard in list(self._inflight.values()):
            if shard.pending is not None and shard.pending.done():
                self._finish(shard)
        for key, tier in list(self._wanted.items()):
            shard = self._shards[key]
            if shard.ready_at(tier):
                del self._wanted[key]
            elif not shard.pinned() and not shard.dirty:
                self._advance(shard, tier, read=True, blocking=False, prefetch=True)

    def _want(self, items: list) -> None:
        wanted: dict[str, Tier] = {}
        for key, tier in items:
            if self._shards[key].home < tier:
                wanted[key] = max(tier, wanted.get(key, Tier.NVME))
        self._wanted = wanted
        for key, tier in wanted.items():
            shard = self._shards[key]
            if shard.pinned() or shard.dirty or shard.ready_at(tier):
                continue
            before = shard.state
            self._advance(shard, tier, read=True, blocking=False, prefetch=True)
            self._counters.prefetch_started(shard.state is not before)

    # -- write-back ------------------------------------------------------------------------------------
    def _write_back(self, shard: Shard) -> None:
        """Start moving a dirty, fully released top copy home (asynchronously)."""
        self._settle(shard)  # an earlier write-back of this shard goes first (same extent)
        if shard.home is Tier.DEVICE or not shard.dirty:
            shard.dirty = False
            return
        if shard.state is ShardState.DEVICE:
            event = self._copier.to_host(
                shard.host_view().view(torch.uint8),
                shard.device_view().view(torch.uint8),
                shard.slab.fence if shard.slab is not None else None,
            )
            transfer = Transfer(Tier.DEVICE, Tier.HOST, shard.nbytes, event)
            shard.flush(transfer)
            self._issued(shard, transfer)
        elif shard.home is Tier.HOST:
            shard.dirty = False  # the host copy is the home: nothing to move
        else:
            self._start_disk_write(shard)

    def _abort(self, shard: Shard) -> None:
        """Roll a failed transfer back to a consistent state (the error is re-raised by the
        caller): a failed read frees its buffer (NVME again, retried on the next fetch); a failed
        write-back leaves the copy dirty and cached, so no byte is lost and the next dirty
        release writes it again."""
        if shard.state is ShardState.TO_HOST:
            self._host.give(shard.abort_pending())
            self._on_host.pop(shard.key, None)
            return
        shard.abort_pending()

    def _start_disk_write(self, shard: Shard) -> None:
        """Submit a dirty host copy's write (the shard is HOST, or FLUSHING after its device
        copy was flushed). Refused at submission (an error, or an interrupt arriving inside the
        call), nothing was written: the copy stays dirty and cached, and the error goes up."""
        try:
            handle = self._nvme.write(shard.key, shard.host_io_view())
        except BaseException:
            if shard.state is ShardState.FLUSHING:
                shard.abort_pending()  # back to the device copy on top, dirty again
            raise
        transfer = Transfer(Tier.HOST, Tier.NVME, shard.io_nbytes, handle, keep=shard.host_buf)
        shard.write_back(transfer)
        self._issued(shard, transfer)

    def _drop_device_for_write(self, shard: Shard, what: str) -> None:
        if shard.pins[Tier.DEVICE]:
            raise RuntimeError(
                f"{self.name}: {what} for {shard.key!r} would make its device copy stale, but "
                "that copy is fetched; release it at DEVICE first"
            )
        self._give_slab(shard)

    # -- helpers -------------------------------------------------------------------------------------------
    def _get(self, key: str, tier: Tier | None) -> Shard:
        self._check_open()
        shard = self._shards.get(key)
        if shard is None:
            raise KeyError(f"{self.name}: unknown shard {key!r} (register it first)")
        if tier is not None:
            if tier is Tier.NVME or tier < shard.home:
                raise ValueError(
                    f"{self.name}: cannot fetch {key!r} at {tier.name}: its home is "
                    f"{shard.home.name}; allowed tiers: "
                    + ", ".join(t.name for t in Tier if t >= max(shard.home, Tier.HOST))
                )
        return shard

    def _check_out(self, shard: Shard, t: torch.Tensor, what: str) -> None:
        if t.numel() != shard.numel:
            raise ValueError(
                f"{self.name}: {what}({shard.key!r}) got {t.numel()} elements; allowed: exactly "
                f"{shard.numel}"
            )

    def _staging_bytes(self, nbytes: int) -> torch.Tensor:
        from offload.io import aligned_empty  # noqa: PLC0415 (io is only needed with NVMe)

        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = aligned_empty(round_up(nbytes))
        return self._staging[:nbytes]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name}: the store is closed")
