"""The small device interface: copy streams, events and device/pinned allocations.

Note: streams and events
    One persistent copy stream per direction (host -> device, device -> host), created once with
    the store. Before a copy is queued, its stream waits on the compute stream (a stream-to-stream
    dependency, not a synchronize): a slab being refilled may still be read by kernels queued
    earlier, and a device copy being flushed may still be written by them. Each copy records a
    CUDA event; the transfer record carries it, and waiting on that event (``Event.wait``) is the
    only host-side wait. Nothing here calls ``torch.cuda.synchronize()``.

    Host buffers are pinned (the pool pins them under CUDA), so ``non_blocking=True`` copies are
    truly asynchronous; they stay alive until the event completes because the store frees a
    buffer only after the transfer record that uses it has been waited on.

    On the CPU the "device" is ordinary memory: a copy is a plain ``copy_`` done at once, and its
    event is already complete. The store runs the same code on both.
"""

from __future__ import annotations

from typing import Protocol

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

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Queue ``dst.copy_(src)`` host -> device; the returned event says when it is done."""
        if not self.is_cuda:
            dst.copy_(src)
            return COMPLETED
        return self._queue(self._to_device, dst, src)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Queue ``dst.copy_(src)`` device -> host; the returned event says when it is done."""
        if not self.is_cuda:
            dst.copy_(src)
            return COMPLETED
        return self._queue(self._to_host, dst, src)

    def _queue(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> Event:
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return CudaEvent(event)
