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

Note: recycled pages
    A fault is not only a kernel entry: the kernel finds a free huge page and zeroes it, and
    with another process busy on the second core that made writing a released 20 MiB block
    take 5.7-7.7 ms against 1.1 ms into recycled pages (``benchmarks/bench_pages.py`` on the
    2-core machine of benchmarks/README.md; 1.7-1.9 against 1.0 ms idle; the moves cost 0.5
    ms per release and gather). So a release does not give the
    block's whole 2 MiB spans back to the OS at once: it moves their pages aside
    (:class:`Spares`, ``mremap`` through ``offload._C.move_pages``; the block's range gets
    fresh zero memory, so a released parameter still reads zeros), and the next gather's
    ``make_room`` moves them under the unit it gathers, which then writes into resident
    pages. Spares hold at most the largest unit's whole spans (one unit more resident than
    what is gathered, at most, until the blocks are closed); a release beyond that, and each
    block's tail, go back to the OS as above. Without the native extension every release is a
    ``madvise``, and after a move the kernel refuses too (one warning; training goes on).
    Profiled over four iterations of the 50M demo GPT's step in backward (bench_e2e's NVMe
    configuration), the gathers' copies took 170 ms against 467-573 ms, their waits for reads
    10-20 ms more per iteration (what the copies had hidden). A gather that lends (the next
    Note) makes no room for its unit, but a piece it copies instead (its buffer still being
    written home) is written into spares moved under that piece's whole spans
    (:meth:`PageBlocks.make_room_for`), and the release keeps those spans as spares again.

Note: lent pages
    A gather from NVMe reads each piece into a swap buffer, and it used to copy the piece from
    there into the block: at memory speed, ~20 ms for the 50M demo GPT's 200 MB on this
    project's 2-core machines, four times in each iteration of bench_e2e's recipe, on the
    thread that runs the model. A swap buffer is anonymous private memory too
    (``offload.io.aligned``), so instead the buffer's pages are moved under the block
    (:meth:`PageBlocks.lend`, the same ``move_pages``), the buffer's range gets fresh zero
    memory, and the release moves them back (:meth:`PageBlocks.take_back`) before the buffer
    is given back to its store, which still holds the piece there: nothing is copied either
    way, no page is faulted in, and what the store keeps cached stays cached. The buffer is
    held (its store's fetch stays pinned) while its pages are lent, so the store that lends
    gets the room for it in addition to its configured buffers
    (``offload.homes.params.NvmeParams.lend_slots``). The gathered
    parameters must not be written in place while lent (the store would then hold the written
    values as its clean copy); nothing in offload writes them, the optimizer writes the home.
    Only a whole-page range moves; a piece whose range in the block or in its buffer is not
    page aligned is copied as before, and so is a piece whose buffer is still being written
    home (the update just wrote it; the write reads those pages, so they stay put, and the
    gather need not wait for it: ``offload.store.store``, Note on coherence); a move the
    kernel refuses turns lending off (one warning; a piece whose pages cannot be moved back is
    copied back). Ctrl-C: Python raises
    a KeyboardInterrupt that arrived during a native call as soon as it returns, so a record
    kept in Python after a move could miss it (the buffer would go back to its store reading
    zeros, a cached copy the next gather trusts); ``move_pages`` therefore writes where the
    pages are into the lend's record before it returns, :meth:`PageBlocks.take_back` moves only
    what that record places in the block (it can be called again after an interrupted call),
    and a buffer goes back to its store only once its pages are home: a gather or release that
    fails part way leaves it held until the unit's next release or ``close``
    (``tests/test_traffic.py``, the interrupt test). A release, and the cleanup of a failed
    gather, hold Ctrl-C back until they end (``offload._interrupts``): a second Ctrl-C landing
    in the cleanup of the first would otherwise leave a unit marked gathered with pieces that
    read zeros (``tests/test_traffic.py``, the Ctrl-C-twice test). Measured on the 50M
    demo GPT (``benchmarks/README.md``, ab_roots and nvme_phases sections): the gathers' copies
    fell from 19-23 ms a pass to 0-1 ms; against the same pool copying, bench_e2e's recipe took
    0.93x / 0.95x (clipping that triggers / norms under), the default step 1.00x (its ~40 ms
    is below what five pairs resolve on 2 cores).

Note: touched between uses
    A released block holds no page (its spans moved aside, the rest given back), so any page it
    holds before the next gather was put there by code outside offload (but for a gather issued
    ahead, stage 3's, whose home does not ask then): a read of a released parameter (it faults
    in the kernel's zero page) or a write. A write through ``p.data`` (WGAN's weight clipping,
    ``p.data.copy_(...)``) bumps no version counter, so offload's check of writes through the
    tensor missed it and the next gather dropped it with no error (a scratch probe of
    2026-12-06: 0.012 off torch's losses in three steps of ``p.data.clamp_`` at every placement
    that releases). :meth:`PageBlocks.touched` asks the kernel which of the block's pages are
    resident (``mincore``, one call per released unit) and looks only at those. A page the
    process holds as its own was written (``/proc/self/pagemap``'s exclusively mapped bit; a
    read maps the kernel's shared zero page), so a write of zeros (a ``clamp_`` of the zeros it
    read) is seen as one; where that file cannot be read, a page holding a value other than zero
    is. A page shared by two parameters names both (a 2 MiB huge page, where the write faulted
    one in: the parameters within it). The runtime asks at each forward's start, step and
    ``state_dict`` for every released unit, and before each gather for the unit
    (``offload.runtime.units``). On the 50M demo GPT (11 units of up to 19 MiB, nvme/nvme) one
    unit's call took 15 us on an idle machine where no page is (6 us of it the system call), the
    whole check 0.5 ms; inside bench_e2e's recipe with norms under the threshold (a scratch run
    of 2026-12-06, 9 iterations, both cores busy) the checks took 4.8 ms an iteration (40
    gathers at 74 us, 4 whole checks at 0.46 ms) of 1.41 s: 0.3%.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import torch

