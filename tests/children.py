"""Running child processes from tests: a default SIGINT, the training worker, its progress,
the stacks of one that does not end.

A child inherits its parent's signal dispositions through exec. When the suite runs with SIGINT
ignored (a shell's background job), Python in the child leaves SIGINT ignored and never installs
its KeyboardInterrupt handler, so a test that sends SIGINT would wait for its whole timeout.
Every test that signals a child starts it with :func:`default_sigint` as ``preexec_fn``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "_exit_worker.py"
TIMEOUT = 120  # seconds for a child to start, train and end on a loaded machine


def default_sigint() -> None:
    """``preexec_fn``: the child starts with SIGINT at its default disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_worker(root: Path, end: str, *places: str, env: dict | None = None) -> subprocess.Popen:
    """Starts ``_exit_worker.py`` (see there for ``end`` and ``places``) on this checkout."""
    env = dict(os.environ if env is None else env, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(root), end, *places],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(root),
        preexec_fn=default_sigint,
    )


def stacks_of_stuck(proc: subprocess.Popen) -> str:
    """A child that did not end in time: where its threads wait. A child started with
    ``PYTHONFAULTHANDLER=1`` in its environment prints every thread's stack at SIGABRT; the
    stderr it wrote (the stacks last) comes back, and the child is killed if it still runs."""
    try:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err or ""


def wait_for_step(proc: subprocess.Popen, step: int) -> None:
    """Reads the child's output until it reports ``step``; kills it and fails otherwise."""
    deadline = time.monotonic() + TIMEOUT
    for line in proc.stdout:
        if line.strip() == f"step {step}":
            return
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise AssertionError(f"the worker never reached step {step}: {proc.communicate()[1][-3000:]}")
