"""Placement: where every kind of state lives and how big the moves are, chosen once at wrap.

Everything here is decided from the config, the compute device and dtype, before any state
exists, and is read-only afterwards: which param home, optimizer-state home and step schedule
the runtime gets (as names the builder maps to objects), who owns the master and the gradient
bytes (``ownership.py``), the piece size, and the buffer arithmetic of the NVMe step. Every
problem found here is a ``ConfigError`` naming the key, the value and what to change.

Note: the param pool's buffers
    A gather holds at most ``param_window`` pieces of the ``offload_param`` pool (one buffer
    stays free for the trace prefetcher's demand). When fp32 params on NVMe are the master, the
    update holds pieces of that pool too, while a gather of the next forward (or of the
    backward, with the step in backward) runs: ``param_ahead + 1`` of them. Each takes its
    share of the pool, so together they never hold more than it has and neither can wait for a
    buffer the other holds while it waits (with one buffer each, neither holds one while it
    waits for another). The pieces a CPU gather lends to the unit it gathers are held in
    buffers the pool has beyond ``buffer_count`` (``offload.homes.params``, Note on the
    gather's window), outside this arithmetic, though not outside RAM's:
    ``check_host_buffers`` counts them. Every buffer of that pool is at most its largest
    piece (``offload.homes.params``, Note on the pool's buffer size), so those lent cost
    about the unit whose memory they stand in for, whatever ``buffer_size`` is.

Note: reading ahead
    ``prefetch.depth`` counts units: each NVMe store's trace prefetcher keeps ``depth`` times the
    largest unit's pieces in flight ahead of the one in use (times 4 shards for the optimizer's
    pieces). With ``"auto"`` buffers a unit is one piece; with smaller buffers counting pieces
    had read less than one unit ahead (bench_e2e's 8 MiB buffers: a 19 MiB unit is 3 pieces,
    and depth 2 read two thirds of the next unit). What the pool holds bounds it: a prefetch
    never waits for a buffer and never evicts a copy needed sooner (``offload.store.reclaim``),
    so a pool that cannot hold the next unit beside the gathered one and the update's share
    reads it only as the gather frees buffers, and wrap warns with the count that would.

Note: the NVMe step's buffers
    The default step streams each piece's master, exp_avg, exp_avg_sq and grad through the
    ``offload_optimizer`` pool: 4 buffers per piece in flight, and 3 more kept for write-backs
    still draining; what is left reads pieces ahead (``step_lookahead``). With the step in
    backward, 3 buffers are kept for write-backs and 1 for the backward's next grad piece; the
    step takes 3 per piece in flight (its grad comes in its own buffer); what is left holds
    grads handed over by the backward (``grad_hold``), and one piece is read ahead when that
    still leaves 2 to hold. ``grad_hold`` bounds how far the backward runs ahead of the update,
    not a unit's size: the update takes the pieces of a larger unit as they are handed over
    (``HeldNvmeGrads``), the root's too (at the backward's end).
    When the update runs after the backward instead (the loop clips, so no speculative one
    ran), those buffers are idle in its last backward: the first pieces' master and moments
    are read into them there (``head_start``), less one buffer for each grad the update's
    first pieces in flight fetch when it starts.

Note: a model that trains nothing
    A model wrapped with no trainable parameter (forwards only: an inference beyond the
    device's memory, a frozen teacher) has no master, moments or gradients: every optimizer
    and gradient buffer covers a unit's trainable prefix, which is empty. What
    ``offload_optimizer.device: nvme`` would still build is the optimizer store: its pool, a
    populated mapping of ``buffer_count x buffer_size`` (with "auto" the largest unit in fp32
    each: 8 x 48 MiB resident from the wrap on a 98M-parameter LLaMA generating from its
    checkpoint, 2026-12-06), its NVMe directory and IO; the param pool's share for an update
    (``param_ahead``), which narrowed the gathers' window; and the speculative update's second
    NVMe extent of fp32 params that are the master (744 MiB of swap for that LLaMA's 372). So
    the placement of such a model is made as with ``offload_optimizer.device: cpu``, whose
    homes hold nothing for it; ``optimizer.step()`` refuses (``Runtime._check_trains``).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, replace

import torch

from offload.config import ConfigError, OffloadConfig, resolve_auto_buffer_size
from offload.config.sections import NVME_OPT_BUFFERS as NVME_OPT_BUFFERS
from offload.plan.layout import PAGE_ELEMS
from offload.plan.ownership import GradOwner, GradReduce, MasterOwner

UNLIMITED = 1 << 62  # piece size when no swap buffer bounds it
URGENT_READS = frozenset({"offload_param"})
"""Stores whose reads go ahead of the other stores' queued IO in the shared engine
(``NvmeStore``'s ``urgent_reads``): the compute waits on a gather's reads, while the update's
reads and every write run beside it. On the 50M demo GPT's step in backward (bench_e2e's NVMe
configuration, 2 cores) the backward's gathers had queued behind the update's IO: with their
reads urgent they waited 0.12-0.14 s per iteration instead of 0.18-0.19 s (benchmarks/README.md)."""

logger = logging.getLogger("offload.plan")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Schedule(enum.Enum):
    """When the optimizer update runs (``offload.runtime.schedule``)."""

    IMMEDIATE = "immediate"
    """Inside ``optimizer.step()``: the optimizer state is in host memory, the step is short."""
    BACKGROUND = "background"
    """From ``optimizer.step()`` on a worker thread into the next forward (NVMe state)."""
    IN_BACKWARD = "in_backward"
    """Each unit as the last backward of a step completes it, speculatively: kept or redone at
    ``optimizer.step()`` (``offload_optimizer.step_in_backward``, the default with NVMe)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    device: torch.device
    """The compute device."""
    dtype: torch.dtype
    """The compute dtype of parameters, activations and device gradients."""
    param_home: str
    """``offload_param.device``: "none" (device), "cpu" (host) or "nvme"."""
    optim_home: str
    """``offload_optimizer.device``: "cpu" or "nvme"."""
    schedule: Schedule
    master: MasterOwner
    grads: GradOwner
    piece_numel: int
    """Elements per piece: what one swap buffer holds (``UNLIMITED`` without NVMe)."""
    param_window: int
    """NVMe param pieces a gather keeps in flight (count)."""
    step_lookahead: int
    """NVMe step: pieces whose reads are issued ahead of the one updated (count)."""
    grad_hold: int
    """Step in backward: grad pieces the update may hold in their swap buffers (count)."""
    head_start: int = 0
    """Step in backward, an update after the backward: ``offload_optimizer`` buffers its first
    pieces' reads may fill in the step's last backward (count; Note: the NVMe step's buffers)."""
    param_ahead: int = 0
    """NVMe step with the params as the master (``MasterOwner.PARAMS``): pieces whose params
    the update reads ahead of the one it updates (count; it holds one more)."""
    accumulation: int | None
    """Backwards per optimizer step (``gradient_accumulation_steps``): the step in backward
    updates in the last one; None: learned from the first step."""
    versioned_state: bool
    """NVMe master and moments have two extents each, so a speculative update can be undone
    (the step in backward; ``offload.store``'s Note on versions)."""
    retain_grads: bool
    """Step in backward: keep the gradients the speculative update consumed until the step
    commits (clipping or loss scaling is configured, so a redo may need them)."""
    stores: dict[str, int]
    """Config section of each store to build -> its trace prefetch depth (shards ahead)."""
    buffer_sizes: dict[str, int]
    """Config section -> bytes per swap buffer (``"auto"`` resolved for the model)."""
    pin: dict[str, bool]
    """Config section -> whether its host memory should be page-locked (CUDA applies it)."""
    world: int = 1
    """Ranks the state is sharded over (count)."""
    stage: int = 1
    """The ZeRO stage run across ranks (``distributed.stage`` resolved; moot with one rank)."""
    grad_reduce: GradReduce = GradReduce.NONE
    """When gradients are reduced across ranks (``ownership.py``)."""
    shard_params: bool = False
    """Stage 3 across ranks: each rank's param home holds its share of the compute params."""
    reduce_dtype: torch.dtype = torch.float32
    """The dtype the ranks' gradients are summed in (``distributed.reduce_dtype`` resolved;
    moot with one rank)."""
    grad_accum_dtype: torch.dtype = torch.float32
    """The dtype stage 1 adds a step's micro-steps in before its reduction
    (``distributed.grad_accum_dtype`` resolved; moot with one rank and at stages 2 and 3,
    whose owners add every micro-step in fp32)."""

    @property
    def reduce_slots(self) -> int:
        """Units whose gradients are flattened for a reduction at once (count): two (one being
        reduced while the next is filled) in the compute dtype's width, so one where the
        reduce dtype is twice as wide (``offload.runtime.grads``, Note on the reduce dtype)."""
        return 2 if self.reduce_dtype.itemsize <= self.dtype.itemsize else 1

    @property
    def versioned_params(self) -> bool:
        """The param home's NVMe shards take part in versions: they are the master a
        speculative update writes (``MasterOwner.PARAMS`` with the optimizer state on NVMe)."""
        return self.versioned_state and self.master is MasterOwner.PARAMS

    @property
    def master_apart_from_device_params(self) -> bool:
        """The compute params stay on the device while their fp32 master is a copy elsewhere
        (host or NVMe: bf16 compute, the optimizer state on NVMe, a CUDA device): each update
        writes the values derived from the master over them (``offload.runtime.watch.master_apart``)."""
        return self.param_home == "none" and self.master is not MasterOwner.PARAMS

    @property
    def params_move(self) -> bool:
        """Whether a unit's compute params are gathered for use and released after (they are
        offloaded, or sharded across ranks)."""
        return self.param_home != "none" or self.shard_params


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={name!r}: CUDA is not available on this machine; use 'cpu' or 'auto'"
        )
    return dev


