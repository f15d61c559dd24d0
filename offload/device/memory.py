"""Memory on and around the compute device, chosen once per device: the pinning policy, the
storage of gathered parameters, how gradients leave the device, and how the optimizer writes
parameters that live on the device. Everything CUDA-specific above the copier is here.

Note: one policy object per concern
    Each concern has a CPU and a CUDA implementation behind the same methods, picked by
    :func:`for_device`; the homes and the runtime call the methods and never ask which device
    they run on.

    - :class:`HostMemory`: host tensors and pools, page-locked exactly when the device is CUDA
      and the config section asks for it (``pin_memory``). The one place pinning is decided.
    - unit storage (``storage_for``): on the CPU (Linux) a unit's parameters are views into one
      page-released block (``pages.py``); elsewhere each parameter's storage is freed on release
      and reallocated on gather (what FSDP does with the caching allocator).
    - :class:`GradStaging`: on the CPU the accumulation reads each ``p.grad`` in place; on CUDA
      the unit's gradients are flattened on the device into one staging buffer and copied to a
      pinned host buffer in one transfer.
    - :class:`DeviceWriter`: where the optimizer writes new values of device-resident params.
      On the CPU that is the device buffer itself; on CUDA a pinned staging slot copied up
      after the write (two slots, so the host waits only for the copy before the previous one).
      It also gives the :func:`fingerprint` of what it last wrote, read on the host (the
      device buffer on the CPU, the staging slot on CUDA), so that a write into the device
      buffer by code outside offload can be seen without a copy kept.
"""

from __future__ import annotations

import torch

from offload.device import pages
from offload.device.copier import COMPLETED, Event, Transfers
from offload.plan import Unit


