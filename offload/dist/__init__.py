"""Collectives across ranks: the only place offload talks to other processes.

Owns: the model's :class:`Comm` (a world-1 no-op, or ``torch.distributed`` with gloo or NCCL),
its asynchronous handles, its timeouts and its counters (bytes and seconds waited per kind of
collective). Everything is ``torch.distributed``; there is no transport of our own. What is
gathered or reduced, and when, is the runtime's and the homes' (``offload.plan`` decides the
stage).
"""

from __future__ import annotations

import logging
import os

from offload.dist.comm import (
    OPS,
    CollectiveError,
    Comm,
    Handle,
    LocalComm,
    TorchComm,
    completed,
)

logger = logging.getLogger("offload.api")

__all__ = [
    "OPS",
    "CollectiveError",
    "Comm",
    "Handle",
    "LocalComm",
    "TorchComm",
    "comm_for",
    "completed",
    "env_int",
    "init_process_group",
]


def env_int(name: str, default: int) -> int:
    """torchrun's ``RANK``, ``WORLD_SIZE`` or ``LOCAL_RANK`` as a number (``default`` where it
    is unset or empty); another value is an error naming the variable (it was a traceback of
    ``int()``)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"offload: the environment variable {name} is {os.environ[name]!r}; allowed: an "
            "integer >= 0 (torchrun sets it; unset it to run one process)"
        )
    return value


def init_process_group(*args, **kwargs) -> None:
    """``torch.distributed.init_process_group(*args, **kwargs)``, with ``torch.distributed.nn``
    imported first, so that no default argument of torch's holds the default group and
    ``destroy_process_group`` really ends it (``offload.dist.comm``'s Note on the end of a
    process). What offload's own launchers call."""
    import torch.distributed as dist  # noqa: PLC0415
    import torch.distributed.nn  # noqa: F401, PLC0415 - for its import-time default arguments

    dist.init_process_group(*args, **kwargs)


def comm_for(process_group=None, timeout: float = 1800.0, *, one_rank: bool = False) -> Comm:
    """The :class:`Comm` of ``process_group`` (None: the default group when one is
    initialized); a :class:`LocalComm` when there is no group or it has one rank (unless
    ``one_rank``: then a group of one rank runs its collectives too, as a GPU smoke test of
    the NCCL path does with one device)."""
    try:
        import torch.distributed as dist  # noqa: PLC0415
    except ImportError:  # pragma: no cover - torch built without distributed
        dist = None
    ready = dist is not None and dist.is_available() and dist.is_initialized()
    if process_group is not None and not ready:
        raise ValueError(
            "offload.wrap: process_group was given but torch.distributed is not initialized; "
            "call torch.distributed.init_process_group() first"
        )
    if not ready and env_int("WORLD_SIZE", 1) > 1:
        logger.warning(
            "offload.wrap: WORLD_SIZE=%s (torchrun) but no process group is initialized: this "
            "process trains a model of its own, unsharded, and no gradient is averaged with the "
            "other ranks'. Call offload.dist.init_process_group() before offload.wrap / "
            "from_pretrained to train one model over the ranks",
            os.environ["WORLD_SIZE"],
        )
    if not ready or (dist.get_world_size(process_group) == 1 and not one_rank):
        return LocalComm()
    return TorchComm(process_group, timeout)