from offload import _native
from offload.plan import Unit

logger = logging.getLogger("offload.device")

PAGE = mmap.PAGESIZE
HUGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)
_LIBC = None  # the C library, for mincore (no Python binding): loaded at the first check


def _resident(address: int, nbytes: int) -> bytes:
    """One byte per page of ``[address, address + nbytes)`` (page aligned), bit 0 set where the
    page is resident (``mincore(2)``)."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    vec = ctypes.create_string_buffer(-(-nbytes // PAGE))
    if _LIBC.mincore(address, nbytes, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed on a released parameter block")
    return vec.raw


def _private(address: int, pages: int) -> torch.Tensor:
    """Whether each of ``pages`` resident pages from ``address`` is the process's own, written
    (``/proc/self/pagemap``'s exclusively-mapped bit: a read of fresh anonymous memory maps the
    kernel's shared zero page instead); all False where the file cannot be read."""
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as f:
            f.seek(address // PAGE * 8)
            entries = f.read(pages * 8)
    except OSError:
        return torch.zeros(pages, dtype=torch.bool)
    if len(entries) != pages * 8:
        return torch.zeros(pages, dtype=torch.bool)
    return (torch.frombuffer(bytearray(entries), dtype=torch.int64) >> 56 & 1).bool()


def supported(device: torch.device) -> bool:
    """Whether units on ``device`` can use page-released blocks (CPU compute, Linux)."""
    return (
        device.type == "cpu" and sys.platform.startswith("linux") and hasattr(mmap.mmap, "madvise")
    )


def lends(device: torch.device) -> bool:
    """Whether gathers on ``device`` can lend swap buffer pages to units (the module Note
    on lent pages): page blocks, and the native extension to move pages."""
    mod = _native.get()
    return supported(device) and mod is not None and hasattr(mod, "move_pages")


class Spares:
    """Resident 2 MiB spans of pages moved out of released blocks, for the next gather
    (the module Note on recycled pages). Each span waits in a slot of its own, a 2 MiB range
    of a reserved mapping that holds no pages while empty."""

    def __init__(self, move) -> None:
        self._move = move  # offload._C.move_pages
        self._reserved: list[mmap.mmap] = []  # the slots' mappings, unmapped when dropped
        self._empty: list[int] = []  # slot addresses without pages
        self._full: list[int] = []  # slot addresses holding a span's pages

    @classmethod
    def make(cls) -> Spares | None:
        """None where pages cannot be moved (no native extension)."""
        mod = _native.get()
        move = getattr(mod, "move_pages", None) if mod is not None else None
        return cls(move) if move is not None else None

    @property
    def capacity(self) -> int:
        return len(self._empty) + len(self._full)

    @property
    def held(self) -> int:
        """Spans holding pages now (count)."""
        return len(self._full)

    def grow(self, spans: int) -> None:
        """At least ``spans`` slots from now on."""
        if spans > self.capacity:
            n = spans - self.capacity
            block = mmap.mmap(-1, (n + 1) * HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._reserved.append(block)
            address = torch.frombuffer(block, dtype=torch.uint8).data_ptr()
            first = address + -address % HUGE  # slots start on 2 MiB boundaries
            self._empty += [first + i * HUGE for i in range(n)]

    def keep(self, addr: int) -> bool:
        """Moves the span at ``addr`` into a slot (False: none is free, nothing moved)."""
        if not self._empty or not self._moved(addr, self._empty[-1], src_is_viewed=True):
            return False
        self._full.append(self._empty.pop())
        return True

    def give(self, addr: int) -> bool:
        """Moves a kept span's pages under ``addr`` (False: there is none)."""
        if not self._full or not self._moved(self._full[-1], addr, src_is_viewed=False):
            return False
        self._empty.append(self._full.pop())
        return True

    def _moved(self, src: int, dst: int, src_is_viewed: bool) -> bool:
        """Moves one span. A move the kernel refuses (e.g. at the process's mapping count
        limit) turns the spares off: every release is a ``madvise`` from then on, and training
        goes on. The block's side (``src`` when ``src_is_viewed``) stays mapped whatever
        fails (``csrc/pages.cpp``); a slot left without a mapping is never used again."""
        try:
            self._move(src, dst, HUGE, src_is_viewed)
        except OSError as exc:
            logger.warning("offload: recycling released parameter pages is off (%s)", exc)
            self.close()  # the kept pages go back to the OS now; no slot is used again
            return False
        return True

    def close(self) -> None:
        """Gives every kept span's pages back to the OS (the slots are unmapped)."""
        self._empty, self._full = [], []
        for block in self._reserved:
            block.close()
        self._reserved.clear()


class PageBlocks:
    """One anonymous mapping per unit holding its parameters (see the module Note)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._maps: dict[int, mmap.mmap] = {}
        self._flat: dict[int, torch.Tensor] = {}
        self._spans: dict[int, tuple[int, int]] = {}  # unit -> (offset in its map, whole spans)
        # unit -> its spans holding pages since its last release (made room for, or copied
        # into beside lent pieces: the module Note on recycled pages)
        self._filled: dict[int, set[int]] = {}
        self.spares = Spares.make()
        mod = _native.get()
        self._move = getattr(mod, "move_pages", None) if mod is not None else None
        self._raw: dict[int, torch.Tensor] = {}  # unit -> its block's whole pages, as bytes
        # unit -> pages lent to it: (the piece's first element, the block's range, the buffer
        # they came from, [the address they are at]: move_pages writes it, the module Note on
        # lent pages)
        self._lent: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, list[int]]]] = {}

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
        self._raw[unit.index] = raw[start : start + nbytes]
        self._spans[unit.index] = (start, spans)
        if self.spares is not None:
            self.spares.grow(spans)  # the largest unit's spans (the module Note)

    def flat(self, unit: Unit) -> torch.Tensor:
        """The unit's whole flat buffer, which its parameters view (a gather can write it in
        one piece)."""
        return self._flat[unit.index]

    def lend(self, unit: Unit, lo: int, buf: torch.Tensor) -> bool:
        """Moves the pages of ``buf`` (elements ``[lo, lo + len(buf))`` of the unit, in a swap
        buffer the caller holds) under the unit's block instead of copying them (the module
        Note on lent pages); False: nothing moved (the caller copies)."""
        raw = self._raw[unit.index]
        at = lo * self.dtype.itemsize  # the piece's offset in the block, bytes
        nbytes = -(-buf.numel() * buf.element_size() // PAGE) * PAGE  # the piece's whole pages
        if (
            self._move is None
            or buf.dtype != self.dtype
            or at % PAGE
            or buf.data_ptr() % PAGE
            or at + nbytes > raw.numel()
        ):
            return False
        block = raw[at : at + nbytes]
        where = [buf.data_ptr()]
        self._lent.setdefault(unit.index, []).append((lo, block, buf, where))  # recorded first
        return self._moved(buf.data_ptr(), block.data_ptr(), nbytes, where)

    def take_back(self, unit: Unit) -> None:
        """Moves the pages lent to the unit back to their buffers (the block's range reads
        zeros again); where the kernel refuses the move, they are copied back. Only pages
        that are in the block move (their record says where they are), so after an
        interrupted call it can be called again."""
        for _, block, buf, where in self._lent.get(unit.index, ()):
            if where[0] != block.data_ptr():
                continue  # never moved, or back already
            if not self._moved(block.data_ptr(), buf.data_ptr(), block.numel(), where):
                bytes_ = buf.view(-1).view(torch.uint8)
                bytes_.copy_(block[: bytes_.numel()])  # the pages stayed in the block
                where[0] = buf.data_ptr()
        self._lent.pop(unit.index, None)

    def holds_lent(self, unit: Unit, lo: int | None = None) -> bool:
        """Whether pages lent to the unit (those of the piece from element ``lo``, or any) are
        in its block now."""
        return any(
            where[0] == block.data_ptr() and lo in (None, at)
            for at, block, _, where in self._lent.get(unit.index, ())
        )

    @property
    def lends(self) -> bool:
        """Whether :meth:`lend` can move pages (not after the kernel refused a move)."""
        return self._move is not None

    def _moved(self, src: int, dst: int, nbytes: int, where: list[int]) -> bool:
        """Moves pages between two viewed ranges (``where[0] = dst`` once moved); a refusal
        turns lending off (one warning)."""
        if self._move is None:
            return False
        try:
            self._move(src, dst, nbytes, src_is_viewed=True, dst_is_viewed=True, where=where)
        except OSError as exc:
            logger.warning("offload: lending swap buffer pages to gathered units is off (%s)", exc)
            self._move = None
            return False
        return True

    def make_room(self, unit: Unit) -> None:
        """Moves kept spans' pages under the unit's whole spans (the module Note on recycled
        pages); the rest come back as the gather writes them."""
        self._fill(unit, range(self._spans[unit.index][1]))

    def make_room_for(self, unit: Unit, lo: int, hi: int) -> None:
        """:meth:`make_room` for the spans wholly inside elements ``[lo, hi)``: a piece a
        lending gather copies (the module Note on recycled pages)."""
        isz = self.dtype.itemsize
        first, end = -(-lo * isz // HUGE), min(hi * isz // HUGE, self._spans[unit.index][1])
        self._fill(unit, range(first, end))

    def _fill(self, unit: Unit, spans: range) -> None:
        self._filled.setdefault(unit.index, set()).update(spans)
        if self.spares is None:
            return
        base = self._flat[unit.index].data_ptr()
        for i in spans:
            if not self.spares.give(base + i * HUGE):
                return

    def touched(self, unit: Unit) -> list[tuple[int, int, bool]]:
        """Where the released ``unit``'s block holds pages (the module Note on touched
        blocks): ``(lo, hi, written)`` element ranges, each inside one parameter, ``written``
        where a page is the process's own or a value is not zero. The pages are given back
        (:meth:`drop`), so each touch is reported once."""
        raw = self._raw[unit.index]
        isz, total = self.dtype.itemsize, self._flat[unit.index].numel()
        vec = _resident(raw.data_ptr(), raw.numel())
        if not vec.strip(b"\0"):  # no page (at C speed: the check of every forward)
            return []
        flags = torch.frombuffer(bytearray(vec + b"\0"), dtype=torch.uint8) & 1
        edges = torch.diff(flags, prepend=torch.zeros(1, dtype=torch.uint8)).nonzero().view(-1)
        flat, runs = self._flat[unit.index], []
        for first, end in edges.view(-1, 2).tolist():  # resident pages [first, end)
            private = _private(raw.data_ptr() + first * PAGE, end - first)
            lo, hi = first * PAGE // isz, min(-(-end * PAGE // isz), total)
            for seg in unit.layout.segments:  # split at the parameters' bounds
                a, b = max(lo, seg.offset), min(hi, seg.end)
                if a < b:
                    pages = private[a * isz // PAGE - first : -(-b * isz // PAGE) - first]
                    runs.append((a, b, bool(pages.any()) or bool(flat[a:b].any())))
        self.drop(unit)
        return runs

    def drop(self, unit: Unit) -> None:
        """Releases the unit's pages: its whole spans kept for the next gather while spares
        have room, the rest given back to the OS; its parameters read as zeros until written.
        Pages lent to it go back to their buffers first."""
        self.take_back(unit)
        block = self._maps[unit.index]
        start, _ = self._spans[unit.index]
        filled = self._filled.pop(unit.index, ())  # else it holds no pages
        if self.spares is not None:
            base = self._flat[unit.index].data_ptr()
            for i in sorted(filled):
                if not self.spares.keep(base + i * HUGE):
                    break
        # (a kept span holds no pages now: advising it too costs nothing)
        block.madvise(mmap.MADV_DONTNEED, start, len(block) - start)

    def close(self) -> None:
        """Forgets the blocks; each mapping goes away with the last tensor viewing it."""
        self._maps.clear()
        self._flat.clear()
        self._raw.clear()
        self._lent.clear()
        if self.spares is not None:
            self.spares.close()
