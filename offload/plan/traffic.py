"""The bytes one training iteration moves, predicted from the plan alone.

For a model whose units each run once in the forward and once in the backward (no unit called
twice, no recomputation) and one micro-step per optimizer step, once the access traces are
recorded. The runtime's counters (``optimizer.stats()``, ``Runtime.counted()``) must then show:

- ``host->device``: every gather copies the unit's parameter bytes (a transient unit twice per
  iteration, a persistent one and the root once), and the update writes new compute values into
  device-resident parameters unless the master is those parameters;
- ``device->host``: each trainable parameter's gradient crosses once, unless autograd keeps it;
- per store, the bytes written to NVMe (each dirty release is one write of the shard's IO
  size), and ``fetched``: the IO bytes of every fetch that needs the data. A fetch finds its
  copy in host memory (the store counts ``cached_bytes``) or reads it, and a read ahead that is
  evicted unused is read again (``prefetch_wasted_bytes``), so for each store
  ``nvme->host bytes == fetched - cached_bytes + prefetch_wasted_bytes`` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from offload.plan.ownership import GradOwner, GradReduce, MasterOwner
from offload.plan.placement import Schedule
from offload.plan.plan import Plan
from offload.plan.units import Residency, Unit

IO_ALIGN = 4096


@dataclass
class StoreTraffic:
    fetched: int = 0
    """IO bytes of the fetches that need the shard's data (read from disk or found cached)."""
    written: int = 0
    """Bytes written to NVMe."""


@dataclass
class Traffic:
    host_to_device: int = 0
    device_to_host: int = 0
    stores: dict[str, StoreTraffic] = field(default_factory=dict)


def _io(plan: Plan, section: str, lo: int, hi: int, itemsize: int) -> int:
    nbytes = (hi - lo) * itemsize
    return min(-(-nbytes // IO_ALIGN) * IO_ALIGN, plan.placement.buffer_sizes[section])


def _param_bytes(unit: Unit, itemsize: int, trainable_only: bool = False) -> int:
    return (
        sum(s.numel for s in unit.layout.segments if s.trainable or not trainable_only) * itemsize
    )


GATHERS = {Residency.TRANSIENT: 2, Residency.PERSISTENT: 1, Residency.ROOT: 1}


def predict_iteration(plan: Plan) -> Traffic:
    """What one iteration moves (see the module docstring for the model it assumes)."""
    pl = plan.placement
    item = pl.dtype.itemsize
    out = Traffic()
    params_move = pl.param_home != "none"
    param_store = (
        out.stores.setdefault("offload_param", StoreTraffic())
        if "offload_param" in pl.stores
        else None
    )
    opt_store = (
        out.stores.setdefault("offload_optimizer", StoreTraffic())
        if "offload_optimizer" in pl.stores
        else None
    )
    for unit in plan.units:
        gathers = GATHERS[unit.residency] if params_move else 0
        out.host_to_device += gathers * _param_bytes(unit, item)
        trainable = plan.trainable_pieces(unit)
        if pl.grads is not GradOwner.AUTOGRAD:
            out.device_to_host += _param_bytes(unit, item, trainable_only=True)
        if pl.param_home == "none" and pl.master is not MasterOwner.PARAMS:
            out.host_to_device += sum(hi - lo for lo, hi in trainable) * item
        if param_store is not None:
            for lo, hi in plan.pieces(unit):
                param_store.fetched += gathers * _io(plan, "offload_param", lo, hi, item)
            for lo, hi in trainable:  # the update's new values
                param_store.written += _io(plan, "offload_param", lo, hi, item)
        if opt_store is not None:
            for lo, hi in trainable:
                io = _io(plan, "offload_optimizer", lo, hi, 4)
                opt_store.fetched += 3 * io  # master and moments
                opt_store.written += 3 * io
                if pl.schedule is not Schedule.IN_BACKWARD:  # accumulated, then read by the update
                    opt_store.fetched += io
                    opt_store.written += io
    return out


def predict_collectives(plan: Plan, micro_steps: int = 1) -> dict[str, int]:
    """Bytes of each kind of collective one optimizer step of ``micro_steps`` forwards and
    backwards issues on every rank, as ``offload.dist`` counts them (the gathered or reduced
    tensor), for the model the module docstring assumes; the norm's all-reduce aside.

    Stage 1: each unit's gradients reduce-scattered once, its updated params all-gathered once
    (before the next forward, so a step's record holds the previous update's). Stage 2:
    reduce-scattered every micro-step. Stage 3: every
    unit's params all-gathered for each use (``GATHERS``) every micro-step, its gradients
    reduce-scattered every micro-step. The params all-gather of stages 1 and 2 over NVMe is one
    broadcast per rank and piece (the same bytes)."""
    pl = plan.placement
    out = {"all_gather": 0, "reduce_scatter": 0, "broadcast": 0}
    if pl.world == 1:
        return out
    item = pl.dtype.itemsize
    for unit in plan.units:
        trainable, total = unit.layout.trainable * item, unit.layout.total * item
        steps = 1 if pl.grad_reduce is GradReduce.AT_STEP else micro_steps
        out["reduce_scatter"] += steps * trainable
        if pl.shard_params:  # a persistent unit stays gathered until the step
            uses = 1 if unit.residency is Residency.PERSISTENT else micro_steps
            out["all_gather"] += GATHERS[unit.residency] * uses * total
        elif trainable:
            out["broadcast" if pl.param_home == "nvme" else "all_gather"] += trainable
    return out
