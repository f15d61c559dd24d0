"""Ctrl-C held back over a few lines that must not stop half way.

Note: why defer
    Python raises a ``KeyboardInterrupt`` at whatever line the main thread runs when Ctrl-C
    arrives, cleanup code included. Most of offload's state survives that: a record is written
    before the change it describes, and the cleanup that reads it can run again. Lent pages
    are the exception (``offload.device.pages``, Note on lent pages): the cleanup that moves a
    unit's pages back to their swap buffers and gives the buffers back is itself interrupted by
    a second Ctrl-C, and a unit then still marked gathered computes with some of its pieces
    reading zeros, or a buffer stays pinned for good. So those few lines (a release, a failed
    gather's cleanup; milliseconds) run under :func:`interrupts_deferred`: a Ctrl-C arriving
    meanwhile is noted and delivered by the handler that was installed before, as soon as
    they end, so the process still stops, a few milliseconds later.

    Python runs signal handlers on the main thread only, and only the main thread may install
    one; elsewhere, and where the handler is not a Python callable (``SIG_IGN``, ``SIG_DFL``:
    nothing to deliver later), the block runs as it is. Nested blocks install the handler once.

    The handlers are read and set through ``_signal``, the C module under :mod:`signal`:
    ``signal.getsignal`` and ``signal.signal`` wrap each handler they return in an enum, which
    made a block cost 10.3 us, and the main thread enters one for each IO request whose
    completion it finishes: ~0.6% of its time in bench_e2e's recipe (py-spy, 2026-12-06).
    Through ``_signal`` a block costs 2.0 us (best of 5, ``python -m timeit -s "from
    offload._interrupts import interrupts_deferred" "with interrupts_deferred(): pass"``).
"""

from __future__ import annotations

import _signal  # (the Note: why not signal's wrappers)
import contextlib
import signal
import threading
from collections.abc import Iterator

_depth = 0  # nested blocks on the main thread
_caught: list[tuple[int, object]] = []  # (signum, frame) noted while deferred


def _note(signum: int, frame: object) -> None:
    _caught.append((signum, frame))


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Runs the block with SIGINT noted instead of raised; delivered when the block ends (see
    the module Note)."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    previous = _signal.getsignal(signal.SIGINT)
    if not callable(previous):
        yield
        return
    _signal.signal(signal.SIGINT, _note)
    _depth = 1
    try:
        yield
    finally:
        _depth = 0
        _signal.signal(signal.SIGINT, previous)
        if _caught:
            signum, frame = _caught[0]
            _caught.clear()
            previous(signum, frame)  # the default handler raises KeyboardInterrupt here
