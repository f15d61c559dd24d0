"""The compute device behind one small interface: nothing CUDA-specific lives outside it.

Owns: the process's copy streams and events (``Copier``), each model's counted host <-> device
moves ordered against the user's compute stream (``Transfers``), the pinning policy
(``HostMemory``), how gathered parameters are stored (``storage_for``: page-released blocks
on the CPU, resized storages elsewhere), how gradients leave the device (``GradStaging``) and
how the optimizer writes device-resident parameters (``DeviceWriter``).
"""

from offload.device.copier import COMPLETED, Copier, CudaEvent, Event, Transfers
from offload.device.memory import (
    DeviceWriter,
    GradStaging,
    HostMemory,
    ResizedStorage,
    fingerprint,
    for_device,
    grad_parts,
    storage_for,
)

__all__ = [
    "COMPLETED",
    "Copier",
    "CudaEvent",
    "DeviceWriter",
    "Event",
    "GradStaging",
    "HostMemory",
    "ResizedStorage",
    "Transfers",
    "fingerprint",
    "for_device",
    "grad_parts",
    "storage_for",
]
