"""The small device interface: copy streams, events and device/pinned allocations.

Note: streams and events
    One persistent copy stream per direction (host -> device, device -> host), created once with
    the store. When a device copy is released, the store records a *fence* (a CUDA event on the
    compute stream) in its slab: kernels queued before the release may still read it (a slab
    about to be refilled) or write it (a dirty copy about to be flushed). The next copy into or
    out of that slab makes its copy stream wait on that fence (``wait_event``: a stream-side
    dependency, not a host wait, and not on the whole compute stream, so a prefetch still
    overlaps compute queued later). Each copy records a CUDA event; the transfer record carries
    it, and waiting on that event (``Event.wait``) is the only host-side wait. Nothing here calls
    ``torch.cuda.synchronize()``.

    Host buffers are pinned (the pool pins them under CUDA), so ``non_blocking=True`` copies are
    truly asynchronous; they stay alive until the event completes because the store frees a
    buffer only after the transfer record that uses it has been waited on.

    On the CPU the "device" is ordinary memory: a copy is a plain ``copy_`` done at once, and its
    event is already complete. The store runs the same code on both.
"""

from __future__ import annotations

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


class DeviceCopier:
    """Allocations and asynchronous copies for one compute device (``cpu`` or ``cuda:N``)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            # created once, used for every transfer of this store (see Note: streams and events)
            self._to_device = torch.cuda.Stream(self.device)
            self._to_host = torch.cuda.Stream(self.device)

    def empty(self, nbytes: int) -> torch.Tensor:
        """Uninitialised device memory of ``nbytes`` bytes (a slab)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def fence(self) -> Any:
        """Mark "compute queued so far" on the compute stream (a CUDA event; ``None`` on CPU).

        Recorded when a device copy is released: a later copy into or out of that slab waits on
        this fence only, so prefetches still overlap compute queued after the release.
        """
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Event:
        """Queue ``dst.copy_(src)`` host -> device once ``after`` (a fence) has passed."""
        if not self.is_cuda:
            dst.copy_(src)
            return COMPLETED
        return self._queue(self._to_device, dst, src, after)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Event:
        """Queue ``dst.copy_(src)`` device -> host once ``after`` (a fence) has passed."""
        if not self.is_cuda:
            dst.copy_(src)
            return COMPLETED
        return self._queue(self._to_host, dst, src, after)

    def _queue(self, stream: Any, dst: torch.Tensor, src: torch.Tensor, after: Any) -> Event:
        if after is not None:
            stream.wait_event(after)  # a stream-side wait; the host does not block
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return CudaEvent(event)
