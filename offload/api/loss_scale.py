"""Dynamic loss scaling for fp16 (bf16 and fp32 need none).

The loss is multiplied by ``scale`` before backward; the optimizer divides the gradients by it
inside the Adam kernel (fused, no extra pass). A step whose gradients hold an inf/NaN is skipped
and the scale shrinks by ``backoff_factor``; after ``growth_interval`` clean steps in a row it
grows by ``growth_factor``.
"""

from __future__ import annotations


class DynamicLossScaler:
    def __init__(
        self,
        *,
        initial: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        min_scale: float,
    ) -> None:
        self.scale = float(initial)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0
        # overflows in a row with a scale that cannot back off (at min_scale, or a static one:
        # backoff_factor 1): no step trains (see OffloadOptimizer)
        self.overflows_at_min = 0

    def update(self, *, found_inf: bool) -> None:
        if found_inf:
            at_min = self.scale <= self.min_scale or self.backoff_factor >= 1  # (static)
            self.overflows_at_min = self.overflows_at_min + 1 if at_min else 0
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.overflows_at_min = 0
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
