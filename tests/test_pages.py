"""Page-released parameter blocks (offload.device.pages): released memory really leaves the
process, the parameters keep their storage (autograd's saved tensors stay valid), and a
released parameter reads zeros instead of faulting."""

from __future__ import annotations

import psutil
import pytest
import torch
import torch.nn as nn

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
