"""Copies between host memory and the compute device: one copier per process, counted per model.

Note: streams and events (CUDA)
    One persistent copy stream per direction (host -> device, device -> host) per device,
    created once for the whole process (``Copier.of``). A copy into freshly (re)allocated
    parameter storage first waits for a *fence* recorded on the user's compute stream (the
    allocation, and every kernel queued before it), then the compute stream waits on the copy's
    event before the unit's forward uses it: stream-side dependencies only, the host does not
    block. A copy of gradients to the host waits for a compute-stream fence (the grads are
    final). Each copy records a CUDA event; the host waits on that one event, and only where it
    reads the data or reuses a pinned source buffer. Nothing here calls a device-wide
    synchronize.

    The compute stream is the user's: ``Transfers.capture_stream`` records the current stream
    when a forward or a backward starts (the hooks call it), and fences and waits use that
    stream, also when the call comes from the update's worker thread, whose own current stream
    is the default one.

    Pinned host buffers make ``non_blocking=True`` copies truly asynchronous; a source buffer
    stays alive and unmodified until its event completes because callers wait on the event (or
    hand the event to whoever reuses the buffer) before reusing it.

    On the CPU the "device" is ordinary memory: a copy is a plain ``copy_`` done at once and its
    event is already complete. The logic above this interface is identical on both.

Note: counted where they happen
    Every byte that crosses between host-side state and the compute side goes through
    :class:`Transfers`, which counts it (``host->device`` and ``device->host``, bytes, transfers,
    seconds the host waited). On the CPU some of those crossings are not copies: the optimizer
    writes new compute values straight into device-resident parameters, and gradients are read
    in place by the accumulation; their callers count them with :meth:`Transfers.count`, so the
    figures are the same on both devices. Moves between host and NVMe are counted by the store.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import torch


class Event(Protocol):
    """Completion of one queued copy."""

    def wait(self) -> None: ...

    def done(self) -> bool: ...


class Completed:
    """An event that has already happened (CPU copies are synchronous)."""

    __slots__ = ()

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


COMPLETED = Completed()


class CudaEvent:
    """A recorded ``torch.cuda.Event``; ``wait`` blocks the host on this event only."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self) -> None:
        self._event.synchronize()

    def done(self) -> bool:
        return bool(self._event.query())


class Copier:
    """The process's copy streams for one compute device (see the Note)."""

    _instances: dict[torch.device, Copier] = {}
    _lock = threading.Lock()

    @classmethod
    def of(cls, device: torch.device | str) -> Copier:
        """The one copier of ``device`` in this process."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with cls._lock:
            copier = cls._instances.get(device)
            if copier is None:
                copier = cls._instances[device] = cls._new(device)
            return copier

    @staticmethod
    def _new(device: torch.device) -> Copier:
        return CudaCopier(device) if device.type == "cuda" else Copier(device)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_stream(self) -> Any:
        """The calling thread's compute stream (None on the CPU)."""
        return None

    def fence(self, stream: Any) -> Any:
        """Mark "work queued so far on ``stream``" (None on the CPU)."""
        return None

    def order_after(self, stream: Any, event: Event) -> None:
        """Make ``stream`` wait for ``event`` (a stream-side wait; nothing on the CPU)."""

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Event:
        """Queue ``dst.copy_(src)`` host -> device once ``after`` (a fence) has passed."""
        dst.copy_(src)
        return COMPLETED

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Event:
        """Queue ``dst.copy_(src)`` device -> host once ``after`` (a fence) has passed."""
        dst.copy_(src)
        return COMPLETED


class CudaCopier(Copier):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # created once, used for every transfer of this process (see the Note)
        self._to_device = torch.cuda.Stream(device)
        self._to_host = torch.cuda.Stream(device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def fence(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def order_after(self, stream: Any, event: Event) -> None:
        if isinstance(event, CudaEvent):
            stream.wait_event(event._event)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Event:
        return self._queue(self._to_device, dst, src, after)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Event:
        return self._queue(self._to_host, dst, src, after)

    @staticmethod
    def _queue(stream: Any, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Event:
        if after is not None:
            stream.wait_event(after)  # a stream-side wait; the host does not block
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return CudaEvent(event)


PAIRS = ("host->device", "device->host")


class Transfers:
    """One wrapped model's host <-> device moves: through the process's :class:`Copier`,
    ordered against the user's compute stream, and counted (see the Notes)."""

    def __init__(self, device: torch.device) -> None:
        self.copier = Copier.of(device)
        self.device = self.copier.device
        self._stream = self.copier.current_stream()
        self._counts = {p: {"bytes": 0, "transfers": 0, "wait_seconds": 0.0} for p in PAIRS}
        self._count_lock = threading.Lock()  # the update's worker thread counts too
        self._here = threading.local()  # seconds this thread spent in to_device

    def capture_stream(self) -> None:
        """The calling thread's current stream becomes the compute stream (hook time)."""
        self._stream = self.copier.current_stream()

    def to_device(self, pairs) -> Event:
        """Copies each host ``src`` into its device ``dst``; the compute stream is ordered
        after them. Returns the event of the last copy (the sources may be reused once it has
        completed)."""
        start = time.perf_counter()
        fence = self.copier.fence(self._stream)
        event: Event = COMPLETED
        nbytes = copies = 0
        for dst, src in pairs:
            event = self.copier.to_device(dst, src, fence)
            nbytes += src.numel() * src.element_size()
            copies += 1
        self.copier.order_after(self._stream, event)
        self.count("host->device", nbytes, copies)
        self._here.seconds = self.copy_seconds_here() + time.perf_counter() - start
        return event

    def copy_seconds_here(self) -> float:
        """Seconds the calling thread has spent in :meth:`to_device`: the copies themselves on
        the CPU, queueing them on CUDA (what the host is kept from doing meanwhile)."""
        return getattr(self._here, "seconds", 0.0)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Copies device ``src`` into host ``dst`` after the compute queued so far; returns the
        event to wait on before reading ``dst``."""
        event = self.copier.to_host(dst, src, self.copier.fence(self._stream))
        self.count("device->host", src.numel() * src.element_size())
        return event

    def wait(self, event: Event, pair: str) -> None:
        """Blocks until ``event`` completed, counting the seconds under ``pair``."""
        if event.done():
            return
        t0 = time.perf_counter()
        event.wait()
        with self._count_lock:
            self._counts[pair]["wait_seconds"] += time.perf_counter() - t0

    def count(self, pair: str, nbytes: int, transfers: int = 1) -> None:
        """Counts a crossing that is not a copy here (see Note: counted where they happen)."""
        if nbytes:
            with self._count_lock:
                entry = self._counts[pair]
                entry["bytes"] += nbytes
                entry["transfers"] += transfers

    def stats(self) -> dict:
        """``{"tiers": {"host->device" | "device->host": {bytes, transfers, wait_seconds}}}``,
        cumulative (the same shape as a store's ``stats()``)."""
        with self._count_lock:
            return {"tiers": {p: dict(v) for p, v in self._counts.items()}}
