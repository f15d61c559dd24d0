"""Fixtures shared by the test files."""

from __future__ import annotations

import signal

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
