"""The runtime of a wrapped model: hooks, phases, the per-unit gather / release / backward
countdown, the gradient path, the step schedules and the values in and out of the homes.

Owns: what changes while training runs (the phase, each unit's countdown, the step count, the
per-step timers and telemetry). It owns no state bytes: those are the homes'
(``offload.homes``); it decides when they move, never where they live (``offload.plan``).
"""

from offload.runtime.phase import Phase, PhaseError
from offload.runtime.state import Runtime

__all__ = ["Phase", "PhaseError", "Runtime"]
