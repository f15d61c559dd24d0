"""The plan of a wrapped model: its units, their layouts and pieces, and the placement."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from offload.config import OffloadConfig
from offload.plan.layout import ShardSpec
from offload.plan.placement import Placement, make_placement, resolve_device
from offload.plan.units import Unit, build_units


def split(begin: int, end: int, piece: int) -> list[tuple[int, int]]:
    """``[begin, end)`` in consecutive ranges of at most ``piece`` elements."""
    return [(b, min(b + piece, end)) for b in range(begin, end, piece)]


@dataclass(frozen=True, slots=True)
class Plan:
    units: list[Unit]
    """``units[0]`` is the root."""
    placement: Placement
    shard: ShardSpec

    def trainable_pieces(self, unit: Unit) -> list[tuple[int, int]]:
        """This rank's share of the unit's trainable prefix, in pieces (optimizer state and the
        compute params it writes use the same ranges)."""
        return split(*unit.layout.local_trainable, self.placement.piece_numel)

    def frozen_pieces(self, unit: Unit) -> list[tuple[int, int]]:
        """This rank's share of the frozen suffix, in pieces."""
        return split(*unit.layout.local_frozen, self.placement.piece_numel)

    def pieces(self, unit: Unit) -> list[tuple[int, int]]:
        """Every piece of this rank's share of the unit's compute params."""
        return self.trainable_pieces(unit) + self.frozen_pieces(unit)

    @property
    def largest_unit(self) -> int:
        """Elements of the largest unit's flat buffer (padded)."""
        return max(u.layout.total for u in self.units)


def make_plan(
    model: nn.Module,
    cfg: OffloadConfig,
    *,
    keep_grads: bool | None = None,
    shard: ShardSpec | None = None,
) -> Plan:
    """Units and placement of ``model`` under ``cfg`` (nothing is allocated or moved)."""
    shard = shard or ShardSpec()
    device = resolve_device(cfg.device)
    params_move = cfg.offload_param.device != "none"
    units = build_units(
        model,
        list(cfg.wrap.module_classes),
        cfg.wrap.min_params,
        persistence_threshold=cfg.offload_param.persistence_threshold if params_move else None,
        shard=shard,
    )
    largest = max(u.layout.total for u in units)
    placement = make_placement(cfg, device, largest_unit=largest, keep_grads=keep_grads)
    return Plan(units, placement, shard)