def buffer_sizes(cfg: OffloadConfig, dtype: torch.dtype, largest_unit: int) -> dict[str, int]:
    """Bytes per swap buffer of each pool, ``"auto"`` resolved for a model whose largest unit
    has ``largest_unit`` elements (``offload.config.auto_size``)."""
    return {
        "offload_param": resolve_auto_buffer_size(
            "offload_param", cfg, largest_unit * dtype.itemsize
        ),
        "offload_optimizer": resolve_auto_buffer_size("offload_optimizer", cfg, largest_unit * 4),
    }


def piece_numel(cfg: OffloadConfig, dtype: torch.dtype, sizes: dict[str, int]) -> int:
    """Elements per piece: what one swap buffer holds (fp32 for optimizer state, the compute
    dtype for params), rounded down to the padding granule."""
    limits = []
    if cfg.offload_optimizer.device == "nvme":
        limits.append(("offload_optimizer.buffer_size", sizes["offload_optimizer"], 4))
    if cfg.offload_param.device == "nvme":
        limits.append(("offload_param.buffer_size", sizes["offload_param"], dtype.itemsize))
    piece = UNLIMITED
    for key, size, itemsize in limits:
        n = size // itemsize // PAGE_ELEMS * PAGE_ELEMS
        if n == 0:
            raise ConfigError(
                f"{key}={size}: a swap buffer must hold at least one piece of {PAGE_ELEMS} "
                f"elements ({PAGE_ELEMS * itemsize} bytes); raise it (e.g. to 64MiB)"
            )
        piece = min(piece, n)
    return piece


