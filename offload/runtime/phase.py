"""Where a training step is: the engine's state machine.

Transitions are explicit and checked: a hook or a call that finds the engine in a phase it does
not accept raises with what happened and what was expected, instead of silently corrupting state.

    IDLE --forward--> FORWARD --backward--> BACKWARD --end of backward--> IDLE
    IDLE --backward again over a retained graph--> BACKWARD
    IDLE --step()--> STEP --done--> IDLE
    FORWARD --forward (eval / no_grad / a second forward)--> FORWARD
    FORWARD --a backward inside the forward (torch.autograd.grad there)--> BACKWARD
              --its end--> FORWARD
    FORWARD --no forward of the micro-step can get a backward any more: each one ran under
              no_grad, raised, was stopped by Ctrl-C or had its graph let go (the last two seen
              at the caller's next call)--> IDLE
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    IDLE = "idle"
    """Between steps or micro-steps: no hooks in flight, grads (if any) are off the device."""
    FORWARD = "forward"
    """Inside one or more forwards: units are gathered as they run and released after."""
    BACKWARD = "backward"
    """Autograd is running: units are re-gathered, their grads streamed out as they complete."""
    STEP = "step"
    """The optimizer is updating master weights and moments and writing compute params back."""


# phase -> phases it may move to
LEGAL_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.FORWARD, Phase.BACKWARD, Phase.STEP, Phase.IDLE}),
    Phase.FORWARD: frozenset({Phase.FORWARD, Phase.BACKWARD, Phase.IDLE}),
    Phase.BACKWARD: frozenset({Phase.BACKWARD, Phase.IDLE, Phase.FORWARD}),
    Phase.STEP: frozenset({Phase.IDLE}),
}


class PhaseError(RuntimeError):
    """A call or hook arrived in a phase that does not allow it."""


class PhaseTracker:
    """Holds the current phase; :meth:`to` is the only way to change it, but for the return to
    IDLE in a ``finally`` (legal from every phase), which stores it: a call's start is where a
    second Ctrl-C lands while the first one unwinds, and CPython gives no way to hold it back
    there (``signal.signal`` runs a pending handler before it installs another)."""

    __slots__ = ("phase",)

    def __init__(self) -> None:
        self.phase = Phase.IDLE

    def to(self, new: Phase, why: str = "") -> None:
        if new not in LEGAL_TRANSITIONS[self.phase]:
            raise PhaseError(
                f"offload: cannot go from {self.phase.value} to {new.value}"
                + (f" ({why})" if why else "")
            )
        self.phase = new

    def expect(self, *allowed: Phase, what: str) -> None:
        if self.phase not in allowed:
            names = " or ".join(p.value for p in allowed)
            raise PhaseError(
                f"offload: {what} needs phase {names}, but the engine is in {self.phase.value}"
            )
