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
torch's pinned allocator rounds every request up to a power of two and hands out page-aligned
memory, so a pinned buffer is asked for its exact size (the 4095 bytes of slack that align an
unpinned one turned a pool of exactly 1 GiB into a pinned block of 2 GiB). Where the host
cannot page-lock a request (the RAM, a container's ``ulimit -l``), :func:`pinned_empty` raises
a :class:`MemoryError` that says which settings to lower.

Note: huge pages. An O_DIRECT read or write hands the kernel the buffer's physical pages, one
scatter-gather segment per physically contiguous run; a disk request can hold only so many
segments (254 on a virtio disk), and each costs the device (or the hypervisor) work. Pages that
torch's allocator gets and two threads first touch are scattered: ~33 runs per MiB on the
development machines, against 1 for a 2 MiB huge page, and the same reads ran 1.55 GB/s into
them against 2.07 GB/s into huge pages (``benchmarks/README.md``, bench_io). So an unpinned
buffer of at least :data:`HUGE_PAGE` bytes is its own anonymous private mapping, 2 MiB-aligned,
advised ``MADV_HUGEPAGE`` over its whole huge pages (transparent huge pages in ``madvise``
mode, the common default, serve only such ranges), and populated at once
(``MADV_POPULATE_WRITE``): the first O_DIRECT read into untouched huge-page memory ran at
0.26 GB/s (the pages are faulted in by the IO path), into populated memory at disk speed. So
every page is resident when this returns, which is what a buffer pool allocated once wants
(its budget is counted whole). The mapping's slack (up to 2 MiB of address space before the
aligned start and after the end) is never touched, so it costs no memory; the mapping is
unmapped when the last tensor viewing it is freed. Without THP (another OS, THP ``never``) the
advice is a no-op and the buffer is still aligned, populated memory; ``huge_pages=False``
takes torch's allocator as before.
"""

from __future__ import annotations

import errno
import mmap

import torch

ALIGN = 4096  # bytes; O_DIRECT alignment of buffer address, file offset and length
HUGE_PAGE = 2 << 20  # bytes; x86-64 / arm64 (4 KiB granule) transparent huge page size
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not exported by Python's mmap module


def round_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align`` (bytes)."""
    return (n + align - 1) // align * align


def pinned_empty(numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """``torch.empty(numel, dtype=dtype, pin_memory=True)``, with an error that says what to
    change where the host cannot page-lock that much (see the Note on pinning)."""
    try:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    except RuntimeError as exc:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        raise MemoryError(
            f"offload: page-locking {nbytes} bytes of host memory for CUDA copies failed "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}). Pinned memory "
            "is limited by the host's RAM and, in containers, by the locked-memory limit "
            "(ulimit -l); torch rounds each pinned allocation up to a power of two. Lower "
            "offload_param.buffer_count / buffer_size, or set offload_param.pin_memory: "
            "false (the gathers' copies then wait for the host)"
        ) from exc


def _allocate(nbytes: int, pin: bool) -> torch.Tensor:
    """A flat uint8 tensor of ``nbytes`` bytes, page-locked for CUDA when ``pin``."""
    if pin:
        # cudaHostAlloc-backed: page-locked, so host<->device copies can be asynchronous DMA.
        return pinned_empty(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8)


def _huge_page_mapping(nbytes: int) -> torch.Tensor | None:
    """``nbytes`` (a multiple of 4096) of populated memory starting on a 2 MiB boundary, advised
    for huge pages (see the Note); ``None`` where anonymous mappings or the advice are missing."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return None  # not Linux
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds mm: unmapped with the last view
    skip = (-whole.data_ptr()) % HUGE_PAGE
    huge = nbytes // HUGE_PAGE * HUGE_PAGE  # the whole huge pages inside the buffer
    if huge:
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, skip, huge)
        except OSError:  # THP compiled out: small pages, still aligned and populated
            pass
    out = whole[skip : skip + nbytes]
    try:
        mm.madvise(_MADV_POPULATE_WRITE, skip, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS):
            raise MemoryError(
                f"aligned_empty: {nbytes} bytes could not be made resident ({exc.strerror})"
            ) from exc
        out.zero_()  # kernel before 5.14: touch every page instead
    return out


def aligned_empty(
    nbytes: int, *, dtype: torch.dtype = torch.uint8, pin: bool = False, huge_pages: bool = True
) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``nbytes`` bytes whose data starts on a 4096 boundary.

    Args:
        nbytes: size in bytes; a multiple of ``dtype``'s element size.
        dtype: element type of the returned tensor (``nbytes // itemsize`` elements).
        pin: page-lock it (for CUDA copies; see the Note).
        huge_pages: unpinned and at least :data:`HUGE_PAGE` bytes: a populated, 2 MiB-aligned
            huge-page mapping (see the Note on huge pages); ``False``: torch's allocator.
    """
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be an int >= 0, got {nbytes!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes % itemsize:
        raise ValueError(
            f"aligned_empty: nbytes={nbytes} is not a multiple of the {dtype} element size "
            f"({itemsize} bytes)"
        )
    out = None
    if huge_pages and not pin and nbytes >= HUGE_PAGE:
        out = _huge_page_mapping(round_up(nbytes))
    if out is not None:
        out = out[:nbytes]
    else:
        # pinned memory comes page-aligned: asked for ALIGN - 1 bytes more, a pool of exactly
        # 1 GiB was rounded up to a pinned block of 2 GiB (see the Note on pinning)
        raw = _allocate(nbytes, True) if pin else None
        if raw is None or raw.data_ptr() % ALIGN:
            raw = _allocate(nbytes + ALIGN - 1, bool(pin))
        skip = (-raw.data_ptr()) % ALIGN
        out = raw[skip : skip + nbytes]
    if dtype != torch.uint8:
        out = out.view(dtype)
    return out


def is_aligned(t: torch.Tensor, align: int = ALIGN) -> bool:
    """Whether ``t``'s first byte sits on an ``align``-byte boundary."""
    return t.data_ptr() % align == 0
