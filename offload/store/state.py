"""Where a shard's data is: the tier enum, the shard state enum and its table of legal transitions.

Note: two tiers
    A shard has one *home* (the tier that always holds a valid copy once nothing newer exists):
    NVMe (a file extent) or host memory (a tensor the store holds). An NVMe-homed shard may also
    have one cached copy in a host pool buffer; the state is a single value on one line
    (``NVME -> TO_HOST -> HOST``, and ``WRITING_BACK`` while a dirty copy goes home). Moves to
    and from the compute device are not the store's: the runtime makes them through
    ``offload.device`` out of the host copies the store hands out.

    During ``WRITING_BACK`` the host copy stays valid and readable; a fetch that hands the data
    to a caller who may modify it first waits for the write-back to finish, a ``readonly`` one
    does not (see ``store.py``, Note on coherence).
"""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    """A place a shard's bytes can live; larger = closer to compute."""

    NVME = 0
    """Files on local disks (``NvmeStore``); reached only through a host buffer."""
    HOST = 1
    """Host memory: a ``BufferPool`` buffer (cached copies) or a host tensor (host-homed shards)."""


class ShardState(enum.Enum):
    """Where a shard's newest data is, and what (if anything) is in flight."""

    NVME = "nvme"
    """Only the NVMe home holds the data (no host buffer)."""
    TO_HOST = "to_host"
    """A read NVMe -> host buffer is in flight; the buffer is not readable yet."""
    HOST = "host"
    """A valid host copy (pool buffer, or the home tensor of a host-homed shard)."""
    WRITING_BACK = "writing_back"
    """A dirty host copy is being written host -> NVMe; it stays valid and allocated."""


#: Every legal ``(from, to)`` move. Anything else is a bug in the store and raises at once.
LEGAL_TRANSITIONS: dict[ShardState, frozenset[ShardState]] = {
    # fetch to host (read), or take a buffer without reading (fetch(..., read=False))
    ShardState.NVME: frozenset({ShardState.TO_HOST, ShardState.HOST}),
    # loaded, or the read failed (the buffer goes back; the next fetch retries)
    ShardState.TO_HOST: frozenset({ShardState.HOST, ShardState.NVME}),
    # drop the host buffer, or write it home
    ShardState.HOST: frozenset({ShardState.NVME, ShardState.WRITING_BACK}),
    # written (or failed: the same, with the copy still dirty)
    ShardState.WRITING_BACK: frozenset({ShardState.HOST}),
}

#: States in which a transfer is in flight (the shard's ``pending`` record is set).
IN_FLIGHT: frozenset[ShardState] = frozenset({ShardState.TO_HOST, ShardState.WRITING_BACK})


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
    return ShardState.NVME if home is Tier.NVME else ShardState.HOST
