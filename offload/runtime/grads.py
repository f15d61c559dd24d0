"""Gradients from autograd to their owner: the one place a unit's gradients pass through when its
backward ends (where a reduce-scatter across ranks goes).

The owner (``offload.homes.grads``) is the plan's choice; this takes a unit's device gradients
through the device's staging (``offload.device.GradStaging``) and hands them over, tracking
the first micro-step after ``zero_grad`` (whose gradients overwrite instead of adding).
"""

from __future__ import annotations

import torch

from offload.device import GradStaging
from offload.homes.grads import GradHome
from offload.plan import Unit


class Grads:
    def __init__(self, owner: GradHome, staging: GradStaging, units: list[Unit]) -> None:
        self.owner, self.staging, self.units = owner, staging, units
        self.first_micro_step = True  # the next gradients overwrite instead of adding

    def unit_done(self, unit: Unit) -> None:
        """``unit``'s gradients of this backward are final: its owner takes them."""
        with torch.profiler.record_function("offload::grads"):
            self.owner.absorb(unit, lambda: self.staging.host_parts(unit), self.first_micro_step)

    def backward_done(self) -> None:
        self.first_micro_step = False

    def stats(self) -> tuple[bool, float]:
        """(any inf/NaN, sum of squares) of the accumulated gradients (still loss-scaled)."""
        return self.owner.stats()

    def zero(self) -> None:
        self.first_micro_step = True
        for unit in self.units:
            for p in unit.trainable_params:
                p.grad = None
