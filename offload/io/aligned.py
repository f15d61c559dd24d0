"""4096-byte aligned (and, with CUDA, page-locked) host tensors.

Note: alignment. O_DIRECT needs the buffer address, the file offset and the length to be
multiples of the device's logical block size; 4096 covers every common NVMe and ext4/xfs setup.
Torch's CPU allocator only guarantees 64-byte alignment, so :func:`aligned_empty` allocates
``nbytes + 4095`` bytes and returns a view that starts at the next 4096 boundary. The view keeps
the whole allocation alive (it shares its storage), so nothing needs to be freed by hand.

Note: pinning. With ``pin=True`` the allocation is made through torch's pinned host allocator
(``pin_memory=True``, i.e. ``cudaHostAlloc``), which is page-locked and still sliced to a 4096
boundary the same way. Whether to pin is not decided here: the caller passes what the device's
pinning policy says (``offload.device.HostMemory``); without a GPU, asking for it is an error.
"""

from __future__ import annotations

import torch

ALIGN = 4096  # bytes; O_DIRECT alignment of buffer address, file offset and length


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align`` (bytes)."""
    return (n + align - 1) // align * align


def _allocate(nbytes: int, pin: bool) -> torch.Tensor:
    """A flat uint8 tensor of ``nbytes`` bytes, page-locked for CUDA when ``pin``."""
    if pin:
        # cudaHostAlloc-backed: page-locked, so host<->device copies can be asynchronous DMA.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.empty(nbytes, dtype=torch.uint8)


def aligned_empty(
    nbytes: int, *, dtype: torch.dtype = torch.uint8, pin: bool = False
) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``nbytes`` bytes whose data starts on a 4096 boundary.

    Args:
        nbytes: size in bytes; a multiple of ``dtype``'s element size.
        dtype: element type of the returned tensor (``nbytes // itemsize`` elements).
        pin: page-lock it (for CUDA copies; see the Note).
    """
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be an int >= 0, got {nbytes!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes % itemsize:
        raise ValueError(
            f"aligned_empty: nbytes={nbytes} is not a multiple of the {dtype} element size "
            f"({itemsize} bytes)"
        )
    raw = _allocate(nbytes + ALIGN - 1, bool(pin))
    skip = (-raw.data_ptr()) % ALIGN
    out = raw[skip : skip + nbytes]
    if dtype != torch.uint8:
        out = out.view(dtype)
    return out


def is_aligned(t: torch.Tensor, align: int = ALIGN) -> bool:
    """Whether ``t``'s first byte sits on an ``align``-byte boundary."""
    return t.data_ptr() % align == 0
