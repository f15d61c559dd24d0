"""Host <-> device copies for the engine, behind one small interface.

Note: streams and ordering (CUDA)
    One persistent stream per direction, created once. A host->device copy of parameter data
    runs on the h2d stream from pinned memory; the compute stream then waits on the copy's event
    (``wait_stream``-style, no host blocking) before the unit's forward uses it. A device->host
    copy of gradients first makes the d2h stream wait on the compute stream (the grads must be
    final), copies into pinned memory, and the host waits on that event only when it reads the
    data. Nothing here calls a device-wide synchronize.

    On the CPU there is nothing to overlap: copies are plain ``copy_`` calls and events are
    ``None``. The logic above and below this interface is identical on both.
"""

from __future__ import annotations

import torch


class Transfers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.h2d_stream = torch.cuda.Stream(device=device)
            self.d2h_stream = torch.cuda.Stream(device=device)

    def to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copies each host ``src`` into its device ``dst``; the compute stream is ordered after."""
        if not pairs:
            return
        if not self.is_cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return
        compute = torch.cuda.current_stream(self.device)
        self.h2d_stream.wait_stream(compute)  # dst storages were (re)allocated on compute
        with torch.cuda.stream(self.h2d_stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                dst.record_stream(compute)
        compute.wait_stream(self.h2d_stream)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> object | None:
        """Copies device ``src`` into host ``dst``; returns an event to wait on before reading."""
        if not self.is_cuda:
            dst.copy_(src)
            return None
        compute = torch.cuda.current_stream(self.device)
        self.d2h_stream.wait_stream(compute)
        with torch.cuda.stream(self.d2h_stream):
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.d2h_stream)
            event = torch.cuda.Event()
            event.record(self.d2h_stream)
        return event

    @staticmethod
    def wait(event: object | None) -> None:
        """Blocks the host until ``event`` (from :meth:`to_host`) has completed."""
        if event is not None:
            event.synchronize()

    def host_empty(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A host tensor, page-locked when the device is CUDA and ``pin`` is set."""
        t = torch.empty(numel, dtype=dtype)
        if self.is_cuda and pin:
            t = t.pin_memory()
        return t
