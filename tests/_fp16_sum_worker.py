"""One rank (or the one process) of the fp16 reduction test: a linear layer whose gradient is
40000 in every entry, finite in fp16 (largest 65504) on every rank and in one process on the
whole batch, while the sum of two ranks' (80000) is not. Arguments: ``STAGE:REDUCE_DTYPE``
(``distributed.reduce_dtype``); a JSON line for each: the stage, the reduce dtype, the rank,
the norm ``grad_norm()`` saw, the skipped steps and the weight after one step."""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

import offload
from offload.dist import init_process_group

ROWS = 4  # the global batch


def config(stage: int, reduce_dtype: str = "fp16") -> dict:
    static = {"initial": 1.0, "growth_factor": 1.0, "backoff_factor": 1.0, "min_scale": 1.0}
    return {
        "device": "cpu",
        "dtype": "fp16",
        "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0},
        "loss_scale": static,
        "distributed": {"stage": stage, "reduce_dtype": reduce_dtype},
    }


def train_one_step(stage: int, world: int, reduce_dtype: str = "fp16") -> dict:
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(8, 8, bias=False))
    model, optimizer = offload.wrap(layer, config(stage, reduce_dtype))
    try:
        x = torch.full((ROWS // world, 8), 40000.0, dtype=torch.float16)
        loss = model(x).float().sum(dim=1).mean()  # d loss / d W = the mean row: 40000
        optimizer.scale_loss(loss).backward()
        norm = float(optimizer.grad_norm())
        optimizer.step()
        weight = model.state_dict()["0.weight"].float().flatten().tolist()
        return {"norm": norm, "skipped": optimizer.skipped_steps, "weight": weight}
    finally:
        optimizer.close()


def main() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        init_process_group("gloo")
    for arg in sys.argv[1:]:
        stage, reduce_dtype = arg.split(":")
        out = {"stage": int(stage), "reduce_dtype": reduce_dtype}
        out["rank"] = int(os.environ.get("RANK", "0"))
        print(json.dumps(out | train_one_step(int(stage), world, reduce_dtype)), flush=True)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
