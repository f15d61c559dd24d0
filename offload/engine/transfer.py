"""Host <-> device copies of parameter data and gradients, on the store's copy streams.

Note: ordering (CUDA)
    The copies run on the store's persistent copy streams (``offload.store.device.DeviceCopier``,
    one per direction). A host->device copy into freshly (re)allocated parameter storage first
    waits for a fence recorded on the compute stream (the allocation), then the compute stream
    waits on the copy's event before the unit's forward uses it: stream-side dependencies only,
    the host does not block. A pinned host source (a pool buffer, a staging buffer) may be
    reused only after the returned event has completed: callers wait on that one event. A
    device->host copy of gradients waits for a compute-stream fence (the grads are final), and
    the host waits on its event only when it reads the data. Nothing here calls a device-wide
    synchronize.

    On the CPU there is nothing to overlap: copies are plain ``copy_`` calls and events are
    already complete. The logic above and below this interface is identical on both.
"""

from __future__ import annotations

import torch

from offload.store.device import COMPLETED, DeviceCopier, Event


class Transfers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.copier = DeviceCopier(device)

    def to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Event:
        """Copies each host ``src`` into its device ``dst``; the compute stream is ordered after
        them. Returns the event of the last copy (the sources may be reused once it completed)."""
        if not pairs:
            return COMPLETED
        fence = self.copier.fence()
        event: Event = COMPLETED
        for dst, src in pairs:
            event = self.copier.to_device(dst, src, after=fence)
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_event(event._event)
        return event

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Copies device ``src`` into host ``dst`` after the compute queued so far; returns the
        event to wait on before reading ``dst``."""
        return self.copier.to_host(dst, src, after=self.copier.fence())

    def host_empty(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A host tensor, page-locked when the device is CUDA and ``pin`` is set."""
        t = torch.empty(numel, dtype=dtype)
        if self.is_cuda and pin:
            t = t.pin_memory()
        return t
