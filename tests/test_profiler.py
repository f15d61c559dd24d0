"""A training step seen by ``torch.profiler``: the runtime's phases are named ``offload::...``
ranges, the same names as its ``logger.debug`` lines, so a trace reads like the state machine."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from engine_models import STACK_VOCAB, StackLM

import offload

RANGES = {"offload::gather", "offload::release", "offload::grads", "offload::step"}


def test_a_step_shows_the_offload_ranges(tmp_path, caplog):
    (tmp_path / "p").mkdir()
    cfg = {
        "device": "cpu",
        "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "p"),
                          "persistence_threshold": 0, "buffer_size": "1MiB"},
        "wrap": {"module_classes": ["StackBlock"]},
    }  # fmt: skip
    model, opt = offload.wrap(StackLM(), cfg)
    tokens = torch.randint(0, STACK_VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    caplog.set_level(logging.DEBUG, logger="offload.runtime")
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, STACK_VOCAB), tokens[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        names = {e.name for e in prof.events()}
        assert RANGES | {"offload::update"} <= names, sorted(n for n in names if "offload" in n)
        gathers = [e for e in prof.events() if e.name == "offload::gather"]
        # each block in forward and backward, the root once; the last block (the forward's
        # last) stays gathered into the backward
        assert len(gathers) == 2 * 4 + 1 - 1
        logged = {r.getMessage().split()[0] for r in caplog.records}
        assert {"offload::gather", "offload::release"} <= logged
    finally:
        opt.close()
