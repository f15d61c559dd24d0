"""Ctrl-C held back over the lines that must not stop half way (offload/_interrupts.py)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from offload._interrupts import interrupts_deferred


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler at the next line


def test_a_ctrl_c_inside_the_block_comes_out_when_the_outermost_block_ends(python_ctrl_c):
    ran = []
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            _ctrl_c()
            ran.append("after the first")
            with interrupts_deferred():
                _ctrl_c()
                ran.append("inner")
            ran.append("after the inner block")
    assert ran == ["after the first", "inner", "after the inner block"]
    assert signal.getsignal(signal.SIGINT) is handler
    with interrupts_deferred():  # nothing noted is left over for the next block
        ran.append("next")
    assert ran[-1] == "next"


def test_the_handler_installed_before_gets_the_signal_once():
    got = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        with interrupts_deferred():
            _ctrl_c()
            _ctrl_c()
            assert got == []
        assert got == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_error_in_the_block_goes_up_with_no_signal_noted():
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(ValueError, match="inside"), interrupts_deferred():
        raise ValueError("inside")
    assert signal.getsignal(signal.SIGINT) is handler


def test_off_the_main_thread_and_with_an_ignored_signal_the_block_runs_as_it_is():
    seen = []

    def worker():
        with interrupts_deferred():
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [signal.getsignal(signal.SIGINT)]  # no handler installed from there
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts_deferred():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            _ctrl_c()  # ignored, as before the block
    finally:
        signal.signal(signal.SIGINT, previous)
