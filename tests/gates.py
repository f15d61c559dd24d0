"""An IO handle held until the test opens a gate: a read or write that stays in flight."""

from __future__ import annotations

import threading


class Gated:
    """Wraps an ``IOHandle``: not done, and ``wait`` blocks, until ``gate`` is set."""

    def __init__(self, handle, gate: threading.Event) -> None:
        self.handle, self.gate = handle, gate

    def done(self) -> bool:
        return self.gate.is_set() and self.handle.done()

    def wait(self):
        self.gate.wait()
        return self.handle.wait()