def nvme_step_buffers(count: int, in_backward: bool) -> tuple[int, int, int]:
    """(pieces read ahead, grad pieces held, buffers of the head start) for an
    ``offload_optimizer`` pool of ``count`` buffers (see the module Note)."""
    if count < NVME_OPT_BUFFERS:
        raise ConfigError(
            f"offload_optimizer.buffer_count={count}: the NVMe optimizer step needs at least "
            f"{NVME_OPT_BUFFERS} buffers in flight (master, exp_avg, exp_avg_sq and grad of one "
            "piece); use 8 or more so the next piece can be prefetched"
        )
    if not in_backward:
        return max(0, (count - NVME_OPT_BUFFERS - 3) // 4), 0, 0
    spare = count - 3 - 1
    ahead = 1 if spare - 3 * 2 >= 2 else 0
    return ahead, max(0, spare - 3 * (ahead + 1)), max(0, spare - (ahead + 1))


def _owners(
    cfg: OffloadConfig,
    device: torch.device,
    dtype: torch.dtype,
    keep_grads: bool | None,
    world: int = 1,
) -> tuple[MasterOwner, GradOwner]:
    """The byte owners of ``ownership.py``'s Note."""
    if cfg.offload_optimizer.device == "nvme":
        # fp32 params on NVMe are the master themselves: no second copy on disk (one rank
        # only: ownership.py's Note says what several would need)
        shards = cfg.offload_param.device == "nvme" and dtype == torch.float32 and world == 1
        return (MasterOwner.PARAMS if shards else MasterOwner.NVME), GradOwner.NVME
    host_params = cfg.offload_param.device == "cpu" or (
        cfg.offload_param.device == "none" and device.type == "cpu"
    )
    master = MasterOwner.PARAMS if host_params and dtype == torch.float32 else MasterOwner.HOST
    in_place = device.type == "cpu" and master is MasterOwner.PARAMS and world == 1
    keep = in_place if keep_grads is None else keep_grads and world == 1
    return master, GradOwner.AUTOGRAD if keep else GradOwner.HOST


def _grad_reduce(world: int, stage: int, schedule: Schedule) -> GradReduce:
    """``ownership.GradReduce``: the step in backward updates each unit as its backward ends,
    so its gradients are reduced then, whatever the stage."""
    if world == 1:
        return GradReduce.NONE
    if stage == 1 and schedule is not Schedule.IN_BACKWARD:
        return GradReduce.AT_STEP
    return GradReduce.PER_UNIT


def make_placement(
    cfg: OffloadConfig,
    device: torch.device,
    *,
    largest_unit: int = 0,
    keep_grads: bool | None = None,
    world: int = 1,
    sharded: bool | None = None,
    trains: bool = True,
) -> Placement:
    """Every placement decision for ``cfg`` on ``device`` over ``world`` ranks, for a model
    whose largest piece region (a unit with one rank, a rank's share of one with more) has
    ``largest_unit`` elements (what ``"auto"`` buffers are sized for). ``keep_grads``
    overrides whether gradients stay in ``p.grad`` (tests run the flat-gradient path on the CPU
    with False). ``sharded`` (default: ``world > 1``): the state is sharded and reduced with
    collectives (with one rank only to test that path). ``trains``: whether any parameter
    trains (Note: a model that trains nothing)."""
    sharded = world > 1 if sharded is None else sharded
    if not trains:  # no optimizer state anywhere: none of the NVMe step's pool, files or IO
        cfg = replace(cfg, offload_optimizer=replace(cfg.offload_optimizer, device="cpu"))
    dtype = DTYPES[cfg.dtype]
    sizes = buffer_sizes(cfg, dtype, largest_unit)
    opt = cfg.offload_optimizer
    stage = cfg.distributed.resolve_stage(cfg.offload_param.device)
    master, grads = _owners(cfg, device, dtype, keep_grads, 2 if sharded else 1)
    lookahead = hold = head_start = 0
    schedule = Schedule.IMMEDIATE
    if opt.device == "nvme":
        schedule = Schedule.IN_BACKWARD if opt.step_in_backward else Schedule.BACKGROUND
        lookahead, hold, head_start = nvme_step_buffers(opt.buffer_count, opt.step_in_backward)
    update_params = 0  # param pool buffers the update holds (Note: the param pool's buffers)
    if opt.device == "nvme" and master is MasterOwner.PARAMS:
        update_params = max(1, min(lookahead + 1, cfg.offload_param.buffer_count - 2))
    window = max(1, cfg.offload_param.buffer_count - 1 - update_params)
    piece = piece_numel(cfg, dtype, sizes)
    unit_pieces = max(1, -(-largest_unit // piece))  # the largest unit's pieces (Note: ahead)
    stores = {}
    if cfg.offload_param.device == "nvme":
        stores["offload_param"] = cfg.prefetch.depth * unit_pieces
        _check_param_ahead(
            cfg, unit_pieces, min(unit_pieces, window), update_params, sizes["offload_param"]
        )
    if opt.device == "nvme":  # an optimizer piece is 4 shards
        # The step in backward gives every buffer to the update's read-ahead and the grad
        # pieces it holds (nvme_step_buffers): grad pieces the trace fetched ahead for an
        # accumulating backward were evicted before their use and read twice (bench_e2e's
        # recipe: 8.1 B/param of grad reads in its last backward instead of 4, iterations
        # ~12% slower). Its uses are still recorded: the eviction planner needs them.
        in_backward = schedule is Schedule.IN_BACKWARD
        ahead = cfg.prefetch.depth * unit_pieces * NVME_OPT_BUFFERS
        stores["offload_optimizer"] = 0 if in_backward else ahead
    return Placement(
        device=device,
        dtype=dtype,
        param_home=cfg.offload_param.device,
        optim_home=opt.device,
        schedule=schedule,
        master=master,
        grads=grads,
        piece_numel=piece,
        param_window=window,
        param_ahead=max(0, update_params - 1),
        step_lookahead=lookahead,
        grad_hold=hold,
        head_start=head_start,
        accumulation=(
            None if cfg.gradient_accumulation_steps == "auto" else cfg.gradient_accumulation_steps
        ),
        versioned_state=schedule is Schedule.IN_BACKWARD,
        retain_grads=cfg.gradient_clipping > 0 or cfg.loss_scale.resolve_enabled(cfg.dtype),
        stores=stores,
        buffer_sizes=sizes,
        pin={
            "offload_param": cfg.offload_param.pin_memory,
            # nothing in the optimizer's host memory is copied to or from the device (the
            # gradients cross through the staging's own pinned buffer): pinned, its swap pool
            # lost its huge pages and took torch's power-of-two rounding, and so did every
            # unit's fp32 gradient buffer (offload.io.aligned, Notes on pinning and huge pages)
            "offload_optimizer": False,
        },
        world=world,
        stage=stage,
        grad_reduce=_grad_reduce(2 if sharded else 1, stage, schedule),
        shard_params=sharded and stage == 3,
        reduce_dtype=DTYPES[cfg.distributed.resolve_reduce_dtype(cfg.dtype)],
        grad_accum_dtype=DTYPES[cfg.distributed.resolve_grad_accum_dtype(cfg.dtype)],
    )


def _check_param_ahead(
    cfg: OffloadConfig, unit_pieces: int, gathered: int, update_params: int, buffer_size: int
) -> None:
    """Warns when the param pool cannot read the next unit while ``gathered`` pieces of one
    are held (Note: reading ahead), naming the keys to raise (and the buffer size in use:
    ``"auto"`` resolved, not the limit it is sized under)."""
    count, depth = cfg.offload_param.buffer_count, cfg.prefetch.depth
    room = count - gathered - update_params
    if depth == 0 or room >= unit_pieces:
        return
    logger.warning(
        "offload_param.buffer_count=%d: a unit is %d pieces (offload_param.buffer_size=%d bytes) "
        "and the update holds %d, so %d buffer(s) read ahead while a unit is gathered and "
        "prefetch.depth=%d cannot bring the next unit in beside it (the forward and backward "
        "wait for its reads); allowed but slow: use offload_param.buffer_count >= %d or a larger "
        "offload_param.buffer_size",
        count,
        unit_pieces,
        buffer_size,
        update_params,
        room,
        depth,
        2 * unit_pieces + update_params,
    )


def check_host_buffers(
    section: str, count: int, size: int, available: int, *, lent: int = 0
) -> None:
    """Refuses a pool of ``(count + lent) x size`` bytes that would not fit in ``available``
    bytes of RAM (90%), naming the keys to lower. ``lent``: the buffers the param pool has
    beyond ``buffer_count`` for lent pages (Note: the param pool's buffers); ``size``: bytes
    per buffer as allocated (the param pool's are at most its largest piece)."""
    need = (count + lent) * size
    if need > available * 0.9:
        counted = f"({count} + {lent} for the pages gathers lend to units)" if lent else count
        raise ConfigError(
            f"{section}.buffer_count x {section}.buffer_size = {counted} x {size} = "
            f"{need} bytes of host buffers, but only {available} bytes of RAM are available; "
            f"lower {section}.buffer_count or {section}.buffer_size"
        )
