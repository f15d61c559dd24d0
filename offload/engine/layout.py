"""Flat layout of one unit's parameters, and its split into pieces.

Note: one flat buffer per state kind
    Each unit's parameters are laid out back to back in one flat buffer per state kind (compute
    params, fp32 master, grads, exp_avg, exp_avg_sq), so a unit moves as a few large sequential
    transfers and the CPU Adam runs over one contiguous range. Trainable parameters come first,
    frozen ones after: the optimizer's buffers cover only the trainable prefix ``[0, trainable)``
    and every state kind uses the same element offsets, so an update of elements ``[a, b)`` of
    the master writes elements ``[a, b)`` of the compute params.

    Each parameter starts at a multiple of ``ALIGN`` elements (SIMD-friendly), and both the
    trainable prefix and the whole buffer are padded to ``PAGE`` bytes' worth of elements so
    that every piece is an O_DIRECT-sized transfer. Padding is zero and never read back into
    a parameter.

Note: pieces
    A unit bigger than one swap buffer is streamed through the buffers in pieces of
    ``piece_numel`` elements (a multiple of 1024, so 4096 bytes of fp32). Piece ``j`` covers
    elements ``[j * piece_numel, min((j + 1) * piece_numel, end))`` of every state kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 16  # elements; a parameter's offset is a multiple of this
PAGE_ELEMS = 2048  # padding granule in elements (4096 bytes of bf16, 8192 of fp32)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True, slots=True)
class Segment:
    """Where one parameter lives inside its unit's flat buffers."""

    param: torch.nn.Parameter
    name: str  # qualified name in the model (first one, for tied weights)
    offset: int  # elements
    numel: int
    shape: torch.Size
    trainable: bool

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True, slots=True)
class FlatLayout:
    segments: tuple[Segment, ...]
    trainable: int  # padded element count of the trainable prefix
    total: int  # padded element count of the whole buffer

    @staticmethod
    def build(named_params: list[tuple[str, torch.nn.Parameter]]) -> FlatLayout:
        segs: list[Segment] = []
        offset = 0
        train = [(n, p) for n, p in named_params if p.requires_grad]
        frozen = [(n, p) for n, p in named_params if not p.requires_grad]
        for name, p in train:
            segs.append(Segment(p, name, offset, p.numel(), p.shape, True))
            offset = _round_up(offset + p.numel(), ALIGN)
        trainable = _round_up(offset, PAGE_ELEMS) if train else 0
        offset = trainable
        for name, p in frozen:
            segs.append(Segment(p, name, offset, p.numel(), p.shape, False))
            offset = _round_up(offset + p.numel(), ALIGN)
        total = _round_up(offset, PAGE_ELEMS)
        return FlatLayout(tuple(segs), trainable, total)

    def pieces(self, piece_numel: int, end: int | None = None) -> list[tuple[int, int]]:
        """``[(begin, end), ...]`` covering ``[0, end)`` (default: the whole buffer)."""
        end = self.total if end is None else end
        return [(b, min(b + piece_numel, end)) for b in range(0, end, piece_numel)]

    def overlaps(self, begin: int, end: int, trainable_only: bool = False):
        """Yields ``(segment, seg_lo, seg_hi)``: the part ``[seg_lo, seg_hi)`` of each segment
        (in the segment's own element coordinates) that falls inside ``[begin, end)``."""
        for s in self.segments:
            if trainable_only and not s.trainable:
                continue
            lo, hi = max(begin, s.offset), min(end, s.end)
            if lo < hi:
                yield s, lo - s.offset, hi - s.offset
