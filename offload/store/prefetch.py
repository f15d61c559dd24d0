"""The access trace: record the order of uses in one iteration, replay it with a lookahead.

Note: record, replay, re-record
    The first iteration records every ``use`` as an item (for the store: ``(key, tier)``). From
    the next iteration on, each ``use`` is matched against the recorded trace; while it matches,
    the prefetcher returns the next ``depth`` items of the trace (wrapping into the next
    iteration), which the store fetches ahead, and it reports a *position* that the eviction
    planner uses to compute next-use distances.

    When a ``use`` does not match (a conditional branch, eval instead of train), the iteration
    stops replaying and records from scratch; at ``end_iteration`` the new order replaces the old
    one and ``rerecords`` is incremented. That is all: one ``logger.debug`` line, no warning, no
    exception. An iteration without a single ``use`` keeps the old trace.

Note: what a lookahead costs in reads
    Where the pool is smaller than what an iteration uses, the pieces fetched ahead hold
    buffers that would otherwise cache copies, so a read-ahead reads about what a pool smaller
    by the buffers it holds ahead reads without one (how many it holds: ``depth`` units at
    most, bounded by what the pool lends it, ``offload.plan.placement``'s Note on reading
    ahead). On ``tests/test_traffic.py``'s stack (units of 8 pieces, bf16, the update in the
    backward), the param store read, a step, with no read-ahead 1.91 B/param in 16 buffers,
    2.00 in 15 and 2.09 in 14; at depth 1 or 2, 2.09 in 16, and at depth 2, 2.00 in 17 and 1.91
    in 18: two buffers' worth. fp32: no read-ahead 5.99 in 6 buffers and 5.62 in 8; at depth 2,
    6.17 in 8 and 5.62 in 10 (at depth 1, 5.62 in 8). No piece was read twice before its use.
    So the read-ahead's extra reads are the price of reading while the compute runs, not
    wasted reads, and that many more buffers take them back (2026-12-06, scratch counts over
    ``_param_reads_a_step``'s steps 3-4; the fp32 8 / 10 and bf16 16 / 18 pairs are
    ``test_what_the_read_ahead_reads_more_two_more_buffers_take_back`` there).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from offload.store.planner import NextUse

logger = logging.getLogger("offload.store.prefetch")


class TracePrefetcher:
    """Records one iteration's access order and replays it with a lookahead of ``depth`` items."""

    def __init__(self, depth: int) -> None:
        if not isinstance(depth, int) or depth < 0:
            raise ValueError(f"prefetch depth must be an integer >= 0, got {depth!r}")
        self.depth = depth
        self.rerecords = 0
        """Times a recorded trace was replaced because the order changed."""
        self._trace: tuple[Hashable, ...] = ()
        self._index: NextUse | None = None
        self._current: list[Hashable] = []
        self._position = 0
        self._replaying = False
        self._in_iteration = False

    @property
    def trace(self) -> tuple[Hashable, ...]:
        """The recorded order (empty before the first iteration ends)."""
        return self._trace

    @property
    def replaying(self) -> bool:
        """Whether the uses so far in this iteration followed the recorded trace."""
        return self._replaying

    def position(self) -> int | None:
        """Index in the trace of the next expected use, or ``None`` when not replaying."""
        return self._position if self._replaying else None

    def distance(self, item: Hashable) -> float | None:
        """Uses until ``item`` is needed again, or ``None`` when the future is unknown.

        Counted from the access just recorded (distance 0): its shard is about to be fetched,
        so it must look as near as possible, not a whole iteration away.
        """
        if not self._replaying or self._index is None:
            return None
        return self._index.distance(item, max(self._position - 1, 0))

    def begin_iteration(self) -> None:
        """Start an iteration: replay the trace if one exists, else record."""
        self._current = []
        self._position = 0
        self._replaying = bool(self._trace)
        self._in_iteration = True

    def end_iteration(self) -> list[Hashable]:
        """Finish an iteration; returns the head of the trace (the next iteration's first items).

        If the order differed from the recorded trace, the new order replaces it (counted in
        ``rerecords``).
        """
        if not self._in_iteration:
            self.begin_iteration()
        self._in_iteration = False
        if self._current:
            current = tuple(self._current)
            if not self._trace:
                self._install(current)
            elif current != self._trace:
                self.rerecords += 1
                logger.debug(
                    "offload::prefetch re-record %d: trace of %d uses replaced by %d uses",
                    self.rerecords,
                    len(self._trace),
                    len(current),
                )
                self._install(current)
        self._current = []
        self._position = 0
        self._replaying = bool(self._trace)
        return list(self._trace[: self.depth])

    def use(self, item: Hashable) -> list[Hashable]:
        """Record ``item`` as the next access; returns the items to have in flight now.

        While replaying, that is the ``depth`` items that follow in the trace (possibly wrapping
        into the next iteration); otherwise an empty list.
        """
        if not self._in_iteration:
            self.begin_iteration()
        self._current.append(item)
        if not self._replaying:
            return []
        n = len(self._trace)
        if self._position < n and self._trace[self._position] == item:
            self._position += 1
            return [self._trace[(self._position + i) % n] for i in range(min(self.depth, n))]
        logger.debug(
            "offload::prefetch trace diverged at use %d: expected %r, got %r",
            self._position,
            self._trace[self._position] if self._position < n else None,
            item,
        )
        self._replaying = False
        return []

    def _install(self, trace: tuple[Hashable, ...]) -> None:
        self._trace = trace
        self._index = NextUse(trace)
