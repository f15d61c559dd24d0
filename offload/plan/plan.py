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
    """Note: which ranges each home holds
    The optimizer state and the fp32 gradients always cover this rank's share of the
    trainable prefix (:meth:`trainable_pieces`). The param home holds :meth:`home_regions`:
    this rank's shares of the trainable prefix and the frozen suffix with stage 3 (or one
    rank), every rank's shares otherwise (stages 1 and 2 keep the whole unit on every
    rank). Its pieces (:meth:`pieces`) never straddle two ranks' shares, so the piece this
    rank's update writes is a piece of the home, and the same piece index of every rank's
    share has the same length (what the stage-1/2 all-gather of an NVMe home relies on).
    A home that packs its regions into one buffer finds element ``[lo, hi)`` at
    :meth:`home_slice`.
    """

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

    def home_regions(self, unit: Unit) -> list[tuple[int, int]]:
        """The element ranges the param home holds, in order (see the Note)."""
        layout = unit.layout
        if self.shard.world == 1 or self.placement.shard_params:  # (one rank: the same)
            regions = [layout.local_trainable, layout.local_frozen]
        else:
            every = [ShardSpec(r, self.shard.world) for r in range(self.shard.world)]
            regions = [s.share(0, layout.trainable) for s in every]
            regions += [s.share(layout.trainable, layout.total) for s in every]
        return [(a, b) for a, b in regions if b > a]

    def pieces(self, unit: Unit) -> list[tuple[int, int]]:
        """Every piece of the param home (see the Note)."""
        piece = self.placement.piece_numel
        return [p for a, b in self.home_regions(unit) for p in split(a, b, piece)]

    def home_numel(self, unit: Unit) -> int:
        """Elements the param home holds for ``unit``."""
        return sum(b - a for a, b in self.home_regions(unit))

    def home_slice(self, unit: Unit, lo: int, hi: int) -> slice:
        """Where elements ``[lo, hi)`` (inside one region) sit in a packed home buffer."""
        at = 0
        for a, b in self.home_regions(unit):
            if a <= lo and hi <= b:
                return slice(at + lo - a, at + hi - a)
            at += b - a
        raise IndexError(f"unit {unit.label}: [{lo}, {hi}) is not in this rank's param home")

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
    sharded: bool | None = None,
) -> Plan:
    """Units and placement of ``model`` under ``cfg`` (nothing is allocated or moved);
    ``sharded``: see ``make_placement``."""
    shard = shard or ShardSpec()
    sharded = shard.world > 1 if sharded is None else sharded
    device = resolve_device(cfg.device)
    stage = cfg.distributed.resolve_stage(cfg.offload_param.device)
    params_move = cfg.offload_param.device != "none" or (sharded and stage == 3)
    units = build_units(
        model,
        list(cfg.wrap.module_classes),
        cfg.wrap.min_params,
        persistence_threshold=cfg.offload_param.persistence_threshold if params_move else None,
        shard=shard,
    )
    if shard.world == 1:
        largest = max(u.layout.total for u in units)
    else:  # a piece never holds more than one rank's share of a region
        largest = max(
            max(b - a for a, b in (u.layout.local_trainable, u.layout.local_frozen)) for u in units
        )
    placement = make_placement(
        cfg,
        device,
        largest_unit=largest,
        keep_grads=keep_grads,
        world=shard.world,
        sharded=sharded,
        trains=any(u.layout.trainable for u in units),
    )
    return Plan(units, placement, shard)
