"""Page-released parameter blocks (offload.device.pages): released memory really leaves the
process, the parameters keep their storage (autograd's saved tensors stay valid), and a
released parameter reads zeros instead of faulting."""

from __future__ import annotations

import psutil
import pytest
import torch
import torch.nn as nn
from smaps import mapping_field

from offload.device import pages
from offload.plan import FlatLayout, Unit

pytestmark = pytest.mark.skipif(
    not pages.supported(torch.device("cpu")), reason="page release needs Linux madvise"
)


def _unit(module: nn.Module) -> Unit:
    return Unit(0, "m", module, FlatLayout.build(list(module.named_parameters())))


def _released(module: nn.Module) -> tuple[Unit, pages.PageBlocks]:
    """``module`` as a unit in page blocks, attached and released (its pages not resident)."""
    unit = _unit(module)
    blocks = pages.PageBlocks(torch.float32)
    blocks.attach(unit)
    blocks.drop(unit)
    return unit, blocks


def test_released_pages_leave_the_process_and_storage_stays():
    module = nn.Linear(4096, 4096, bias=True)  # 64 MiB of fp32
    unit = _unit(module)
    blocks = pages.PageBlocks(torch.float32)
    blocks.spares = None  # every release gives its pages back (see the next test for spares)
    blocks.attach(unit)
    blocks.drop(unit)
    proc = psutil.Process()
    storage = module.weight.untyped_storage().data_ptr()
    before = proc.memory_info().rss
    blocks.make_room(unit)
    module.weight.data.fill_(1.5)  # gather: pages come back as they are written
    module.bias.data.fill_(2.0)
    filled = proc.memory_info().rss
    assert filled - before > 60 * 2**20
    blocks.drop(unit)  # release
    assert filled - proc.memory_info().rss > 60 * 2**20
    assert module.weight.untyped_storage().data_ptr() == storage  # the same storage
    assert torch.count_nonzero(module.weight) == 0 and torch.count_nonzero(module.bias) == 0
    blocks.close()
    module.weight.data.fill_(3.0)  # the mapping lives as long as a tensor views it
    assert float(module.weight.detach()[7, 9]) == 3.0


def test_blocks_start_on_a_huge_page_and_ask_for_huge_pages():
    """A unit's block starts on a 2 MiB boundary (its whole 2 MiB spans advised as huge
    pages, so a gather faults once per 2 MiB); its tail past the last span stays in 4 KiB
    pages, so a unit never holds more resident memory than its bytes round up to 4 KiB."""
    module = nn.Linear(1024, 1280, bias=False)  # 5 MiB: two whole spans and a 1 MiB tail
    unit = _unit(module)
    blocks = pages.PageBlocks(torch.float32)
    blocks.attach(unit)
    flat = blocks.flat(unit)
    assert flat.data_ptr() % pages.HUGE == 0
    assert "hg" in mapping_field(flat.data_ptr(), "VmFlags:")  # MADV_HUGEPAGE over the spans
    tail = flat.data_ptr() + 2 * pages.HUGE
    assert "hg" not in mapping_field(tail, "VmFlags:")  # the advised range is its own mapping
    module.weight.data.fill_(1.0)
    blocks.drop(unit)
    blocks.close()


@pytest.mark.skipif(pages.Spares.make() is None, reason="moving pages needs the native extension")
def test_a_release_keeps_its_pages_for_the_next_gather():
    """A released unit's whole 2 MiB spans wait as spares (it reads zeros meanwhile); the next
    gather of another unit writes into them, so the process does not grow; beyond the largest
    unit's spans, and when the blocks close, the pages leave the process."""
    a, b = nn.Linear(2048, 2048, bias=False), nn.Linear(2048, 2048, bias=False)  # 16 MiB each
    small = nn.Linear(1024, 1024, bias=False)  # 4 MiB: two spans
    units = [
        Unit(i, f"m{i}", m, FlatLayout.build(list(m.named_parameters())))
        for i, m in enumerate((a, b, small))
    ]
    blocks = pages.PageBlocks(torch.float32)
    for u in units:
        blocks.attach(u)
        blocks.drop(u)
    assert blocks.spares.capacity == 8 and blocks.spares.held == 0  # attached: nothing held
    moves = []  # (src, dst, src_is_viewed): the block's side is the one kept mapped
    real = blocks.spares._move
    blocks.spares._move = lambda *args: moves.append(args) or real(*args)
    in_blocks = [
        (blocks.flat(u).data_ptr(), blocks.flat(u).data_ptr() + blocks.flat(u).nbytes)
        for u in units
    ]

    def in_a_block(addr) -> bool:
        return any(lo <= addr < hi for lo, hi in in_blocks)

    proc = psutil.Process()
    storage = a.weight.untyped_storage().data_ptr()
    blocks.make_room(units[0])
    a.weight.data.fill_(1.5)
    filled = proc.memory_info().rss
    blocks.drop(units[0])
    assert blocks.spares.held == 8
    assert torch.count_nonzero(a.weight) == 0  # released: zeros, not the old values
    assert a.weight.untyped_storage().data_ptr() == storage
    blocks.make_room(units[1])
    assert blocks.spares.held == 0
    b.weight.data.fill_(2.5)
    assert proc.memory_info().rss - filled < 4 * 2**20  # b took a's pages
    assert torch.all(b.weight == 2.5) and torch.count_nonzero(a.weight) == 0
    blocks.make_room(units[2])  # no spares left: this one faults its pages in
    small.weight.data.fill_(1.0)
    blocks.drop(units[2])  # two spans kept
    blocks.drop(units[1])  # six of its eight kept: the rest leaves the process
    assert blocks.spares.held == 8
    held = proc.memory_info().rss
    blocks.close()
    assert held - proc.memory_info().rss > 14 * 2**20
    assert moves and all(
        viewed == in_a_block(src) != in_a_block(dst) for src, dst, _, viewed in moves
    )


