"""Who owns each byte of training state: decided once per wrap, written down here.

Note: one owner per byte
    For every kind of state exactly one object owns the bytes; every other part asks it.

    compute-dtype parameters
        The param home (``offload.homes.params``): a flat device buffer the parameters view
        (``offload_param.device: none``), a flat host buffer (``cpu``), or NVMe shards streamed
        through the ``offload_param`` buffers (``nvme``). A gathered parameter's storage is a
        working copy the home fills (unshard) and drops (reshard); it owns nothing.

    fp32 master (:class:`MasterOwner`)
        ``PARAMS``: the param home's own fp32 values, when the compute dtype is fp32 and either
        the home is host memory (the params on the CPU device or ``offload_param.device: cpu``)
        with the optimizer state on the CPU, or the home is NVMe with the optimizer state on
        NVMe too (one rank). The update writes the parameters' home in place (an NVMe piece is
        fetched, updated in its buffer and written back, versioned like the moments with the
        step in backward); there is no second copy, in memory or on disk.
        ``HOST``: a flat fp32 host buffer of the optimizer state; the update writes the new
        compute values into the param home (``out=``), derived, never read back.
        ``NVME``: fp32 shards in the ``offload_optimizer`` store, the same derivation (bf16 or
        fp16 compute, params not on NVMe, or several ranks: not built there yet, the stage 1-2
        refresh's writes and stage 3's ``ShardedParams`` would have to take part in versions).
        Loading a master value (wrap, checkpoint, ``load_state_dict``) goes through the owner,
        which derives the compute copy itself; nothing else writes both.

    fp32 gradients (:class:`GradOwner`)
        ``AUTOGRAD``: gradients stay in ``p.grad`` where autograd accumulates them and the update
        reads them in place. Only when they already sit where the optimizer runs: CPU device,
        fp32 compute, optimizer state on the CPU, params not on NVMe.
        ``HOST``: one flat fp32 host buffer per unit; each unit's device gradients are
        accumulated into it when its backward ends (the first micro-step overwrites), and
        ``p.grad`` is dropped.
        ``NVME``: fp32 shards in the ``offload_optimizer`` store, accumulated piece by piece.
        With the step in backward, a piece the update is about to consume is handed to it still
        in its swap buffer; the store owns that buffer throughout, the hand-over only says who
        releases it (and that it is released without being written).
        On CUDA the device gradients pass through a staging buffer on their way (the device's
        ``GradStaging``); it owns nothing across units.

    Adam moments: always the optimizer state's home (host buffers or NVMe shards), next to the
    master they update.

Note: across ranks (``ShardSpec``)
    With more than one rank every owner above holds this rank's share only: the fp32 master,
    the moments and the fp32 gradients cover ``local_trainable`` (ZeRO stage 1 and up); the
    param home holds the whole unit (stages 1 and 2; each rank's share is fresh after the
    update and the rest is all-gathered before the unit is used again) or its share (stage 3;
    ``unshard`` all-gathers). ``AUTOGRAD`` never owns gradients across ranks: ``p.grad`` holds
    this rank's own, unreduced gradients, so the reduced share goes to a ``HOST`` or ``NVME``
    owner (:class:`GradReduce` says when the reduction happens).
"""

from __future__ import annotations

import enum


class MasterOwner(enum.Enum):
    """Where a unit's fp32 master weights live."""

    PARAMS = "params"
    """The param home's fp32 values are the master (no second copy): its host buffer, or its
    NVMe shards with the optimizer state on NVMe."""
    HOST = "host"
    """The optimizer state's own fp32 host buffer; compute params derived from it."""
    NVME = "nvme"
    """fp32 NVMe shards of the optimizer store; compute params derived from it."""


class GradOwner(enum.Enum):
    """Where a unit's fp32 gradients are accumulated between backward and the update."""

    AUTOGRAD = "autograd"
    """``p.grad``, accumulated by autograd and read in place by the update."""
    HOST = "host"
    """A flat fp32 host buffer per unit."""
    NVME = "nvme"
    """fp32 NVMe shards in the optimizer store (handed over in their buffers in backward)."""


class GradReduce(enum.Enum):
    """When a unit's gradients are reduced across ranks into their owner's share."""

    NONE = "none"
    """One rank: the owner takes them as they are."""
    PER_UNIT = "per_unit"
    """Stages 2 and 3: reduce-scattered as each unit's backward ends, every micro-step, so no
    rank holds more than its share in fp32 (the reduction overlaps the next unit's backward)."""
    AT_STEP = "at_step"
    """Stage 1: autograd accumulates every micro-step's gradients in ``p.grad`` (the compute
    dtype, the whole model, as data parallel does) and each unit is reduce-scattered once, at
    the step: one reduction per step whatever the accumulation."""
