"""Starting the ranks of a multi-rank test: one process per rank, env:// rendezvous on
localhost, a default SIGINT (``children.default_sigint``), and a hang timeout after which every
rank still running is killed and the test fails with each rank's last output."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from children import ROOT, default_sigint

WORKER = Path(__file__).resolve().parent / "_dist_worker.py"
HANG = 240  # seconds for a whole group of ranks on a loaded 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, **extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",  # a rank that aborts prints every thread's Python stack
        **extra,
    )
    return env


def start_ranks(cmd: list[str], world: int, cwd: Path, **extra) -> list[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen(
            cmd,
            env=rank_env(r, world, port, **extra),
            cwd=str(cwd),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=default_sigint,
        )
        for r in range(world)
    ]


def wait_all(procs: list[subprocess.Popen], timeout: float = HANG) -> list[tuple[int, str, str]]:
    """Waits for every process (killing them all at the deadline); ``(returncode, stdout,
    stderr)`` of each, -9 for one that was killed."""
    deadline = time.monotonic() + timeout
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, o, e))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            o, e = p.communicate()
            out.append((-9, o, e))
    return out


def run_ranks(world: int, jobs: list[dict], out: Path, timeout: float = HANG) -> None:
    """Runs ``jobs`` (see ``_dist_worker.py``) on ``world`` ranks; raises with every rank's
    error output when one fails or the group hangs."""
    out.mkdir(parents=True, exist_ok=True)
    spec = out / f"spec-{time.monotonic_ns()}.json"
    spec.write_text(json.dumps({"out": str(out), "jobs": jobs, "timeout": 60}))
    procs = start_ranks([sys.executable, str(WORKER), str(spec)], world, out)
    results = wait_all(procs, timeout)
    if any(rc != 0 for rc, _, _ in results):
        report = "\n".join(
            f"--- rank {r}: exit {rc}\n{err[-4000:]}" for r, (rc, _, err) in enumerate(results)
        )
        raise AssertionError(f"a rank failed or the group hung:\n{report}")


def result(out: Path, name: str, rank: int = 0) -> dict:
    return json.loads((out / f"{name}.{rank}.json").read_text())
