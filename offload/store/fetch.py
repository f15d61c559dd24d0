"""``Fetch``: the future a ``TieredStore.fetch`` returns; waiting on it is the only way in."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from offload.store.shard import Shard
from offload.store.state import Tier

if TYPE_CHECKING:  # pragma: no cover
    from offload.store.store import TieredStore


class Fetch:
    """A future for one ``fetch``: ``wait()`` is the only way to reach the data."""

    __slots__ = ("_store", "_shard", "tier", "_read")

    def __init__(self, store: TieredStore, shard: Shard, tier: Tier, read: bool) -> None:
        self._store = store
        self._shard = shard
        self.tier = tier
        self._read = read

    @property
    def key(self) -> str:
        return self._shard.key

    def wait(self) -> torch.Tensor:
        """Block until resident at ``tier``; returns exactly ``numel`` elements of ``dtype``."""
        return self._store._wait(self._shard, self.tier, self._read)

    def done(self) -> bool:
        """Whether ``wait()`` would return without blocking on a transfer."""
        return self._store._try(self._shard, self.tier, self._read)

    def __repr__(self) -> str:
        return f"Fetch({self.key!r}, {self.tier.name}, state={self._shard.state.name})"
