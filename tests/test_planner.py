"""Eviction planning on plain numbers: farthest next use equals a brute-force optimum."""

from __future__ import annotations

import functools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from offload.store.planner import NEVER, NextUse, choose_victim


def test_next_use_distance_wraps_around_the_trace():
    index = NextUse(["a", "b", "a", "c"])
    assert index.distance("a", 0) == 0
    assert index.distance("a", 1) == 1
    assert index.distance("c", 0) == 3
    # after the last "a" the next one is in the next iteration
    assert index.distance("a", 3) == 1
    assert index.distance("b", 2) == 3
    assert index.distance("zzz", 0) == NEVER
    assert len(index) == 4


def test_choose_victim_is_farthest_then_lru():
    far = {"x": 5, "y": 9, "z": 9}
    last = {"x": 1, "y": 7, "z": 3}
    pick = choose_victim(far, next_use=far.__getitem__, last_used=last.__getitem__)
    assert pick == "z"  # y and z tie on distance; z was used longer ago
    assert choose_victim(far, next_use=None, last_used=last.__getitem__) == "x"  # LRU
    assert choose_victim([], next_use=None, last_used=last.__getitem__) is None


def test_farther_than_only_displaces_later_uses():
    far = {"x": 2, "y": 4}
    pick = choose_victim(far, next_use=far.__getitem__, last_used=lambda _: 0, farther_than=3)
    assert pick == "y"
    none = choose_victim(far, next_use=far.__getitem__, last_used=lambda _: 0, farther_than=4)
    assert none is None


def _misses_from(seq: tuple[int, ...], pos: int, cache: frozenset, capacity: int) -> int:
    """Fewest misses serving seq[pos:] from ``cache`` (exhaustive over every eviction choice)."""

    @functools.cache
    def best(pos: int, cache: frozenset) -> int:
        if pos == len(seq):
            return 0
        item = seq[pos]
        if item in cache:
            return best(pos + 1, cache)
        if len(cache) < capacity:
            return 1 + best(pos + 1, cache | {item})
        return 1 + min(best(pos + 1, (cache - {v}) | {item}) for v in cache)

    return best(pos, cache)


def _cost_after_evicting(seq, pos, cache, capacity, victim) -> int:
    """Misses from ``pos`` on (including this one) if ``victim`` is evicted to admit seq[pos]."""
    return 1 + _misses_from(seq, pos + 1, (cache - {victim}) | {seq[pos]}, capacity)


@settings(max_examples=60, deadline=None)
@given(
    seq=st.lists(st.integers(0, 5), min_size=1, max_size=12).map(tuple),
    capacity=st.integers(1, 3),
)
def test_farthest_next_use_matches_brute_force(seq, capacity):
    """Every eviction the planner makes is one an exhaustive search also finds optimal, and the
    total number of misses equals the brute-force minimum."""
    index = NextUse(seq)
    cache: frozenset = frozenset()
    last: dict[int, int] = {}
    misses = 0
    for pos, item in enumerate(seq):
        if item not in cache:
            misses += 1
            if len(cache) >= capacity:
                victim = choose_victim(
                    sorted(cache),
                    next_use=lambda v, p=pos: index.distance(v, p),
                    last_used=lambda v: last.get(v, -1),
                )
                cost = _cost_after_evicting(seq, pos, cache, capacity, victim)
                best = min(_cost_after_evicting(seq, pos, cache, capacity, v) for v in cache)
                assert cost == best, (seq, pos, sorted(cache), victim)
                cache = cache - {victim}
            cache = cache | {item}
        last[item] = pos
    assert misses == _misses_from(seq, 0, frozenset(), capacity)


def test_lru_can_be_worse_than_the_planner():
    """A cyclic scan larger than the cache: LRU misses every access, farthest-next-use does not."""
    seq = (0, 1, 2, 3) * 3
    capacity = 3
    index = NextUse(seq[:4])

    def run(use_trace: bool) -> int:
        cache: set[int] = set()
        last: dict[int, int] = {}
        misses = 0
        for pos, item in enumerate(seq):
            if item not in cache:
                misses += 1
                if len(cache) >= capacity:
                    victim = choose_victim(
                        sorted(cache),
                        next_use=(lambda v, p=pos: index.distance(v, p)) if use_trace else None,
                        last_used=lambda v: last[v],
                    )
                    cache.discard(victim)
                cache.add(item)
            last[item] = pos
        return misses

    assert run(use_trace=False) == len(seq)
    assert run(use_trace=True) < len(seq)
    assert run(use_trace=True) == _misses_from(seq, 0, frozenset(), capacity)
    assert math.isinf(NEVER)
