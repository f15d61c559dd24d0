"""The background optimizer step: one worker thread running ``OptimState.step_units`` while the
training loop goes on (see ``offload.engine.engine``, Notes: the background NVMe step, and the
step in backward). The engine decides when it starts and what waits for it; this holds the
thread, the per-unit completion events and the error to re-raise.
"""

from __future__ import annotations

import threading
import time

from offload.engine.optstate import Hyper, OptimState, UnitFeed
from offload.engine.params import ParamHome
from offload.engine.units import Unit


class BackgroundStep:
    """At most one update in flight; ``timers`` is the engine's per-step seconds."""

    def __init__(self, timers: dict[str, float]) -> None:
        self.timers = timers
        self.feed: UnitFeed | None = None  # the step in backward being fed, until it is closed
        self._thread: threading.Thread | None = None
        self._unit_done: dict[int, threading.Event] = {}
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def failed(self) -> bool:
        return self._error is not None

    def start(
        self,
        optim: OptimState,
        params: ParamHome,
        units: list[Unit],
        hyper: Hyper,
        feed: UnitFeed | None = None,
    ) -> None:
        """Updates ``units`` in their order, or as ``feed`` hands them in."""
        order = [u for u in units if optim.pieces(u)]
        self._unit_done = {u.index: threading.Event() for u in order}
        self._error = None
        self.feed = feed

        def run() -> None:
            t0 = time.perf_counter()
            try:
                optim.step_units(
                    order if feed is None else feed,
                    params,
                    hyper,
                    on_unit_done=lambda u: self._unit_done[u.index].set(),
                )
            except BaseException as exc:  # re-raised by the main thread when it waits
                self._error = exc
            finally:
                # counted in the step whose forward it overlaps (joined before that step ends)
                self.timers["optimizer_seconds"] += time.perf_counter() - t0
                for event in self._unit_done.values():
                    event.set()

        self._thread = threading.Thread(target=run, name="offload-step", daemon=True)
        self._thread.start()

    def wait_unit(self, unit: Unit) -> None:
        """Blocks until ``unit``'s update (if any) is complete; re-raises a failure."""
        if self._thread is None:
            return
        event = self._unit_done.get(unit.index)
        if event is not None and not event.is_set():
            t0 = time.perf_counter()
            event.wait()
            self.timers["step_wait_seconds"] += time.perf_counter() - t0
        if self._error is not None:
            self.join()

    def join(self) -> None:
        """Waits for the update to finish; re-raises its error. A step in backward still being
        fed (a backward that failed or was interrupted) gets no more units: it ends after those
        it has, so teardown never waits on a backward that will not come."""
        if self.feed is not None:
            self.feed.close()
            self.feed = None
        if self._thread is None:
            return
        t0 = time.perf_counter()
        self._thread.join()
        self.timers["step_wait_seconds"] += time.perf_counter() - t0
        self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise RuntimeError(f"offload: the background optimizer step failed: {err}") from err
