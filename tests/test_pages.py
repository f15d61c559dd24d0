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


def test_released_pages_leave_the_process_and_storage_stays():
    module = nn.Linear(4096, 4096, bias=True)  # 64 MiB of fp32
    unit = _unit(module)
    blocks = pages.PageBlocks(torch.float32)
    blocks.attach(unit)
    blocks.drop(unit)
    proc = psutil.Process()
    storage = module.weight.untyped_storage().data_ptr()
    before = proc.memory_info().rss
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
