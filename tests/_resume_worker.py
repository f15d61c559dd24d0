"""Run by test_checkpoint.py in fresh processes: train, save, load, continue."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from engine_models import batches, make_model, placement_config, train_wrapped

import offload


def main() -> None:
    mode, workdir = sys.argv[1], Path(sys.argv[2])
    cfg = placement_config("nvme", "nvme", workdir / mode)
    model, opt = offload.wrap(make_model(), cfg)
    data = batches(16)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    if mode == "full":
        losses, _ = train_wrapped(model, opt, data, 20, 2, 1.0, sched=sched)
    elif mode == "first":
        losses, _ = train_wrapped(model, opt, data, 10, 2, 1.0, sched=sched)
        offload.save_checkpoint(workdir / "ckpt", model, opt, scheduler=sched.state_dict(), step=10)
    else:  # "second": a fresh process resumes
        extra = offload.load_checkpoint(workdir / "ckpt", model, opt)
        sched.load_state_dict(extra["scheduler"])
        losses, _ = train_wrapped(model, opt, data, 20, 2, 1.0, start=extra["step"], sched=sched)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, workdir / f"{mode}.pt")
    (workdir / f"{mode}.json").write_text(json.dumps(losses))
    opt.close()


if __name__ == "__main__":
    main()
