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

Note: waits
    ``threading.Event.wait`` and ``threading.Condition.wait`` are Python code (CPython 3.11's
    ``threading.py``), and a Ctrl-C raised inside them breaks the primitive itself. Raised in
    ``Condition.__enter__`` right after it took the lock (an ``Event``'s wait enters its own
    Condition so), the lock stays held for good: whoever sets the event next blocks forever.
    Raised in ``Condition.wait`` before it took the lock back, the caller's ``with`` releases a
    lock it no longer holds (``RuntimeError: release unlocked lock``, or another thread's hold
    released under it). Measured with real signals (a scratch loop, 2026-12-07), 3000 SIGINTs
    into ``Event().wait(0)``: 277 left the event's lock held, 413 raised that RuntimeError;
    ``tests/test_interrupts.py``'s ``..._leaves_the_primitive_whole`` is the rerunnable form
    (100 a kind; with the plain waits, 8 locks held and 16 RuntimeErrors). That was
    the demo's hang after Ctrl-C: its forward waited for a unit's update (``Event.wait``), the
    Ctrl-C left the event's lock held, the update's thread blocked setting it, and closing the
    engine joined that thread forever (found with an injector that raises KeyboardInterrupt at
    the points where CPython delivers a signal, in offload's and ``threading``'s frames).

    So offload's blocking waits go through :func:`wait`: the primitive's wait runs with SIGINT
    deferred, in slices of :data:`SLICE_S`, and a Ctrl-C is raised between slices, where the
    caller's state is whole (a Condition's lock held again, inside the caller's ``with``): the
    wait ends within a slice of the Ctrl-C. On other threads (nothing to defer there) the
    slices bound what a wake-up lost to a notify broken by a Ctrl-C on the main thread costs.

    A Condition's wait returns to its caller after each slice, which looks at its predicate
    again (each caller waits in a ``while`` on it). Waiting slice after slice inside
    :func:`wait` instead (its first form, 2026-12-07) lost wake-ups: a notify
    that comes as a slice times out goes to the waiter that is giving up (``Condition.wait``
    returns False, the notify spent), and the next slice waited for another that never
    came, with the predicate true. The update then waited for a unit already in its feed and
    the backward for the update to take a held gradient piece: a training deadlock, 3 of 4
    processes within 17-27 wraps of 4 steps each with the two cores contended (a scratch
    loop; ``tests/test_interrupts.py``'s ``..._in_contended_processes_never_deadlocks``,
    heavy, is its rerunnable form, red in 131 s before the fix, and
    ``..._returns_to_its_caller`` the deterministic one).
    An Event's wait looks at its flag at each slice's start, so it loses nothing and loops
    here to its timeout.
"""

from __future__ import annotations

import _signal  # (the Note: why not signal's wrappers)
import contextlib
import signal
import threading
import time
from collections.abc import Iterator

SLICE_S = 0.05
"""Seconds :func:`wait` blocks at a time (Note: waits): what a Ctrl-C waits for at most."""

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


def wait(waitable: threading.Event | threading.Condition, timeout: float | None = None) -> bool:
    """``waitable.wait(timeout)`` that a Ctrl-C cannot break (Note: waits): an Event, or a
    Condition whose lock the caller holds (as for its own ``wait``). An Event: True once set,
    False after ``timeout`` seconds (None: no limit). A Condition: True once notified, False
    after one slice at most, so the caller looks at its predicate again (Note: waits)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = SLICE_S if deadline is None else max(0.0, min(SLICE_S, deadline - time.monotonic()))
        with interrupts_deferred():
            if waitable.wait(left):
                return True
        if isinstance(waitable, threading.Condition):
            return False
        if deadline is not None and time.monotonic() >= deadline:
            return False


def map_in_threads(fn, jobs: list, workers: int, name: str) -> list:
    """``[fn(job, stop) for job in jobs]`` on ``workers`` threads, the results in the jobs'
    order; ``stop`` is an Event each job looks at between its pieces of work. A Ctrl-C (or a
    job's error, raised here) sets it, and comes out once every thread has ended: within a
    piece. ``concurrent.futures.ThreadPoolExecutor`` ran every queued job at its exit first
    (a Ctrl-C while a checkpoint was verified waited for the whole verification), and a Ctrl-C
    inside its ``submit`` could leave a lock of its own held, its exit waiting for good
    (``tests/_ctrl_c_points.py``, PHASE load, 2026-12-07: a semaphore's Condition entered).
    Here the main thread only waits through :func:`wait`."""
    results: list = [None] * len(jobs)
    if not jobs:
        return results
    errors: list[BaseException] = []
    stop, done, lock = threading.Event(), threading.Event(), threading.Lock()
    order = iter(range(len(jobs)))
    count = max(1, min(workers, len(jobs)))
    left = [count]  # threads not ended (one never started counts as ended)

    def ended() -> None:
        with lock:
            left[0] -= 1
            if left[0] <= 0:
                done.set()

    def work() -> None:
        try:
            while not stop.is_set():
                with lock:
                    i = next(order, None)
                if i is None:
                    return
                results[i] = fn(jobs[i], stop)
        except BaseException as exc:  # noqa: BLE001 - raised on the main thread
            errors.append(exc)
            stop.set()
        finally:
            ended()

    threads = [threading.Thread(target=work, name=f"{name}-{k}", daemon=True) for k in range(count)]
    try:
        with interrupts_deferred():  # Thread.start waits on an Event (Note: waits)
            for t in threads:
                t.start()
        wait(done)
    except BaseException:
        stop.set()
        with interrupts_deferred():  # (a second Ctrl-C waits for the threads' pieces)
            for t in threads:
                if t.ident is None:  # never started
                    ended()
            wait(done)
        raise
    if errors:
        raise errors[0]
    return results
