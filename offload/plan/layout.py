"""Flat layout of one unit's parameters, its split into pieces, and each rank's share of it.

Note: one flat buffer per state kind
    Each unit's parameters are laid out back to back in one flat buffer per state kind (compute
    params, fp32 master, grads, exp_avg, exp_avg_sq), so a unit moves as a few large sequential
    transfers and the CPU Adam runs over one contiguous range. Trainable parameters come first,
    frozen ones after: the optimizer's buffers cover only the trainable prefix ``[0, trainable)``
    and every state kind uses the same element offsets, so an update of elements ``[a, b)`` of
    the master writes elements ``[a, b)`` of the compute params.

    Each parameter starts at a multiple of ``ALIGN`` elements (SIMD-friendly), and both the
    trainable prefix and the whole buffer are padded to ``world x PAGE_ELEMS`` elements so that
    every rank's share starts on a page and every piece is an O_DIRECT-sized transfer. Padding
    is zero and never read back into a parameter.

Note: shards (``ShardSpec``)
    With ``world`` ranks, rank ``r`` owns the ``r``-th of ``world`` equal parts of the trainable
    prefix and, separately, of the frozen suffix (so every rank steps the same number of
    elements). A rank keeps the state it owns; the rest of a unit is gathered from the others
    when the unit is used. With one rank (today) the share is the whole buffer.

Note: pieces
    A share bigger than one swap buffer is streamed through the buffers in pieces of at most
    ``piece_numel`` elements (a multiple of ``PAGE_ELEMS``). Pieces never straddle the end of
    the trainable prefix, so the optimizer can overwrite a trainable piece of the compute params
    without reading it. Piece ``j`` of a region ``[b, e)`` covers
    ``[b + j * piece_numel, min(b + (j + 1) * piece_numel, e))`` of every state kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

ALIGN = 16  # elements; a parameter's offset is a multiple of this
PAGE_ELEMS = 2048  # padding granule in elements (4096 bytes of bf16, 8192 of fp32)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Which of ``world`` equal shares of every flat buffer this rank owns."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.world, int) and self.world >= 1):
            raise ValueError(f"ShardSpec: world={self.world!r}; allowed: an int >= 1")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world):
            raise ValueError(f"ShardSpec: rank={self.rank!r}; allowed: 0 <= rank < {self.world}")

    @property
    def granule(self) -> int:
        """Elements a region is padded to, so that each share is whole pages."""
        return PAGE_ELEMS * self.world

    def share(self, begin: int, end: int) -> tuple[int, int]:
        """This rank's part of the region ``[begin, end)`` (its length a multiple of world)."""
        n = (end - begin) // self.world
        return begin + self.rank * n, begin + (self.rank + 1) * n


@dataclass(frozen=True, slots=True)
class Segment:
    """Where one parameter lives inside its unit's flat buffers."""

    param: torch.nn.Parameter
    name: str  # qualified name in the model (first one, for tied weights)
    offset: int  # elements
    numel: int
    shape: torch.Size
    trainable: bool
    dtype: torch.dtype  # the parameter's dtype before wrap (what state_dict and export give)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True, slots=True)
class FlatLayout:
    segments: tuple[Segment, ...]
    trainable: int  # padded element count of the trainable prefix
    total: int  # padded element count of the whole buffer
    shard: ShardSpec = ShardSpec()

    @staticmethod
    def build(
        named_params: list[tuple[str, torch.nn.Parameter]], shard: ShardSpec | None = None
    ) -> FlatLayout:
        shard = shard or ShardSpec()
        segs: list[Segment] = []
        offset = 0
        train = [(n, p) for n, p in named_params if p.requires_grad]
        frozen = [(n, p) for n, p in named_params if not p.requires_grad]
        for name, p in train:
            segs.append(Segment(p, name, offset, p.numel(), p.shape, True, p.dtype))
            offset = _round_up(offset + p.numel(), ALIGN)
        trainable = _round_up(offset, shard.granule) if train else 0
        offset = trainable
        for name, p in frozen:
            segs.append(Segment(p, name, offset, p.numel(), p.shape, False, p.dtype))
            offset = _round_up(offset + p.numel(), ALIGN)
        total = _round_up(offset, shard.granule)
        return FlatLayout(tuple(segs), trainable, total, shard)

    # -- this rank's share ------------------------------------------------------------------------
    @property
    def local_trainable(self) -> tuple[int, int]:
        """The range of the trainable prefix whose optimizer state this rank owns."""
        return self.shard.share(0, self.trainable)

    @property
    def local_frozen(self) -> tuple[int, int]:
        """This rank's range of the frozen suffix."""
        return self.shard.share(self.trainable, self.total)

    def pieces(self, piece_numel: int, end: int | None = None) -> list[tuple[int, int]]:
        """``[(begin, end), ...]`` covering ``[0, end)`` (default: the whole buffer)."""
        end = self.total if end is None else end
        return [(b, min(b + piece_numel, end)) for b in range(0, end, piece_numel)]

    # -- the one scatter/gather between flat ranges and parameters ---------------------------------
    def overlaps(self, begin: int, end: int, trainable_only: bool = False):
        """Yields ``(segment, seg_lo, seg_hi)``: the part ``[seg_lo, seg_hi)`` of each segment
        (in the segment's own element coordinates) that falls inside ``[begin, end)``."""
        for s in self.segments:
            if trainable_only and not s.trainable:
                continue
            lo, hi = max(begin, s.offset), min(end, s.end)
            if lo < hi:
                yield s, lo - s.offset, hi - s.offset

    def pairs(
        self,
        lo: int,
        hi: int,
        flat: torch.Tensor,
        view_of: Callable[[Segment], torch.Tensor | None],
        trainable_only: bool = False,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter-side slice, flat slice)`` for every part of ``[lo, hi)`` covered by a
        parameter, where ``flat`` holds elements ``[lo, hi)`` and ``view_of(segment)`` is that
        parameter's flat (1-D) tensor on the other side (None: skip it). Every move between a
        unit's flat pieces and its parameters, in either direction, is a loop over these."""
        for seg, a, b in self.overlaps(lo, hi, trainable_only):
            view = view_of(seg)
            if view is not None:
                yield view[a:b], flat[seg.offset + a - lo : seg.offset + b - lo]
