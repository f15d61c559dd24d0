"""Fixtures shared by the test files."""

from __future__ import annotations

import faulthandler
import signal
import subprocess

import pytest


@pytest.fixture
def python_ctrl_c():
    """Ctrl-C raises ``KeyboardInterrupt`` for the test's duration, as in a foreground run.

    A shell script starts its background jobs (``cmd &``) with SIGINT ignored, and Python then
    installs no handler of its own; a test that sends itself SIGINT would see nothing happen."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(name, *options)``: a tmpfs mounted at ``tmp_path / name`` (``"size=1m"``,
    ``"ro"``), unmounted when the test ends; the test is skipped where mounting is not
    permitted (it needs root)."""
    mounted = []

    def mount(name: str, *options: str):
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        cmd = ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(d)]
        if subprocess.run(cmd, capture_output=True).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(d)
        return d

    yield mount
    for d in reversed(mounted):
        subprocess.run(["umount", "-l", str(d)], check=True)


@pytest.fixture
def watchdog():
    """A test that hangs (a wait nobody ends) ends the run after 120 s, exit status 1, instead
    of running until CI's limit (faulthandler's stacks of every thread go to stderr, which
    pytest captures: rerun the test with ``-s`` to see them)."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
