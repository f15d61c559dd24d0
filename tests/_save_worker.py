"""Run by test_checkpoint_kill.py in fresh processes: a save killed with SIGKILL part-way.
(The test forks them from a forkserver that has imported torch, so a process does not spend
its seconds importing it; ``python _save_worker.py MODE ...`` runs one by hand.)

    _save_worker.py full WORKDIR             STEPS uninterrupted steps; final state and losses
    _save_worker.py calibrate WORKDIR        save A at step A_STEP, one more step, save B while
                                             recording every line the save runs (events.json)
    _save_worker.py kill WORKDIR K           the same, SIGKILLed just before the save's K-th line
    _save_worker.py resume WORKDIR           a fresh process loads WORKDIR/ck's latest, trains
                                             to STEPS, writes its final state, saves once more

Kill points are lines of offload/api/checkpoint.py and checkpoint_files.py, counted by a
trace function during B's save only (every line a save runs is a possible point, and the count
is the same in every process). The process kills itself: SIGKILL, no handler, no cleanup.
"""

from __future__ import annotations

import json
import linecache
import os
import signal
import sys
import traceback
from pathlib import Path

import torch
from engine_models import batches, make_model, placement_config, train_wrapped

import offload
from offload.api import checkpoint, checkpoint_files

A_STEP, STEPS = 2, 4
TRACED = {checkpoint.__file__, checkpoint_files.__file__}


def trace_save(kill_at: int | None, events: list | None):
    """A trace function counting the lines the save runs; kills the process at ``kill_at``."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if events is not None:
                code = frame.f_code
                text = linecache.getline(code.co_filename, frame.f_lineno).strip()
                events.append([Path(code.co_filename).name, code.co_name, frame.f_lineno, text])
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        return local

    def start(frame, event, arg):
        return local if frame.f_code.co_filename in TRACED else None

    return start


def _setup(workdir: Path, name: str):
    model, opt = offload.wrap(make_model(), placement_config("nvme", "nvme", workdir / name))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _dump(workdir: Path, name: str, model, opt, losses: list) -> None:
    sd = opt.state_dict()
    torch.save(
        {
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": {f"{i}.{k}": v for i, e in sd["state"].items() for k, v in e.items()},
            "offload": sd["offload"],
            "lr": opt.param_groups[0]["lr"],
        },
        workdir / f"{name}.pt",
    )
    (workdir / f"{name}.json").write_text(json.dumps(losses))


def run(argv: list[str]) -> None:
    """Runs one mode; a failure's traceback goes to WORKDIR/error.txt (exit status 1)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever the parent ignored
    try:
        main(argv)
    except BaseException:
        Path(argv[1], "error.txt").write_text(traceback.format_exc())
        raise


def main(argv: list[str]) -> None:
    mode, workdir = argv[0], Path(argv[1])
    data = batches(8)
    if mode == "full":
        model, opt, sched = _setup(workdir, mode)
        losses, _ = train_wrapped(model, opt, data, STEPS, 1, 1.0, sched=sched)
        _dump(workdir, mode, model, opt, losses)
    elif mode in ("calibrate", "kill"):
        model, opt, sched = _setup(workdir, "train")
        train_wrapped(model, opt, data, A_STEP, 1, 1.0, sched=sched)
        ck = workdir / "ck"
        offload.save_checkpoint(ck, model, opt, scheduler=sched.state_dict(), step=A_STEP)
        train_wrapped(model, opt, data, A_STEP + 1, 1, 1.0, start=A_STEP, sched=sched)
        events: list | None = [] if mode == "calibrate" else None
        kill_at = int(argv[2]) if mode == "kill" else None
        sys.settrace(trace_save(kill_at, events))
        offload.save_checkpoint(ck, model, opt, scheduler=sched.state_dict(), step=A_STEP + 1)
        sys.settrace(None)
        if mode == "calibrate":
            (workdir / "events.json").write_text(json.dumps(events))
            (workdir / "offload_file.json").write_text(json.dumps(offload.__file__))
    elif mode == "resume":
        model, opt, sched = _setup(workdir, mode)
        ck = workdir / "ck"
        extra = offload.load_checkpoint(ck, model, opt)
        sched.load_state_dict(extra["scheduler"])
        losses, _ = train_wrapped(model, opt, data, STEPS, 1, 1.0, start=extra["step"], sched=sched)
        _dump(workdir, mode, model, opt, losses)
        done = offload.save_checkpoint(ck, model, opt, scheduler=sched.state_dict(), step=STEPS)
        report = {"loaded_step": extra["step"], "after_save": sorted(os.listdir(ck))}
        report["saved"] = done.name
        (workdir / "resume_report.json").write_text(json.dumps(report))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    opt.close()


if __name__ == "__main__":
    run(sys.argv[1:])
