"""``Fetch``: the future a ``TieredStore.fetch`` returns; waiting on it is the only way in."""

from __future__ import annotations

from typing import Protocol

import torch

from offload.store.shard import Shard
from offload.store.state import Tier


class Driver(Protocol):
    """The store's side of a fetch (``TieredStore``)."""

    def drive(self, shard: Shard, read: bool, blocking: bool, readonly: bool = False) -> bool:
        """Takes every step toward a usable host copy; True once there."""

    def view(self, shard: Shard) -> torch.Tensor:
        """The shard's host copy, once usable (raises after the fetch was released)."""


class Fetch:
    """A future for one ``fetch``: ``wait()`` is the only way to reach the data."""

    __slots__ = ("_driver", "_shard", "_read", "_readonly")

    tier = Tier.HOST

    def __init__(self, driver: Driver, shard: Shard, read: bool, readonly: bool = False) -> None:
        self._driver = driver
        self._shard = shard
        self._read = read
        self._readonly = readonly

    @property
    def key(self) -> str:
        return self._shard.key

    def wait(self) -> torch.Tensor:
        """Block until resident in host memory; returns exactly ``numel`` elements of ``dtype``."""
        self._driver.drive(self._shard, self._read, blocking=True, readonly=self._readonly)
        return self._driver.view(self._shard)

    def done(self) -> bool:
        """Whether ``wait()`` would return without blocking on a transfer."""
        return self._driver.drive(self._shard, self._read, blocking=False, readonly=self._readonly)

    def __repr__(self) -> str:
        return f"Fetch({self.key!r}, state={self._shard.state.name})"
