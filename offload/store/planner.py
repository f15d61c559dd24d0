"""Eviction planning: which cached copy to give up when a budget is full. Torch-free.

Note: farthest next use
    Once the first iteration has been recorded the store knows the future: later iterations
    replay the same sequence of accesses. Evicting the copy whose next use is farthest away is
    then optimal for the number of reloads (Belady's MIN). Before a trace exists, or while the
    current iteration has left the recorded order, the planner falls back to least recently used.
    Ties (e.g. two copies never used again) go to the least recently used, then to the smaller
    key, so runs are reproducible.

    The trace is treated as cyclic: after its last access comes its first one again (the next
    iteration). A position is an index into the trace: the index of the access about to happen.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T", bound=Hashable)

NEVER = math.inf
"""Distance of an item that does not occur in the trace at all."""


class NextUse:
    """Index over a recorded (cyclic) trace answering "how far until ``item`` is used again?"."""

    __slots__ = ("_length", "_positions")

    def __init__(self, trace: Sequence[Hashable]) -> None:
        self._length = len(trace)
        self._positions: dict[Hashable, list[int]] = {}
        for index, item in enumerate(trace):
            self._positions.setdefault(item, []).append(index)

    def __len__(self) -> int:
        return self._length

    def distance(self, item: Hashable, position: int) -> float:
        """Accesses from ``position`` (inclusive) until the next use of ``item``, wrapping around.

        0 means ``item`` is the access at ``position``; :data:`NEVER` when it is not in the trace.
        """
        positions = self._positions.get(item)
        if not positions:
            return NEVER
        position %= self._length
        at = bisect.bisect_left(positions, position)
        if at < len(positions):
            return positions[at] - position
        return positions[0] + self._length - position


def choose_victim(
    candidates: Iterable[T],
    *,
    next_use: Callable[[T], float] | None,
    last_used: Callable[[T], int],
    farther_than: float | None = None,
) -> T | None:
    """The candidate to evict, or ``None`` when there is none (see the module ``Note``).

    Args:
        candidates: evictable items (released, clean, nothing in flight).
        next_use: distance to each item's next use; ``None`` = no trace, pick LRU.
        last_used: a logical clock value of each item's last use (smaller = older).
        farther_than: only items whose next use is strictly farther than this (a prefetch may
            only displace data needed later than what it brings in); requires ``next_use``.
    """
    best: T | None = None
    best_rank: tuple[float, int] | None = None
    for item in candidates:
        distance = next_use(item) if next_use is not None else 0.0
        if farther_than is not None and not distance > farther_than:
            continue
        rank = (distance, -last_used(item))
        if best_rank is None or rank > best_rank or (rank == best_rank and str(item) < str(best)):
            best, best_rank = item, rank
    return best