@pytest.mark.skipif(pages.Spares.make() is None, reason="moving pages needs the native extension")
def test_a_piece_copied_beside_lent_ones_writes_into_spares_and_its_release_keeps_them():
    """A lending gather makes no room for its unit; a piece it copies gets spares under its
    whole spans only (a span it covers in part faults in), and the release keeps those spans
    for the next gather."""
    a, b = nn.Linear(2048, 2048, bias=False), nn.Linear(2048, 2048, bias=False)  # 8 spans each
    units = [Unit(i, f"m{i}", m, FlatLayout.build(list(m.named_parameters()))) for i, m in
             enumerate((a, b))]  # fmt: skip
    blocks = pages.PageBlocks(torch.float32)
    for u in units:
        blocks.attach(u)
        blocks.drop(u)
    blocks.make_room(units[0])
    a.weight.data.fill_(1.5)
    blocks.drop(units[0])
    assert blocks.spares.held == 8
    span = pages.HUGE // 4  # elements
    proc = psutil.Process()
    before = proc.memory_info().rss
    blocks.make_room_for(units[1], 1, 4 * span - 1)  # spans 1 and 2 whole, 0 and 3 in part
    assert blocks.spares.held == 6
    b.weight.data.view(-1)[span : 3 * span].fill_(2.5)  # the copy, into the recycled pages
    assert proc.memory_info().rss - before < 2 * 2**20  # faulted in, it would be 4 MiB more
    assert torch.count_nonzero(a.weight) == 0
    blocks.drop(units[1])
    assert blocks.spares.held == 8  # its two spans kept again
    assert torch.count_nonzero(b.weight) == 0
    blocks.close()


@pytest.mark.skipif(pages.Spares.make() is None, reason="moving pages needs the native extension")
def test_a_refused_move_turns_the_spares_off_and_releases_still_free(caplog):
    module = nn.Linear(2048, 2048, bias=False)  # 16 MiB: eight spans
    unit, blocks = _released(module)

    def refuse(src, dst, nbytes, src_is_viewed):
        raise OSError(12, "move_pages: mremap of 2097152 bytes: Cannot allocate memory")

    blocks.spares._move = refuse
    proc = psutil.Process()
    blocks.make_room(unit)
    module.weight.data.fill_(1.5)
    filled = proc.memory_info().rss
    with caplog.at_level("WARNING", logger="offload.device"):
        blocks.drop(unit)
    assert "recycling released parameter pages is off" in caplog.text
    assert blocks.spares.capacity == 0
    assert filled - proc.memory_info().rss > 14 * 2**20  # released the old way
    assert torch.count_nonzero(module.weight) == 0
    blocks.close()


def _buffers(n: int, elems: int) -> list[torch.Tensor]:
    """``n`` swap buffers of ``elems`` fp32 each in one pool mapping (as ``BufferPool`` has)."""
    from offload.io.aligned import aligned_empty  # noqa: PLC0415

    pool = aligned_empty(n * elems * 4, dtype=torch.float32)
    return [pool[i * elems : (i + 1) * elems] for i in range(n)]


