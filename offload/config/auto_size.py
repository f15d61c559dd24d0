"""Sizing an ``"auto"`` swap buffer for a model: ``resolve_auto_buffer_size``.

Note: what "auto" becomes
    A pool buffer holds one piece of one unit's flat buffer at a time (see
    ``offload.plan.layout``'s Note on pieces). A buffer larger than the model's largest unit
    is never filled, so "auto" is::

        min(cap, max(round_up(largest_unit_bytes, 4096), aio.block_size))

    where ``cap`` is the field's value (``DEFAULT_BUFFER_SIZE``, 256 MiB, the former fixed
    default): never more than before, never below one IO request, and a multiple of 4096 (both
    ``cap`` and ``aio.block_size`` are). ``largest_unit_bytes`` is measured in the dtype the pool
    holds: fp32 (4 bytes per element) for ``offload_optimizer``, the compute dtype for
    ``offload_param``. With every unit padded to whole pages, a unit of that size is then one
    piece.

    Only ``wrap`` knows the units, so it calls this once per pool, before sizing the pieces and
    allocating the pools. Everything else that reads ``buffer_size`` as a number before that
    sees the cap, an upper bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from offload.config.sections import ALIGN
from offload.config.sizes import AutoSize, round_up

if TYPE_CHECKING:  # pragma: no cover
    from offload.config.offload_config import OffloadConfig

POOL_SECTIONS = ("offload_param", "offload_optimizer")
"""The config sections that own a swap buffer pool."""


def resolve_auto_buffer_size(section: str, cfg: OffloadConfig, largest_unit_bytes: int) -> int:
    """Bytes per buffer of the pool of ``cfg.<section>`` for a model (see the module Note).

    Args:
        section: ``"offload_param"`` or ``"offload_optimizer"``.
        cfg: the validated config.
        largest_unit_bytes: the largest unit's flat buffer in bytes, in the pool's dtype (fp32
            for ``offload_optimizer``, the compute dtype for ``offload_param``); >= 0.

    Returns:
        ``buffer_size`` as configured (a plain ``int``) when it is not "auto"; otherwise the size
        for this model: a multiple of 4096, at least one IO block, at most 256 MiB.

    Raises:
        ValueError: for an unknown section or a negative / non-integer ``largest_unit_bytes``
            (programming errors, not config errors).
    """
    if section not in POOL_SECTIONS:
        raise ValueError(f"section must be one of {', '.join(POOL_SECTIONS)}, got {section!r}")
    if isinstance(largest_unit_bytes, bool) or not isinstance(largest_unit_bytes, int):
        raise ValueError(f"largest_unit_bytes must be an int, got {largest_unit_bytes!r}")
    if largest_unit_bytes < 0:
        raise ValueError(f"largest_unit_bytes must be >= 0, got {largest_unit_bytes}")
    size = getattr(cfg, section).buffer_size
    if not isinstance(size, AutoSize):
        return int(size)
    need = round_up(largest_unit_bytes, ALIGN)
    return min(int(size), max(need, cfg.aio.block_size))
