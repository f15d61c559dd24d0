"""One rank of a multi-rank test (started by ``dist_harness.run_ranks``): runs a list of jobs.

Environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (``env://``, what
torchrun sets). Argument: a JSON file ``{"out": DIR, "timeout": seconds, "jobs": [...]}``;
each job wraps ``engine_models.make_model()`` with ``placement_config(param, optim, ...)`` and
``distributed.stage``, trains its slice of every global batch (``GLOBAL_BATCH`` rows split
evenly over the ranks) and writes ``<name>.json`` (rank 0: the mean loss over ranks per step;
every rank: its stats) and ``<name>.pt`` (rank 0: ``model.state_dict()``, gathered).

Job keys: ``name``, ``param``, ``optim``, ``dtype`` (fp32), ``stage``, ``steps``, ``start``
(0), ``accum`` (2), ``clip`` (1.0), ``config`` (extra top-level keys), ``load`` / ``save``
(checkpoint directories; the scheduler and the step go in the checkpoint's extra values),
``fail_at`` ({"rank": r, "step": s}: that rank raises there), ``optimizer_state`` (write the
optimizer's gathered state_dict), ``export`` (a path: offload.export, written by rank 0).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from engine_models import batches, lm_loss, make_model, placement_config

import offload

GLOBAL_BATCH = 8
STEPS_DATA = 16


def slice_of(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = batch.shape[0] // world
    return batch[rank * per : (rank + 1) * per]


def run_job(job: dict, out: Path, rank: int, world: int) -> None:
    tmp = out / "nvme" / job["name"]
    cfg = placement_config(job["param"], job["optim"], tmp, dtype=job.get("dtype", "fp32"))
    cfg["distributed"] = {"stage": job["stage"], "timeout": job.get("timeout", 60)}
    cfg.update(job.get("config", {}))
    model, opt = offload.wrap(make_model(), cfg)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    start = job.get("start", 0)
    if job.get("load"):
        extra = offload.load_checkpoint(job["load"], model, opt)
        sched.load_state_dict(extra["scheduler"])
        start = extra["step"]
    data = batches(STEPS_DATA, batch=GLOBAL_BATCH)
    accum, clip = job.get("accum", 2), job.get("clip", 1.0)
    losses, stats = [], []
    fail = job.get("fail_at") or {}
    for s in range(start, job["steps"]):
        total = 0.0
        for m in range(accum):
            if fail.get("rank") == rank and fail.get("step") == s:
                raise RuntimeError(f"injected failure on rank {rank} at step {s}")
            batch = slice_of(data[(s * accum + m) % len(data)], rank, world)
            loss = lm_loss(model, batch) / accum
            loss.backward()
            total += float(loss.detach())
        if clip:
            opt.clip_grad_norm_(clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
        st = opt.stats()
        stats.append(
            {
                "collectives": st["collectives"],
                "collective_bytes": st["collective_bytes"],
                "bytes": st["bytes"],
                "state_bytes": st["state_bytes"],
            }
        )
    mean = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean)
    mean /= world
    if job.get("save"):
        offload.save_checkpoint(
            job["save"], model, opt, scheduler=sched.state_dict(), step=job["steps"]
        )
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict() if job.get("optimizer_state") else None
    if job.get("export"):
        offload.export(model, job["export"], dtype=torch.float32)
    result = {"losses": mean.tolist(), "stats": stats, "rank": rank, "world": world}
    if rank == 0:
        torch.save({"state": state, "optimizer": opt_state}, out / f"{job['name']}.pt")
    (out / f"{job['name']}.{rank}.json").write_text(json.dumps(result))
    opt.close()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("timeout", 60)))
    try:
        for job in spec["jobs"]:
            run_job(job, Path(spec["out"]), rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