@pytest.mark.skipif(pages.Spares.make() is None, reason="moving pages needs the native extension")
def test_a_buffers_pages_are_lent_to_the_unit_and_taken_back():
    """A gather from NVMe moves the pages of each piece's swap buffer under the unit instead of
    copying them; the buffer reads zeros meanwhile, and the release moves them back (the store
    keeps the piece cached there). Nothing is copied: the process does not grow."""
    module = nn.Linear(2048, 2048, bias=False)  # 16 MiB: two 8 MiB pieces
    unit, blocks = _released(module)
    half = 2048 * 1024
    bufs = _buffers(2, half)
    bufs[0].fill_(1.5)
    bufs[1].fill_(2.5)
    storage = module.weight.untyped_storage().data_ptr()
    # RSS is read right around each move: the checks' temporaries may stay in the heap
    proc = psutil.Process()
    before = proc.memory_info().rss
    assert blocks.lend(unit, 0, bufs[0]) and blocks.lend(unit, half, bufs[1])
    lent = proc.memory_info().rss
    w = module.weight.detach().view(-1)
    assert torch.all(w[:half] == 1.5) and torch.all(w[half:] == 2.5)
    assert torch.count_nonzero(bufs[0]) == 0 and torch.count_nonzero(bufs[1]) == 0  # moved
    assert lent - before < 2 * 2**20  # not copied
    assert module.weight.untyped_storage().data_ptr() == storage
    before = proc.memory_info().rss
    blocks.drop(unit)  # takes the pages back first
    assert proc.memory_info().rss - before < 2 * 2**20
    assert torch.all(bufs[0] == 1.5) and torch.all(bufs[1] == 2.5)
    assert torch.count_nonzero(module.weight) == 0
    # what cannot move whole pages is left to a copy
    assert not blocks.lend(unit, 1, bufs[0][: half - 1])  # 4 bytes into a page
    assert not blocks.lend(unit, 0, bufs[0][1:])  # a buffer not on a page boundary
    assert not blocks.lend(unit, 0, bufs[0].view(torch.int32))  # another dtype
    assert torch.all(bufs[0] == 1.5) and torch.count_nonzero(module.weight) == 0
    blocks.close()


@pytest.mark.skipif(pages.Spares.make() is None, reason="moving pages needs the native extension")
def test_a_refused_lend_turns_lending_off_and_a_refused_return_copies(caplog):
    module = nn.Linear(2048, 1024, bias=False)  # 8 MiB: one piece
    unit, blocks = _released(module)
    (buf,) = _buffers(1, 2048 * 1024)
    buf.fill_(0.5)
    assert blocks.lend(unit, 0, buf)
    refused = []

    def refuse(src, dst, nbytes, src_is_viewed, dst_is_viewed, where):
        refused.append((src, dst))
        raise OSError(12, "move_pages: mremap of 8388608 bytes: Cannot allocate memory")

    blocks._move = refuse
    with caplog.at_level("WARNING", logger="offload.device"):
        blocks.take_back(unit)  # the move is refused: the pages are copied back
    assert "lending swap buffer pages to gathered units is off" in caplog.text
    assert torch.all(buf == 0.5)
    blocks.drop(unit)
    assert torch.count_nonzero(module.weight) == 0
    assert not blocks.lend(unit, 0, buf)  # off from now on, without asking the kernel again
    assert len(refused) == 1
    blocks.close()


def test_a_released_block_tells_reads_from_writes_once():
    """``touched``: a released block holds no page, so one it holds was read (the kernel's
    zero page) or written by code outside offload; a write of zeros (a ``clamp_`` of the
    zeros it read, WGAN's clipping through ``p.data``) counts as a write (the page is the
    process's own). Each touch is reported once: the pages go back to the OS."""
    module = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    unit, blocks = _released(module)
    names = {id(s.param): s.name for s in unit.layout.segments}

    def seen() -> tuple[set, set]:
        wrote, read = set(), set()
        for lo, hi, w in blocks.touched(unit):
            for s in unit.layout.segments:
                if s.offset < hi and lo < s.end:
                    (wrote if w else read).add(names[id(s.param)])
        return wrote, read

    assert seen() == (set(), set())
    assert float(module[0].weight.detach().sum()) == 0  # a read
    assert seen() == (set(), {"0.weight"})
    assert seen() == (set(), set())  # once
    module[1].weight.data.clamp_(-0.1, 0.1)  # zeros written over zeros
    module[0].weight.data[0, :8] = 2.0  # a value
    wrote, read = seen()
    # (a page is the kernel's: a 2 MiB huge page holding a neighbour names it too)
    assert {"0.weight", "1.weight"} <= wrote and read == set()
    assert torch.count_nonzero(module[0].weight.detach()) == 0  # given back: zeros again
    blocks.close()