class HostMemory:
    """Host allocations for one compute device (the pinning policy)."""

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"

    def pins(self, wanted: bool) -> bool:
        """Whether host memory asked to be pinned (``pin_memory``) is page-locked here."""
        return wanted and self.is_cuda

    def empty(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """Page-locked where :meth:`pins` says so, allocated so directly (``pin_memory()`` of
        a pageable tensor held both copies at once); a host that cannot page-lock it raises
        a :class:`MemoryError` naming the settings to change."""
        if self.pins(pin):
            from offload.io.aligned import pinned_empty  # noqa: PLC0415 (as the store imports io)

            return pinned_empty(numel, dtype)
        return torch.empty(numel, dtype=dtype)


# ---------------------------------------------------------------------------- parameter storage
class ResizedStorage:
    """Each parameter's own storage, freed on release and reallocated on gather."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    def attach(self, unit: Unit) -> None:
        """Gives every parameter a storage of its own on the device (values undefined)."""
        for seg in unit.layout.segments:
            seg.param.data = torch.empty(seg.shape, dtype=self.dtype, device=self.device)

    def make_room(self, unit: Unit) -> None:
        for p in unit.params:
            st = p.untyped_storage()
            need = p.numel() * p.element_size()
            if st.nbytes() != need:
                st.resize_(need)

    def drop(self, unit: Unit) -> None:
        for p in unit.params:
            st = p.untyped_storage()
            if st.nbytes() != 0:
                st.resize_(0)

    def flat(self, unit: Unit) -> None:
        """None: the parameters have no common flat buffer (a gather copies into each)."""
        return None

    def touched(self, unit: Unit) -> list[tuple[int, int, bool]]:
        """None seen: a released parameter's storage holds no bytes to look at."""
        return []

    lends = False  # a swap buffer's pages cannot become device memory (a gather copies)

    def lend(self, unit: Unit, lo: int, buf: torch.Tensor) -> bool:
        return False

    def take_back(self, unit: Unit) -> None:
        pass

    def holds_lent(self, unit: Unit, lo: int | None = None) -> bool:
        return False

    def close(self) -> None:
        pass


def storage_for(device: torch.device, dtype: torch.dtype):
    """How gathered parameters of ``dtype`` are stored on ``device`` (see the Note)."""
    if pages.supported(device):
        return pages.PageBlocks(dtype)
    return ResizedStorage(device, dtype)


# ---------------------------------------------------------------------------- gradients
Parts = list[tuple[int, int, torch.Tensor | None]]


def grad_parts(unit: Unit) -> Parts:
    """The unit's gradients over ``[0, trainable)`` as ``(begin, end, tensor)`` parts in flat
    order (``tensor`` None for padding and for a parameter that got no gradient)."""
    parts: Parts = []
    prev = 0
    for seg in unit.layout.segments:
        if not seg.trainable:
            continue
        if seg.offset > prev:
            parts.append((prev, seg.offset, None))
        g = seg.param.grad
        parts.append((seg.offset, seg.end, None if g is None else g.reshape(-1)))
        prev = seg.end
    if prev < unit.layout.trainable:
        parts.append((prev, unit.layout.trainable, None))
    return parts


class GradStaging:
    """CPU: gradients are read where autograd left them (counted as they cross).

    Across ranks a unit's gradients are first flattened on the device (:meth:`flatten`, the
    input of the reduce-scatter) and only this rank's reduced share crosses to the host
    (:meth:`share_to_host`)."""

    def __init__(self, transfers: Transfers, memory: HostMemory, dtype, largest: int) -> None:
        self.transfers = transfers

    def host_parts(self, unit: Unit) -> Parts:
        parts = grad_parts(unit)
        nbytes = sum(g.numel() * g.element_size() for _, _, g in parts if g is not None)
        self.transfers.count("device->host", nbytes)
        return parts

    @staticmethod
    def flatten(unit: Unit, out: torch.Tensor) -> None:
        """``out[:trainable]`` becomes the unit's gradients in flat order (zeros where there is
        none); a device-side copy."""
        for a, b, g in grad_parts(unit):
            if g is None:
                out[a:b].zero_()
            else:
                out[a:b].copy_(g)

    def share_to_host(self, share: torch.Tensor) -> torch.Tensor:
        """A reduced share on the device, readable on the host (valid until the next call)."""
        self.transfers.count("device->host", share.numel() * share.element_size())
        return share


class CudaGradStaging(GradStaging):
    """CUDA: flattened on the device, then one copy into a pinned host buffer."""

    def __init__(self, transfers: Transfers, memory: HostMemory, dtype, largest: int) -> None:
        super().__init__(transfers, memory, dtype, largest)
        n = max(largest, 1)
        self.memory = memory
        self._device = torch.empty(n, dtype=dtype, device=transfers.device)
        self._host = memory.empty(n, dtype, pin=True)
        self._wide: torch.Tensor | None = None  # (share_to_host)

    def host_parts(self, unit: Unit) -> Parts:
        n = unit.layout.trainable
        flat = self._device[:n]
        for a, b, g in grad_parts(unit):
            if g is None:
                flat[a:b].zero_()
            else:
                flat[a:b].copy_(g)
        host = self._host[:n]
        self.transfers.wait(self.transfers.to_host(host, flat), "device->host")
        return [(0, n, host)]

    def share_to_host(self, share: torch.Tensor) -> torch.Tensor:
        """Into the pinned buffer's bytes, in the share's own dtype (the reduce dtype, maybe
        twice as wide as the compute dtype: a rank's share of a unit fits with two ranks or
        more; a group of one rank gets a buffer of its own, pinned once)."""
        nbytes = share.numel() * share.element_size()
        host = self._host
        if nbytes > host.numel() * host.element_size():
            if self._wide is None or self._wide.numel() < share.numel():
                self._wide = self.memory.empty(share.numel(), share.dtype, pin=True)
            host = self._wide
        host = host.view(torch.uint8)[:nbytes].view(share.dtype)
        self.transfers.wait(self.transfers.to_host(host, share), "device->host")
        return host


# ---------------------------------------------------------------------------- device params
def fingerprint(values: torch.Tensor) -> torch.Tensor:
    """The wrapping sum of ``values``' bytes as 64-bit words counted from its first byte (a 0-d
    int64 tensor on its device): the same bits give the same sum on any device and in any
    summation order, and a write that changes them changes it but for a change that keeps the
    words' sum (a permutation of whole words, say). One read at memory speed (torch's integer
    sum; an int32 view summed into int64 was 20x slower on the CPU). A tensor whose first byte
    is not on an 8-byte boundary is copied first (rare: a piece starts at a multiple of the
    piece size in its unit's buffer)."""
    flat = values.reshape(-1).view(torch.uint8)
    if flat.data_ptr() % 8:
        flat = flat.clone()
    whole = flat.numel() // 8 * 8
    total = flat[:whole].view(torch.int64).sum()
    if whole < flat.numel():  # the last bytes as one little-endian word
        tail = flat[whole:].to(torch.int64)
        total = total + (tail << (8 * torch.arange(tail.numel(), device=tail.device))).sum()
    return total


class DeviceWriter:
    """CPU: the optimizer writes new values straight into the device buffer."""

    # whether the update may read the device buffer before it writes (``DeviceParams``' look
    # for a write it would overwrite): on the CPU a plain read; on CUDA a reduction the update's
    # thread would wait for behind the compute stream's queued kernels (the backward it runs in)
    reads_before_write = True

    def __init__(self, transfers: Transfers, memory: HostMemory, dtype) -> None:
        self.transfers = transfers

    def out(self, flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return flat[lo:hi]

    def commit(self, flat: torch.Tensor, lo: int, hi: int) -> None:
        self.transfers.count("host->device", (hi - lo) * flat.element_size())

    def committed_print(self, flat: torch.Tensor, lo: int, hi: int) -> int:
        """The :func:`fingerprint` of the values the last :meth:`commit` (of ``[lo, hi)``) wrote."""
        return int(fingerprint(flat[lo:hi]))

    def quiesce(self) -> None:
        pass


class CudaDeviceWriter(DeviceWriter):
    """CUDA: two pinned staging slots; a slot is reused once its copy up has completed."""

    reads_before_write = False

    def __init__(self, transfers: Transfers, memory: HostMemory, dtype) -> None:
        super().__init__(transfers, memory, dtype)
        self.memory, self.dtype = memory, dtype
        self._slots: list[torch.Tensor | None] = [None, None]
        self._events: list[Event] = [COMPLETED, COMPLETED]
        self._next = 0

    def out(self, flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        i = self._next
        self.transfers.wait(self._events[i], "host->device")  # its previous copy read it
        slot = self._slots[i]
        if slot is None or slot.numel() < hi - lo:
            slot = self._slots[i] = self.memory.empty(hi - lo, self.dtype, pin=True)
        return slot[: hi - lo]

    def commit(self, flat: torch.Tensor, lo: int, hi: int) -> None:
        i = self._next
        self._events[i] = self.transfers.to_device([(flat[lo:hi], self._slots[i][: hi - lo])])
        self._next = 1 - i

    def committed_print(self, flat: torch.Tensor, lo: int, hi: int) -> int:
        # read from the slot just committed (the copy up only reads it; it is written again
        # after the next commit's out): the same bits the device buffer gets
        return int(fingerprint(self._slots[1 - self._next][: hi - lo]))

    def quiesce(self) -> None:
        for event in self._events:
            self.transfers.wait(event, "host->device")


def for_device(device: torch.device):
    """``(HostMemory, GradStaging class, DeviceWriter class)`` of ``device``."""
    if device.type == "cuda":
        return HostMemory(device), CudaGradStaging, CudaDeviceWriter
    return HostMemory(device), GradStaging, DeviceWriter
