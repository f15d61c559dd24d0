"""Where a shard's data is: the tier enum, the shard state enum and its table of legal transitions.

Note: inclusive hierarchy
    A shard has one *home* (the tier that always holds a valid copy once nothing newer exists)
    and at most one cached copy on each tier above it. The hierarchy is inclusive: an NVMe-homed
    shard that has a device copy also holds a host buffer under it. That costs one host buffer per
    device-cached NVMe shard, but it makes the state a single value on one line
    (``NVME -> TO_HOST -> HOST -> TO_DEVICE -> DEVICE``), a dirty device copy always has a host
    buffer to flush into, and evicting never has to re-read a copy from two tiers down.

    ``FLUSHING`` and ``WRITING_BACK`` are the two halves of a write-back: device -> host (a copy
    on the device-to-host stream) and host -> NVMe (an IO). During either, the source copy stays
    valid and readable; a fetch that hands the data to a caller (who may modify it) first waits for
    the write-back to finish (see ``store.py``).
"""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    """A place a shard's bytes can live; larger = closer to compute."""

    NVME = 0
    """Files on local disks (``NvmeStore``); reached only through a host buffer."""
    HOST = 1
    """Host memory: a ``BufferPool`` buffer (cached copies) or a host tensor (host-homed shards)."""
    DEVICE = 2
    """The compute device (``cuda:N`` or ``cpu``); cached copies live in reusable device slabs."""


class ShardState(enum.Enum):
    """Where a shard's newest data is, and what (if anything) is in flight."""

    NVME = "nvme"
    """Only the NVMe home holds the data (no host buffer, no device slab)."""
    TO_HOST = "to_host"
    """A read NVMe -> host buffer is in flight; the buffer is not readable yet."""
    HOST = "host"
    """A valid host copy (pool buffer, or the home tensor of a host-homed shard); no device copy."""
    TO_DEVICE = "to_device"
    """A host -> device copy is in flight; the host copy is valid, the device slab is not yet."""
    DEVICE = "device"
    """A valid device copy (and, for NVMe/host homes, a host copy under it)."""
    FLUSHING = "flushing"
    """A dirty device copy is being copied device -> host; both copies stay allocated."""
    WRITING_BACK = "writing_back"
    """A dirty host copy is being written host -> NVMe; it stays valid and allocated."""


#: Every legal ``(from, to)`` move. Anything else is a bug in the store and raises at once.
LEGAL_TRANSITIONS: dict[ShardState, frozenset[ShardState]] = {
    # fetch to host (read), or take a buffer without reading (fetch(..., read=False))
    ShardState.NVME: frozenset({ShardState.TO_HOST, ShardState.HOST}),
    # loaded, or the read failed (the buffer goes back; the next fetch retries)
    ShardState.TO_HOST: frozenset({ShardState.HOST, ShardState.NVME}),
    # copy up, take a slab without copying (read=False), drop the host buffer, or flush it home
    ShardState.HOST: frozenset(
        {ShardState.TO_DEVICE, ShardState.DEVICE, ShardState.NVME, ShardState.WRITING_BACK}
    ),
    ShardState.TO_DEVICE: frozenset({ShardState.DEVICE}),
    # drop the device copy, or flush a dirty one down
    ShardState.DEVICE: frozenset({ShardState.HOST, ShardState.FLUSHING}),
    # host-homed shards are done after the device -> host copy; NVMe-homed ones go on to disk
    # (and back to DEVICE, still dirty, when the disk write is refused)
    ShardState.FLUSHING: frozenset({ShardState.DEVICE, ShardState.WRITING_BACK}),
    # back to whatever copy sits on top (a device copy survives a write-back); on failure the
    # same, with the copy still dirty
    ShardState.WRITING_BACK: frozenset({ShardState.HOST, ShardState.DEVICE}),
}

#: States in which a transfer is in flight (the shard's ``pending`` record is set).
IN_FLIGHT: frozenset[ShardState] = frozenset(
    {ShardState.TO_HOST, ShardState.TO_DEVICE, ShardState.FLUSHING, ShardState.WRITING_BACK}
)


class IllegalTransition(RuntimeError):
    """A shard was asked to move between two states the table does not connect."""


def check_transition(key: str, old: ShardState, new: ShardState) -> None:
    """Raise :class:`IllegalTransition` unless ``old -> new`` is in :data:`LEGAL_TRANSITIONS`."""
    if new not in LEGAL_TRANSITIONS[old]:
        allowed = ", ".join(sorted(s.name for s in LEGAL_TRANSITIONS[old]))
        raise IllegalTransition(
            f"shard {key!r}: illegal transition {old.name} -> {new.name} (from {old.name} only "
            f"{allowed} are allowed)"
        )


def base_state(home: Tier) -> ShardState:
    """The state of a shard resting at ``home`` with no cached copy above it."""
    return {Tier.NVME: ShardState.NVME, Tier.HOST: ShardState.HOST, Tier.DEVICE: ShardState.DEVICE}[
        home
    ]
