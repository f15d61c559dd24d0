"""The bytes one training iteration moves, predicted from the plan alone.

For a model whose units each run once in the forward and once in the backward (no unit called
twice, no recomputation), ``micro_steps`` backwards per optimizer step, once the access traces
are recorded and the step in backward has learned how the loop steps. The runtime's counters
(``optimizer.stats()``, ``Runtime.counted()``) must then show:

- ``host->device``: every gather copies the unit's parameter bytes (a transient unit twice per
  micro-step, the root once per micro-step, a persistent one once per step; the plan's last
  unit, which such a model runs last in its forward and first in its backward, once per
  micro-step: it stays gathered between the two, except with stage 3's sharded params), and
  the update writes new compute values into device-resident parameters unless the master is
  those parameters;
- ``device->host``: each trainable parameter's gradient crosses once per micro-step, unless
  autograd keeps it;
- per store, the bytes written to NVMe (each dirty release is one write of the shard's IO
  size, exactly), and ``fetched``: the IO bytes of every fetch that needs the shard's data,
  found in host memory or read from disk. So ``fetched`` is also what the iteration reads when
  nothing is found cached: the bytes the placement needs (``benchmarks/bench_e2e.py`` prints it
  beside what was read); without reads ahead, the store reads at most that.
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


# gathers of a unit: per micro-step (forward and backward; the root once, gathered all along),
# or per step for a persistent one (kept from its first use until the update)
GATHERS_PER_MICRO = {Residency.TRANSIENT: 2, Residency.PERSISTENT: 0, Residency.ROOT: 1}
GATHERS_PER_STEP = {Residency.TRANSIENT: 0, Residency.PERSISTENT: 1, Residency.ROOT: 0}


def predict_iteration(
    plan: Plan, micro_steps: int = 1, retained: bool = False, after_backward: bool = False
) -> Traffic:
    """What one optimizer step of ``micro_steps`` backwards moves (see the module docstring
    for the model it assumes). ``retained``: the step in backward keeps the gradients its
    speculative update consumed (clipping or fp16; ``HeldNvmeGrads.retain``), for a redo that
    does not happen; ``after_backward``: the step in backward updates after the backward, as
    the background update does (it does so while the loop clips every step: ``InBackward``)."""
    pl = plan.placement
    item = pl.dtype.itemsize
    m = micro_steps
    schedule = Schedule.BACKGROUND if after_backward else pl.schedule
    out = Traffic()
    params_move = pl.param_home != "none"
    stores = {name: out.stores.setdefault(name, StoreTraffic()) for name in pl.stores}
    param_store, opt_store = stores.get("offload_param"), stores.get("offload_optimizer")
    # the param home's NVMe shards are the master (fp32): the update reads them
    masters_in_params = param_store is not None and pl.master is MasterOwner.PARAMS
    for unit in plan.units:
        r = unit.residency
        gathers = m * GATHERS_PER_MICRO[r] + GATHERS_PER_STEP[r] if params_move else 0
        last = unit is plan.units[-1] and not pl.shard_params  # (ShardedParams keeps none)
        if params_move and r is Residency.TRANSIENT and last:
            gathers = m  # kept from its forward into its backward
        out.host_to_device += gathers * _param_bytes(unit, item)
        trainable = plan.trainable_pieces(unit)
        if pl.grads is not GradOwner.AUTOGRAD:
            out.device_to_host += m * _param_bytes(unit, item, trainable_only=True)
        if pl.param_home == "none" and pl.master is not MasterOwner.PARAMS:
            out.host_to_device += sum(hi - lo for lo, hi in trainable) * item
        if param_store is not None:
            for lo, hi in plan.pieces(unit):
                param_store.fetched += gathers * _io(plan, "offload_param", lo, hi, item)
            for lo, hi in trainable:  # the update's new values (read first: the master)
                io = _io(plan, "offload_param", lo, hi, item)
                param_store.written += io
                param_store.fetched += io if masters_in_params else 0
        if opt_store is not None:
            for lo, hi in trainable:
                io = _io(plan, "offload_optimizer", lo, hi, 4)
                kinds = 2 if masters_in_params else 3  # the moments, and the master
                opt_store.fetched += kinds * io
                opt_store.written += kinds * io
                fetched, written = _grad_pieces(schedule, m, retained)
                opt_store.fetched += fetched * io
                opt_store.written += written * io
    return out


def _grad_pieces(schedule: Schedule, m: int, retained: bool) -> tuple[int, int]:
    """(reads, writes) of one fp32 grad piece per step of ``m`` micro-steps."""
    if schedule is not Schedule.IN_BACKWARD:
        # written every micro-step (the first overwrites), read back to add to from the second
        # on, and read by the update after the backward
        return m, m
    # the step in backward: the earlier micro-steps as above; the last adds to what they left
    # (one read, from the second micro-step on) and hands it to the update in its buffer, where
    # it is dropped, or written when kept for a redo
    return max(0, m - 2) + (1 if m > 1 else 0), (m - 1) + (1 if retained else 0)


def predict_collectives(plan: Plan, micro_steps: int = 1) -> dict[str, int]:
    """Bytes of each kind of collective one optimizer step of ``micro_steps`` forwards and
    backwards issues on every rank, as ``offload.dist`` counts them (the gathered or reduced
    tensor: gradients in ``distributed.reduce_dtype``, params in the compute dtype), for the
    model the module docstring assumes; the norm's all-reduce aside.

    Stage 1: each unit's gradients reduce-scattered once, its updated params all-gathered once
    (before the next forward, so a step's record holds the previous update's). Stage 2:
    reduce-scattered every micro-step. Stage 3: every
    unit's params all-gathered for each use (``GATHERS_PER_MICRO``, ``GATHERS_PER_STEP``) every micro-step, its gradients
    reduce-scattered every micro-step. The params all-gather of stages 1 and 2 over NVMe is one
    broadcast per rank and piece (the same bytes). Once per step, the all-reduce of which
    trainable parameters got a gradient (one byte each, counted twice as every all-reduce is;
    with the update in the backward, one per unit beside its last reduce-scatter instead, the
    same bytes: ``offload.runtime.grads``)."""
    pl = plan.placement
    out = {"all_gather": 0, "reduce_scatter": 0, "broadcast": 0, "all_reduce": 0}
    if pl.world == 1:
        return out
    item = pl.dtype.itemsize
    for unit in plan.units:
        trainable, total = unit.layout.trainable * item, unit.layout.total * item
        steps = 1 if pl.grad_reduce is GradReduce.AT_STEP else micro_steps
        out["reduce_scatter"] += steps * unit.layout.trainable * pl.reduce_dtype.itemsize
        if unit.layout.trainable:
            out["all_reduce"] += 2 * len(unit.trainable_params)
        if pl.shard_params:  # a persistent unit stays gathered until the step
            r = unit.residency
            out["all_gather"] += (micro_steps * GATHERS_PER_MICRO[r] + GATHERS_PER_STEP[r]) * total
        elif trainable:
            out["broadcast" if pl.param_home == "nvme" else "all_gather"] += trainable
    return out
