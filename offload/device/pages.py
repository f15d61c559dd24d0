"""Parameter storage on the CPU whose pages go back to the OS when a unit is released.

Note: why not free and reallocate
    With the compute on the CPU, a gathered unit's parameters are host memory. Freeing them on
    release and allocating them again on the next gather (``untyped_storage().resize_``, what
    CUDA does with its caching allocator) hands glibc malloc a stream of multi-MiB blocks that
    live and die interleaved with gradients and activations. glibc serves them from its heap
    and keeps what is freed there; on the 50M demo GPT that held the peak RSS 30-80 MiB above
    the documented budget, with 200+ MiB free inside the heap (benchmarks/README.md).

    Instead each unit gets one anonymous ``mmap`` for its parameters, made at wrap time, and
    the parameters become views into it for good (the storage never changes, so the tensors
    autograd saved in forward stay valid). Releasing the unit is ``madvise(MADV_DONTNEED)``:
    the kernel takes the pages back at once, and they read as zeros until the next gather
    writes them again. A released parameter touched by mistake reads zeros instead of
    faulting. Virtual address space is the whole model's parameters; resident memory is what
    is gathered.

    Those page faults are paid on every gather, on the thread that runs the model. A block's
    whole 2 MiB spans are therefore asked for as transparent huge pages (``MADV_HUGEPAGE``,
    the block aligned to 2 MiB; its tail stays in 4 KiB pages, so no unit holds more than it
    uses): one fault per 2 MiB instead of 512. Writing a released 19 MiB unit took 6.5 ms with
    4 KiB pages and 2.7 ms with huge pages (1.0-1.2 ms into resident pages); over the ~20
    gathers of an NVMe iteration of the 50M demo GPT that predicts ~75 ms, but five scratch
    A/B pairs of that iteration (1.40-1.56 s) could not tell the two apart. Where THP is off
    (``never``) the advice does nothing and the block behaves as before.

    Linux only (the ``madvise`` semantics above); elsewhere the storages are freed and
    reallocated as before.
"""

from __future__ import annotations

import mmap
import sys

import torch

from offload.plan import Unit

PAGE = mmap.PAGESIZE
HUGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)


def supported(device: torch.device) -> bool:
    """Whether units on ``device`` can use page-released blocks (CPU compute, Linux)."""
    return (
        device.type == "cpu" and sys.platform.startswith("linux") and hasattr(mmap.mmap, "madvise")
    )


class PageBlocks:
    """One anonymous mapping per unit holding its parameters (see the module Note)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._maps: dict[int, mmap.mmap] = {}
        self._flat: dict[int, torch.Tensor] = {}

    def attach(self, unit: Unit) -> None:
        """Points every parameter of ``unit`` at its view of a new block (values undefined:
        the unit starts released)."""
        layout = unit.layout
        nbytes = max(PAGE, -(-layout.total * self.dtype.itemsize // PAGE) * PAGE)
        spans = nbytes // HUGE  # whole huge pages the block covers once aligned
        size = nbytes + (HUGE if spans else 0)  # room to start at a 2 MiB boundary
        block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(block, dtype=torch.uint8)
        start = -raw.data_ptr() % HUGE if spans else 0
        if spans and hasattr(mmap, "MADV_HUGEPAGE"):
            block.madvise(mmap.MADV_HUGEPAGE, start, spans * HUGE)
        flat = raw[start : start + nbytes].view(self.dtype)
        for seg in layout.segments:
            seg.param.data = flat[seg.offset : seg.end].view(seg.shape)
        self._maps[unit.index] = block
        self._flat[unit.index] = flat[: layout.total]

    def flat(self, unit: Unit) -> torch.Tensor:
        """The unit's whole flat buffer, which its parameters view (a gather can write it in
        one piece)."""
        return self._flat[unit.index]

    def make_room(self, unit: Unit) -> None:
        """Nothing to do: released pages come back as the gather writes them."""

    def drop(self, unit: Unit) -> None:
        """Gives the unit's pages back to the OS; its parameters read as zeros until written."""
        self._maps[unit.index].madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Forgets the blocks; each mapping goes away with the last tensor viewing it."""
        self._maps.clear()
        self._flat.clear()
