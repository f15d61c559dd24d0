"""``offload.wrap(model, config) -> (model, optimizer)``: builds the runtime of a model from its plan.

The plan (``offload.plan``) decides everything once; this module turns its decisions into
objects through the tables below (param home, gradient owner and reduction, optimizer-state
home, step schedule), fills the homes piece by piece from one source of values (the model's
current values, or ``weights=``: files or tensors by name, ``offload.runtime.weights``), and
installs the hooks. Inside a ``torch.distributed`` process group (the default one, or
``process_group=``) each rank's plan covers its share (``ShardSpec``), its NVMe files go in its
own ``rank-NNNNN`` subdirectory of ``nvme_path``, and every rank's plan is checked to be the
same (same model, same values, same config) before anything is built. Everything that can be
checked before training is checked by the plan or here, with errors naming the config key, the
value and what to change: buffers too small for one piece, pools larger than RAM, an
unwritable ``nvme_path``, a model on the meta device without ``weights=``, weights that do not
fit the model, a model wrapped twice.

Note: a model on the meta device
    Its parameters have shapes and dtypes but no storage; the plan lays them out all the same.
    Nothing reads them: the homes are filled from ``weights``, and each parameter gets storage
    (the same ``nn.Parameter`` object, swapped in place by ``torch.utils.swap_tensors``) just
    before its home attaches it to its working storage. Buffers come from the weights
    (persistent ones) or are computed by the model (``fill_computed_buffers``).

Note: a wrap that stops
    Building moves each unit's values into its homes and points its parameters at their
    working storage (released, where the home is off the device): from there on the homes hold
    the only copy. A wrap stopped part way (a Ctrl-C while a large model's values stream to
    NVMe; an error) closed the homes and their files with them, and the model's values were
    gone, unit by unit up to where it stopped (``tests/_ctrl_c_points.py``, PHASE ``wrap``,
    2026-12-07: 40 of 71 trials at one point in 150, on one process; hooks left half
    installed too, and swap directories). So a wrap that stops puts the model back as it was
    before the error goes up: the units attached so far get their
    values back from the homes (on the device and in the dtype each parameter had; the fp32
    master of trainable ones, so those come back exactly; frozen ones held in a narrower
    compute dtype come back rounded to it, as after ``close(restore=True)``), parameters that
    were on the meta device go back to it, the buffers are the original tensors again, and the
    hooks, pools, files and threads go. A second Ctrl-C waits for that. Across ranks the
    values are not put back (reading them is a collective the other ranks are not in).

    A second Ctrl-C can land at the cleanup's very entry (a user pressing twice): the start of
    the call that opens its deferred block, where no Python code can hold back a Ctrl-C already
    pending (``signal.signal`` runs the pending handler before it swaps). Skipped, the cleanup
    lost the model's values (54 of 177 trials, ``tests/_ctrl_c_points.py`` with AGAIN 1). So the
    cleanup is tried again until its block has run (``done``, set inside it, tells a Ctrl-C at
    the block's entry from one delivered at its end), and the first error goes up. The loop is
    written out at both cleanups, not a helper's: a helper's own start would be one more point
    outside its ``try`` where the second Ctrl-C escapes.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import re
import weakref
from collections import defaultdict
from dataclasses import dataclass

import psutil
import torch
import torch.nn as nn

from offload import _native
from offload._interrupts import interrupts_deferred
from offload.api import clipping
from offload.api.loss_scale import DynamicLossScaler
from offload.api.optimizer import OffloadOptimizer
from offload.api.param_groups import not_decayed, optimizer_groups
from offload.api.pretrained import warn_kept_in_fp32
from offload.config import ConfigError, OffloadConfig, load_config
from offload.device import HostMemory, Transfers, for_device
from offload.dist import Comm, LocalComm, comm_for
from offload.homes.decay import UpdateRuns
from offload.homes.grads import AutogradGrads, HeldNvmeGrads, HostGrads, NvmeGrads
from offload.homes.optim import (
    HostMaster,
    HostOptim,
    NvmeMaster,
    NvmeOptim,
    ParamShardsMaster,
    ParamsMaster,
)
from offload.homes.params import DeviceParams, HostParams, NvmeParams, ShardedParams
from offload.plan import (
    URGENT_READS,
    GradOwner,
    GradReduce,
    MasterOwner,
    Plan,
    Schedule,
    ShardSpec,
    Unit,
    check_host_buffers,
    make_plan,
)
from offload.plan.units import note_external_use
from offload.runtime import Runtime
from offload.runtime.grads import Grads, ScatteredGrads, StepScatteredGrads
from offload.runtime.reads import ReadCheck
from offload.runtime.schedule import Background, Immediate, InBackward
from offload.runtime.telemetry import Telemetry, check_jsonl_path
from offload.runtime.values import LiveParams, ParamValues, Values
from offload.runtime.watch import master_apart
from offload.runtime.weights import ModelWeights, tie_declared

logger = logging.getLogger("offload.api")

# model -> weak reference to its runtime; the registry (not attributes on the user's objects)
# detects double wrapping. Weak both ways: a runtime refers to its model, so a strong value would
# keep every wrapped model, its pools and its process group alive until exit. What keeps a
# runtime alive is its optimizer and the hooks it put on the model.
_RUNTIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _runtimes() -> list[tuple[nn.Module, Runtime]]:
    pairs = [(model, ref()) for model, ref in list(_RUNTIMES.items())]
    return [(model, runtime) for model, runtime in pairs if runtime is not None]


def engine_of(model: nn.Module) -> Runtime:
    """The runtime of a wrapped model (raises if the model was not wrapped)."""
    ref = _RUNTIMES.get(model)
    runtime = ref() if ref is not None else None
    if runtime is None:
        raise ValueError("this model was not wrapped with offload.wrap (or was closed)")
    return runtime


@dataclass(slots=True)
class _Parts:
    """What the builders below take their arguments from."""

    plan: Plan
    cfg: OffloadConfig
    transfers: Transfers
    memory: HostMemory
    staging: type
    writer: type
    stores: dict
    comm: Comm


# ------------------------------------------------------------------ the plan's choices as objects
PARAM_HOMES = {
    "none": lambda b: DeviceParams(
        b.plan,
        b.transfers,
        b.memory,
        b.writer(b.transfers, b.memory, b.plan.placement.dtype),
        b.comm,
        watch_writes=master_apart(b.plan.placement),
    ),
    "cpu": lambda b: HostParams(
        b.plan, b.transfers, b.memory, b.plan.placement.pin["offload_param"], b.comm
    ),
    "nvme": lambda b: NvmeParams(b.plan, b.transfers, b.memory, b.stores["offload_param"], b.comm),
}
GRAD_HOMES = {
    (GradOwner.AUTOGRAD, Schedule.IMMEDIATE): lambda b: AutogradGrads(b.plan),
    (GradOwner.HOST, Schedule.IMMEDIATE): lambda b: HostGrads(
        b.plan, b.memory, b.plan.placement.pin["offload_optimizer"]
    ),
    (GradOwner.NVME, Schedule.BACKGROUND): lambda b: NvmeGrads(
        b.plan, b.stores["offload_optimizer"]
    ),
    (GradOwner.NVME, Schedule.IN_BACKWARD): lambda b: HeldNvmeGrads(
        b.plan, b.stores["offload_optimizer"], b.plan.placement.grad_hold
    ),
}
OPTIM_HOMES = {  # (who owns the master, offload_optimizer.device)
    (MasterOwner.PARAMS, "cpu"): lambda b, p, g: HostOptim(b.plan, p, g, ParamsMaster(p)),
    (MasterOwner.HOST, "cpu"): lambda b, p, g: HostOptim(b.plan, p, g, HostMaster(p)),
    (MasterOwner.NVME, "nvme"): lambda b, p, g: NvmeOptim(
        b.plan, p, g, b.stores["offload_optimizer"], NvmeMaster(p, b.stores["offload_optimizer"])
    ),
    (MasterOwner.PARAMS, "nvme"): lambda b, p, g: NvmeOptim(
        b.plan,
        p,
        g,
        b.stores["offload_optimizer"],
        ParamShardsMaster(p, b.stores["offload_optimizer"]),
    ),
}
GRAD_PATHS = {  # when gradients are reduced across ranks (plan.GradReduce)
    GradReduce.NONE: lambda b, owner, staging: Grads(owner, staging, b.plan.units, b.comm),
    GradReduce.PER_UNIT: lambda b, owner, staging: ScatteredGrads(
        owner, staging, b.plan.units, b.comm, b.plan.placement
    ),
    GradReduce.AT_STEP: lambda b, owner, staging: StepScatteredGrads(
        owner, staging, b.plan.units, b.comm, b.plan.placement
    ),
}
SCHEDULES = {
    Schedule.IMMEDIATE: lambda b, optim, params, grads, stepped, timers: Immediate(
        optim, params, stepped, timers
    ),
    Schedule.BACKGROUND: lambda b, optim, params, grads, stepped, timers: Background(
        optim, params, stepped, timers
    ),
    Schedule.IN_BACKWARD: lambda b, optim, params, grads, stepped, timers: InBackward(
        optim,
        params,
        stepped,
        timers,
        grads=grads,
        accumulation=b.plan.placement.accumulation,
        retain=b.plan.placement.retain_grads,
    ),
}
# whose access trace starts with the first forward of a step, and whose with its first backward
TRACE_STARTS = {"offload_param": "forward", "offload_optimizer": "backward"}


def _close_at_exit(ref: weakref.ref, pid: int) -> None:
    """At interpreter exit: a runtime nobody closed is closed (its update thread joined, its
    files removed) before the IO layer shuts down (``offload.io.lifecycle``'s Note on order:
    registered at wrap time, so it runs before the IO layer's own handler). Not in a process
    forked from the one that wrapped (``pid``), which inherits the handler and owns nothing:
    its close waited for locks the parent's threads held at the fork, for good (a DataLoader
    worker that used the model hung at exit until 2026-12-07)."""
    runtime = ref()
    if runtime is not None and os.getpid() == pid:  # (closed: what a close stopped left)
        runtime.close()


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declares that ``module``'s forward reads ``parameter``, which is registered elsewhere
    (``F.linear(x, self.blocks[2].fc.weight)`` in the model's forward or another block's):
    ``wrap`` then counts it as used by ``module``'s unit, or by the root where ``module`` is
    outside every unit, so that a parameter read by two units or by the root becomes the
    root's, gathered from the start of a forward to the end of its backward (DeepSpeed's
    ``deepspeed.zero.register_external_parameter``). Unregistered, such a read sees released
    storage (zeros on the CPU) with no error. Names are unchanged: ``state_dict()`` and
    ``named_parameters()`` list the parameter where it is registered. Call it before
    ``wrap`` (the plan is made there); it is kept with ``module`` (not its ``deepcopy``).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            "offload.register_external_parameter: expected a torch.nn.Module as module, got "
            f"{type(module).__name__}"
        )
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(
            "offload.register_external_parameter: expected an nn.Parameter as parameter, got "
            f"{type(parameter).__name__}"
        )
    for wrapped, runtime in _runtimes():
        if runtime.closed:
            continue
        owns = any(p is parameter for u in runtime.units for p in u.params)
        if owns or any(m is module for m in wrapped.modules()):
            named = wrapped.named_parameters(remove_duplicate=False)
            name = next((n for n, p in named if p is parameter), None)
            what = f"'{name}'" if name else f"of shape {tuple(parameter.shape)}"
            raise ValueError(
                f"offload.register_external_parameter: parameter {what} of a model already "
                f"wrapped ({type(wrapped).__name__}): its units were planned at wrap. Call "
                "register_external_parameter before offload.wrap"
            )
    note_external_use(module, parameter)


def _check_model(model: nn.Module, has_weights: bool) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload.wrap: expected a torch.nn.Module, got {type(model).__name__}")
    live = set()  # the parameters that wrapped models' engines own
    for wrapped, runtime in _runtimes():
        related = any(m is model for m in wrapped.modules()) or any(
            m is wrapped for m in model.modules()
        )
        if runtime.closed:
            if related:
                _take_over(runtime, has_weights)
            continue
        live.update(id(s.param) for u in runtime.units for s in u.layout.segments)
        if any(m is model for m in wrapped.modules()):
            where = (
                "this model"
                if wrapped is model
                else f"this module (part of a wrapped {type(wrapped).__name__})"
            )
            raise ValueError(
                f"offload.wrap: {where} is already wrapped; wrap a model once "
                "(call optimizer.close() first to unwrap)"
            )
        if any(m is wrapped for m in model.modules()):
            raise ValueError(
                f"offload.wrap: its submodule {type(wrapped).__name__} is already wrapped"
            )
    for name, p in model.named_parameters():
        if id(p) in live:
            raise ValueError(
                f"offload.wrap: parameter '{name}' belongs to another wrapped model too (a "
                "module or parameter shared between two wrapped models): that model's engine "
                "owns its storage and values (it releases, refills and updates them), so the "
                "two would not train one parameter. Wrap one model that holds both (a parent "
                "module), or give each its own copy"
            )
    _check_embeddings(model)
    _check_param_dtypes(model)
    if has_weights:
        return
    for what, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if t.is_meta:
                raise ValueError(
                    f"offload.wrap: {what} '{name}' is on the meta device (no values); pass "
                    "weights= (a .safetensors file, a Hugging Face model directory or a mapping "
                    "of names to tensors), or materialize the model first"
                )


def _check_param_dtypes(model: nn.Module) -> None:
    """offload keeps every parameter in its homes as real floating-point values in the compute
    dtype (a trainable one's master in fp32), and casts it there at wrap. A complex parameter
    lost its imaginary part in that cast with only torch's warning (a block multiplying by
    one in the Fourier domain then computed 0.12 off torch's, a scratch probe, 2026-12-05); an
    integer one (a quantized weight stored as a parameter) became floating point, which a
    packed weight's bit operations then refused ("bitwise_and_cpu not implemented for
    'Float'") and which an int32 one would round. Refused by name instead."""
    for name, p in model.named_parameters():
        if p.is_complex():
            raise ValueError(
                f"offload.wrap: parameter '{name}' is {p.dtype}: offload keeps parameters as "
                "real values in its homes, and the cast would drop its imaginary part. Store "
                "it as a real tensor with a last dimension of 2 (torch.view_as_real) and view "
                "it complex in the forward (torch.view_as_complex): torch's Adam steps a "
                "complex parameter as that real view too"
            )
        if not p.is_floating_point():
            raise ValueError(
                f"offload.wrap: parameter '{name}' is {p.dtype}: offload keeps parameters in "
                "its homes in the compute dtype, so it would become floating point (a packed "
                "quantized weight would lose its bits). Register it as a buffer "
                "(module.register_buffer), which offload keeps in its dtype on the compute "
                "device, or dequantize it before wrap"
            )


def _check_embeddings(model: nn.Module) -> None:
    """Two options of torch's embeddings that offload cannot honour, refused by name before
    anything is built (a scratch probe of each, 2026-12-05: both had trained wrongly or failed
    deep inside a backward):

    - ``sparse=True`` makes the weight's gradient a sparse tensor. offload takes every
      gradient into flat fp32 buffers, sums and clips it as dense, and its Adam is dense (as
      torch's ``Adam`` / ``AdamW``, which refuse sparse gradients too): the first backward
      failed in ``aten::view`` on the SparseCPU backend, naming no parameter.
    - ``max_norm`` renormalizes the looked-up rows of the weight in place in each forward, a
      write into the tensor the forward computes with. offload keeps a parameter's values in
      its homes, updated by its optimizer, and the tensor is a copy filled by each gather (in
      the compute dtype): the renorm never reached the master. With the weight released
      between uses the step raised that it was written; kept on the device with the optimizer
      on NVMe it trained silently apart from torch (3.8 off in the weights after 3 steps).
    """
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            continue
        what = f"{type(m).__name__} '{name or '(the model)'}'"
        if m.sparse and m.weight.requires_grad:
            raise ValueError(
                f"offload.wrap: {what} has sparse=True: its weight's gradient would be a sparse "
                "tensor, and offload's gradient buffers, clipping and Adam are dense (torch's "
                "Adam and AdamW refuse sparse gradients too). Build it with sparse=False, or "
                "freeze it (requires_grad_(False)) before wrap"
            )
        if m.max_norm is not None:
            raise ValueError(
                f"offload.wrap: {what} has max_norm={m.max_norm}: it renormalizes the rows it "
                "looks up in place, in its weight, at each forward; offload keeps the weight's "
                "values in its own homes (the tensor is a copy each gather fills, in the "
                "compute dtype), so that write would be dropped and training would go apart "
                "from torch's. Set max_norm=None before wrap (to bound the rows' norms, scale "
                "the looked-up rows instead, out of place)"
            )


def _collect_dropped_engines() -> None:
    """A wrapped model and its engine hold each other (its hooks), so a pair let go of without
    ``close()`` (a notebook cell run again: ``model, opt = offload.wrap(...)``) lives until
    Python's full garbage collection, with its buffers and swap files: 12 runs of such a cell
    held 1.1 GB and 40 files. Where an engine still open exists, a new wrap collects first."""
    if any(not runtime.closed for _, runtime in _runtimes()):
        gc.collect()


def _take_over(runtime: Runtime, has_weights: bool) -> None:
    """A model (or a part of one) whose engine was closed is wrapped again. Closed without
    restore where its parameters were released, their values are gone: refused unless
    ``weights=`` gives them again (it took the released storage's zeros as its values, and the
    closed engine's hooks refused every forward of the new one). Otherwise the closed engine
    lets the model go."""
    if runtime.released and not has_weights:
        raise ValueError(
            "offload.wrap: this model's earlier engine was closed without restore "
            "(optimizer.close()), which released its parameters: their values are gone. Pass "
            "weights= (what offload.export or save_pretrained wrote, or a checkpoint's "
            "export), or close with optimizer.close(restore=True) next time to keep them"
        )
    runtime.forget()


def _guard_compiled_code() -> None:
    """Makes ``torch.compile``'s code check the modules' hooks. Dynamo does not guard a
    compiled frame on the hooks of the modules it traced, by default
    (``torch._dynamo.config.skip_nnmodule_hook_guards``), so code compiled for a module without
    offload's hooks ran on a wrapped one without them: on released parameters, zeros, with no
    error (the loss and the update wrong). That code was the model's own, compiled and run
    before wrap, or that of an unwrapped model of its class compiled before or after (a
    baseline, a distillation's teacher), whose compiled frame the wrapped model matched. The
    guard is turned on for the process (the default of FSDP-style hooks added after a compile:
    a few more checks per compiled call), and the frames compiled without it are recompiled at
    their next call."""
    import torch._dynamo  # noqa: PLC0415 - imported by torch.optim already
    from torch._dynamo import config, convert_frame  # noqa: PLC0415

    if config.skip_nnmodule_hook_guards:
        config.skip_nnmodule_hook_guards = False
        logger.info(
            "offload.wrap: torch._dynamo.config.skip_nnmodule_hook_guards set to False: "
            "torch.compile's code checks the modules' hooks (code compiled without offload's "
            "would run a wrapped model on released parameters)"
        )
        if convert_frame.input_codes.seen:  # compiled without that check: compiled again
            torch._dynamo.reset_code_caches()


def _materialize(unit) -> None:
    """Gives the unit's meta parameters an empty CPU storage in place (see the module Note);
    the param home's ``attach`` points them at their working storage right after."""
    for seg in unit.layout.segments:
        p = seg.param
        if p.is_meta:
            t = torch.empty(p.shape, dtype=p.dtype)
            t.untyped_storage().resize_(0)  # shape and dtype only: no bytes are ever touched
            torch.utils.swap_tensors(p, nn.Parameter(t, requires_grad=p.requires_grad))


def _new_aio(cfg: OffloadConfig, resources: list):
    from offload.io import AsyncIO  # noqa: PLC0415

    aio = AsyncIO(
        block_size=cfg.aio.block_size,
        queue_depth=cfg.aio.queue_depth,
        thread_count=cfg.aio.thread_count,
        direct_io=cfg.aio.direct_io,
    )
    resources.append(aio)
    return aio


_RANK_DIR = re.compile(r"rank-\d{5,}")  # rank_path's subdirectories


def rank_path(nvme_path: str, comm: Comm) -> str:
    """Where this rank's NVMe files go: ``nvme_path`` itself with one rank, its own
    ``rank-NNNNN`` subdirectory (the global rank) with more, so ranks sharing a disk never
    share a directory."""
    if comm.world == 1:
        return nvme_path
    return os.path.join(nvme_path, f"rank-{comm.global_rank:05d}")


def swap_dirs(nvme_path: str) -> list[str]:
    """Every directory :func:`rank_path` gives under ``nvme_path`` at any rank count:
    ``nvme_path`` and its ``rank-NNNNN`` subdirectories. A store reclaims the swap that killed
    runs left in each (a run resumed at another rank count would otherwise never reclaim the
    killed run's: ``offload.io._owner``'s Note on reclaiming)."""
    try:
        ranks = sorted(e.path for e in os.scandir(nvme_path) if _RANK_DIR.fullmatch(e.name))
    except OSError:  # not made yet
        ranks = []
    return [nvme_path, *ranks]


def _make_store(cfg: OffloadConfig, section: str, depth: int, b: _Parts, aio, resources: list):
    from offload.io import BufferPool, NvmeStore  # noqa: PLC0415
    from offload.store import TieredStore  # noqa: PLC0415

    sec = getattr(cfg, section)
    size, lent = b.plan.placement.buffer_sizes[section], 0
    if section == "offload_param":
        # the param store's gathers lend pieces' pages to the unit they gather: the buffers
        # they hold meanwhile come on top of the configured ones (the gathered unit's own
        # memory, which it then does not need: offload/device/pages.py, Note on lent pages),
        # each a piece's bytes (offload/homes/params.py, Note on the pool's buffer size)
        size = NvmeParams.buffer_bytes(b.plan, cfg.aio.block_size)
        lent = NvmeParams.lend_slots(b.plan)
    available = psutil.virtual_memory().available
    check_host_buffers(section, sec.buffer_count, size, available, lent=lent)
    try:
        nvme = NvmeStore(
            rank_path(sec.nvme_path, b.comm),
            reclaim=swap_dirs(sec.nvme_path),
            own_path=b.comm.world > 1,  # its rank-NNNNN directory
            aio=aio,
            checksum=cfg.aio.checksum,
            urgent_reads=section in URGENT_READS,
        )
    except OSError as exc:
        raise ConfigError(f"{section}.nvme_path={sec.nvme_path!r}: {exc}") from exc
    resources.append(nvme)
    pin = b.memory.pins(b.plan.placement.pin[section])
    pool = BufferPool(sec.buffer_count + lent, size, pin=pin)
    resources.append(pool)
    return TieredStore(pool=pool, nvme=nvme, prefetch_depth=depth, name=section)


def trim_host_heap() -> None:
    """Gives the heap pages freed by moving the model's storage out back to the OS (glibc keeps
    freed heap memory mapped otherwise, so RSS would stay as if the model were still there);
    also the end of ``load_checkpoint``, whose pieces and conversions went through the heap."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _cast_buffers(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict:
    """Buffers live on the device, floating ones in the compute dtype; returns their dtypes
    before (restored by ``close(restore=True)``)."""
    before = {}
    for m in model.modules():
        for name, buf in m._buffers.items():
            if buf is not None:
                before[(m, name)] = buf.dtype
                m._buffers[name] = buf.to(device, dtype if buf.is_floating_point() else buf.dtype)
    return before


def _undo(
    model: nn.Module, runtime, resources: list, buffers: dict, devices: dict, world: int
) -> None:
    """A wrap that stopped (module Note): with its runtime built, the values go back from its
    homes and it closes; before, what was built closes (``_build`` put the attached units'
    values back already). The buffers are the original tensors again."""
    if runtime is not None:
        _RUNTIMES.pop(model, None)
        try:
            _put_back(runtime.units, devices, runtime.values, world)
        finally:
            runtime.close()
            if world == 1:  # the values are back: the closed engine's refusals go too
                runtime.forget()
    else:
        for res in reversed(resources):
            res.close()
    for (m, name), buf in buffers.items():
        m._buffers[name] = buf


def _put_back(attached: list[Unit], devices: dict, values: Values, world: int) -> None:
    """The parameters of the units ``attached`` get their values back from the homes, each
    on its device (``devices``) and in its dtype; those that were on the meta device go back
    to it (module Note: a wrap that stops). What cannot be read back is logged, by name."""
    live = [u for u in attached if any(devices[s.param].type != "meta" for s in u.layout.segments)]
    if world > 1 and live:
        logger.error(
            "offload.wrap stopped: across ranks the values of the %d units it had taken are "
            "not put back into the model (a collective); wrap it again with its values",
            len(live),
        )
    for unit in attached:
        full = {}
        if unit in live and world == 1:
            try:
                full = values.full(unit)
            except Exception as exc:  # noqa: BLE001 - the wrap's own error is the one raised
                logger.error("offload.wrap stopped: the values of %s could not be read back "
                             "(%s)", unit.label, exc)  # fmt: skip
        lost = []
        for s in unit.layout.segments:
            p = s.param
            if devices[p].type == "meta":
                meta = torch.empty(s.shape, dtype=s.dtype, device="meta")
                torch.utils.swap_tensors(p, nn.Parameter(meta, requires_grad=p.requires_grad))
            elif p in full:
                p.data = full[p].to(devices[p], s.dtype)
            else:
                lost.append(s.name)
        if lost and world == 1:
            logger.error("offload.wrap stopped: the values of %s are lost (%s)", unit.label, lost)


def _build(
    model: nn.Module,
    cfg: OffloadConfig,
    plan: Plan,
    hyper,
    resources: list,
    buffer_dtypes: dict,
    source: ParamValues,
    comm: Comm,
    built: list,
    devices: dict,
) -> Runtime:
    placement = plan.placement
    memory, staging, writer = for_device(placement.device)
    if memory.is_cuda and placement.param_home != "none" and not placement.pin["offload_param"]:
        # (CUDA's API synchronization behavior: a copy from pageable memory may wait for its
        # stream, which waits for the compute queued before the gather)
        logger.warning(
            "offload.wrap: offload_param.pin_memory=false with CUDA: each gather copies from "
            "pageable host memory, which the driver stages with the host waiting for the copy "
            "stream, so the gathers do not overlap the compute; pin_memory: true (the "
            "default) lets them run beside it"
        )
    transfers = Transfers(placement.device)
    b = _Parts(plan, cfg, transfers, memory, staging, writer, {}, comm)
    aio = None  # one IO engine for every store, made with the first
    for section, depth in placement.stores.items():
        aio = aio or _new_aio(cfg, resources)
        b.stores[section] = _make_store(cfg, section, depth, b, aio, resources)
        resources.append(b.stores[section])
    params = PARAM_HOMES[placement.param_home](b)
    if placement.shard_params:  # stage 3: the home holds this rank's share; unshard gathers
        params = ShardedParams(plan, transfers, memory, params, comm)
    grad_home = GRAD_HOMES[(placement.grads, placement.schedule)](b)
    optim = OPTIM_HOMES[placement.master, placement.optim_home](b, params, grad_home)
    attached: list[Unit] = []  # units whose parameters point at their homes (_put_back)
    try:
        for unit in plan.units:  # piece by piece from the source (see offload.runtime.values)
            params.create(unit, lambda lo, hi, u=unit: source.values(u, lo, hi, placement.dtype))
            grad_home.create(unit)
            optim.create(unit, lambda lo, hi, u=unit: source.values(u, lo, hi, torch.float32))
            with interrupts_deferred():  # recorded as it is attached
                attached.append(unit)
                _materialize(unit)
                params.attach(unit)
            trim_host_heap()  # the unit's pieces were new tensors: no heap left holding them
        largest = max((u.layout.trainable for u in plan.units), default=0)
        timers: dict[str, float] = defaultdict(float)
        stepped = [u for u in plan.units if plan.trainable_pieces(u)]
        trace_starts: dict[str, list] = {}
        for section, store in b.stores.items():
            trace_starts.setdefault(TRACE_STARTS[section], []).append(store)
        runtime = Runtime(
            model,
            plan,
            params=params,
            optim=optim,
            grads=GRAD_PATHS[placement.grad_reduce](
                b, grad_home, staging(transfers, memory, placement.dtype, largest)
            ),
            schedule=SCHEDULES[placement.schedule](b, optim, params, grad_home, stepped, timers),
            transfers=transfers,
            stores=b.stores,
            trace_starts=trace_starts,
            hyper=hyper,
            timers=timers,
            telemetry=Telemetry(cfg.telemetry.jsonl_path),
            resources=resources,
            buffer_dtypes=buffer_dtypes,
        )
        built.append(runtime)  # (for the caller's cleanup: a Ctrl-C may land as this returns)
        return runtime
    except BaseException:
        done = False  # (module Note: a wrap that stops, on a second Ctrl-C)
        while not done:
            try:
                with interrupts_deferred():
                    _put_back(attached, devices, Values(plan, params, optim, comm), comm.world)
                    done = True
            except KeyboardInterrupt:
                pass
        raise


def _fingerprint(model: nn.Module, cfg: OffloadConfig, plan: Plan, weights) -> dict:
    """What every rank must agree on: the config, the layout and the parameters' values (with
    ``weights=``, the model holds none yet: the source, when it is a path). Keyed by name, so
    that a difference can be told by its key."""
    layout = {"units": [u.label for u in plan.units]}
    for u in plan.units:
        for s in u.layout.segments:
            layout[f"unit {u.label!r} parameter {s.name!r}"] = {
                "shape": list(s.shape),
                "trainable": s.trainable,
                "dtype": str(s.dtype),
                "offset": s.offset,
            }
    # compared after the parameters: they differ whenever a parameter does, and the parameter
    # is what tells the difference (one frozen or tied on one rank)
    sizes = {
        f"unit {u.label!r} padded elements": {
            "trainable": u.layout.trainable,
            "total": u.layout.total,
        }
        for u in plan.units
    }
    if weights is not None:
        source = os.path.abspath(weights) if isinstance(weights, (str, os.PathLike)) else None
        values = {"weights": source}
    else:
        with torch.no_grad():
            values = {
                name: float(p.detach().double().sum()) + float(p.detach().double().abs().sum())
                for name, p in model.named_parameters()
            }
    pl = plan.placement
    config = {  # what the ranks' collectives and updates depend on (not paths, devices, IO)
        "dtype": cfg.dtype,
        "optimizer": cfg.to_dict()["optimizer"],
        "gradient_clipping": cfg.gradient_clipping,
        "loss_scale": cfg.to_dict()["loss_scale"],
        "placement": [pl.param_home, pl.optim_home, pl.schedule.value, pl.master.value],
        "sharding": [pl.stage, pl.grad_reduce.value, pl.shard_params, pl.piece_numel],
    }
    if pl.shard_params:  # which units stay gathered: which all-gathers each forward issues
        config["offload_param"] = {"persistence_threshold": cfg.offload_param.persistence_threshold}
    return {"config": config, "layout": layout, "sizes": sizes, "values": values}


class _Absent:
    """A fingerprint's key that one rank has and the other lacks (a parameter tied there)."""

    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


def _merged_keys(mine: dict, theirs: dict) -> list:
    """Both dicts' keys in order, each key only the other has placed after the key it follows
    there (a parameter one rank lacks is told before the offsets it shifts)."""
    keys, known = list(mine), set(mine)  # (a set: a model has thousands of parameters)
    after = None
    for k in theirs:
        if k not in known:
            keys.insert(keys.index(after) + 1 if after is not None else 0, k)
            known.add(k)
        after = k
    return keys


def _first_difference(mine, theirs, key: str = ""):
    """``(key, mine, theirs)`` where two fingerprints first differ, or None; keys are dotted
    (``optimizer.lr``); a list is told whole; a key one side lacks is ``absent`` there."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for k in _merged_keys(mine, theirs):
            a, b = mine.get(k, _ABSENT), theirs.get(k, _ABSENT)
            found = _first_difference(a, b, f"{key}.{k}" if key else k)
            if found:
                return found
        return None
    return None if mine == theirs else (key, mine, theirs)


def _check_ranks(comm: Comm, model: nn.Module, cfg: OffloadConfig, plan: Plan, weights) -> None:
    """Every rank of the group wraps the same model with the same config and values; the first
    difference is told by its key and both ranks' values."""
    mine = _fingerprint(model, cfg, plan, weights)
    theirs = comm.all_gather_object(mine, "every rank's model and config")
    for rank, other in enumerate(theirs):
        for part, what in (
            ("config", "config"),
            ("layout", "model (units and parameters)"),
            ("sizes", "model (units' sizes)"),
            ("values", "parameter values (seed every rank alike, or load the same weights)"),
        ):
            found = _first_difference(mine[part], other[part])
            if found:
                key, a, b = found
                raise ValueError(
                    f"offload.wrap: rank {comm.rank} and rank {rank} of the process group wrap "
                    f"a different {what}: {key} is {a!r} on rank {comm.rank} and {b!r} on "
                    f"rank {rank}; every rank must wrap the same model with the same config "
                    "and values"
                )


def _resolve_cuda(cfg: OffloadConfig, comm: Comm) -> OffloadConfig:
    """With NCCL every rank computes on its own device: "auto" and "cuda" become
    ``cuda:LOCAL_RANK`` (torchrun sets it); that device, or the config's ``cuda:N``, is made the
    current device and the one the group's collectives run on. The group's :class:`Comm` was
    made before, when the current device could still be ``cuda:0`` on every rank: its
    collectives then staged each rank's tensors onto ``cuda:0``, and NCCL saw every rank on one
    GPU."""
    if comm.backend == "nccl":
        if cfg.device == "cpu":
            raise ConfigError(
                "device='cpu' with a NCCL process group: NCCL reduces CUDA tensors only; "
                "initialize the group with backend='gloo' to train on the CPU"
            )
        if cfg.device in ("auto", "cuda"):
            index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
            cfg = load_config(dict(cfg.to_dict(), device=f"cuda:{index}"))
        device = torch.device(cfg.device)
        torch.cuda.set_device(device)
        comm.use_device(device)
    return cfg


def wrap(
    model: nn.Module,
    config=None,
    *,
    weights=None,
    param_groups=None,
    process_group=None,
    _keep_grads: bool | None = None,
    _one_rank_collectives: bool = False,
    _new_head: bool = False,
    _resized: bool = False,
):
    """Wraps ``model`` for offloaded training; returns ``(model, optimizer)``.

    ``config`` is a dict, a path to a JSON/YAML file (ours or DeepSpeed's), an
    :class:`~offload.OffloadConfig`, or None for the defaults. The model stays the same object
    and its parameters stay the same ``nn.Parameter`` objects.

    ``weights`` (optional): where the values come from instead of the model's parameters, which
    may then be on the meta device: a ``.safetensors`` file, a directory with
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``, or a mapping of
    ``model.state_dict()`` names to tensors. Each piece streams from it into its home; the full
    model is never in RAM (``offload.runtime.weights``).

    ``param_groups`` (optional): the optimizer's param groups, as a torch optimizer takes them
    (``[{"params": [...], "lr": 1e-3}, {"params": [...]}]``): every trainable parameter of the
    model in exactly one group, each group's ``lr``, ``betas``, ``eps`` and ``weight_decay``
    its own or the config's (``offload.api.param_groups``). Without it, one group holds them all in
    ``model.parameters()`` order.

    Inside an initialized ``torch.distributed`` process group (``process_group``, or the
    default one) with more than one rank, the state is sharded over its ranks by the ZeRO
    stage of ``distributed.stage``; every rank calls ``wrap`` with the same model, values and
    config, and then runs the same forwards, backwards and steps (data parallel: each on its
    own micro-batch). One rank, or no group, runs exactly as without one
    (``_one_rank_collectives``: a group of one rank shards and reduces through its collectives
    all the same, for ``benchmarks/gpu_smoke.py``'s one-GPU NCCL check). ``_new_head``
    (``from_pretrained``'s ``model_class``): parameters ``weights`` lacks are initialised by
    the model's ``_init_weights`` and its tensors the model lacks are left out, with a warning,
    where otherwise both are errors; ``_resized`` (``ignore_mismatched_sizes``): so are
    parameters of another shape than the file's.
    """
    cfg = load_config(config)
    _collect_dropped_engines()
    _check_model(model, weights is not None)
    if weights is not None:  # before the plan: tying replaces a parameter
        tie_declared(model, weights)
    check_jsonl_path(cfg.telemetry.jsonl_path)
    comm = comm_for(process_group, cfg.distributed.timeout, one_rank=_one_rank_collectives)
    cfg = _resolve_cuda(cfg, comm)
    shard, sharded = ShardSpec(comm.rank, comm.world), not isinstance(comm, LocalComm)
    plan = make_plan(model, cfg, keep_grads=_keep_grads, shard=shard, sharded=sharded)
    if comm.world > 1:
        _check_ranks(comm, model, cfg, plan, weights)
    placement = plan.placement
    warn_kept_in_fp32(model, placement.dtype)
    # the optimizer's order is torch's (state_dict numbers them so): model.parameters()
    order = {p: i for i, p in enumerate(model.parameters())}
    trainable = sorted((p for u in plan.units for p in u.trainable_params), key=order.__getitem__)
    if not trainable:  # forwards only: inference, a frozen teacher (Runtime._check_trains)
        logger.info(
            "offload.wrap: the model has no trainable parameters: wrapped for forwards "
            "(inference, a frozen teacher); optimizer.step() refuses"
        )
    opt = cfg.optimizer
    no_decay = not_decayed(model, opt.no_decay, trainable)
    defaults = {
        "lr": opt.lr,
        "betas": tuple(opt.betas),
        "eps": opt.eps,
        "weight_decay": opt.weight_decay,
        "adamw_mode": opt.type == "adamw",
        "bias_correction": opt.bias_correction,
    }
    groups = optimizer_groups(model, opt.param_groups, param_groups, trainable, defaults, comm)
    if cfg.offload_optimizer.threads:
        _native.set_num_threads(cfg.offload_optimizer.threads)
    scaler = None
    if cfg.loss_scale.resolve_enabled(cfg.dtype):  # fp16, or fp16 autocast over fp32 (asked)
        ls = cfg.loss_scale
        scaler = DynamicLossScaler(
            initial=ls.initial,
            growth_factor=ls.growth_factor,
            backoff_factor=ls.backoff_factor,
            growth_interval=ls.growth_interval,
            min_scale=ls.min_scale,
        )
    if weights is None:
        source: ParamValues = LiveParams(placement.dtype)
    else:  # checked against the model here, before anything is built
        source = ModelWeights(model, weights, placement.dtype, new_head=_new_head, resized=_resized)
    resources: list = []  # pools, NVMe stores and the IO engine, closed with the runtime
    buffers = {(m, n): b for m in model.modules() for n, b in m._buffers.items() if b is not None}
    built: list = []  # the runtime, once _build has made it
    devices = {s.param: s.param.device for u in plan.units for s in u.layout.segments}
    try:
        try:
            source.fill_buffers(model)
            buffer_dtypes = _cast_buffers(model, placement.device, placement.dtype)
            hyper = lambda: OffloadOptimizer.hyper_of(groups, scaler)  # noqa: E731
            args = (model, cfg, plan, hyper, resources, buffer_dtypes, source, comm, built, devices)
            runtime = _build(*args)
        finally:
            source.close()
        runtime.install_hooks()
        _guard_compiled_code()
        if cfg.wrap.check_reads and runtime.params.releases:
            runtime._handles.append(ReadCheck(model, runtime, cfg.wrap.check_reads))
        _RUNTIMES[model] = weakref.ref(runtime)
        atexit.register(_close_at_exit, weakref.ref(runtime), os.getpid())
        trim_host_heap()
        group_of = {p: i for i, g in enumerate(groups) for p in g["params"] if i}
        runtime.update_runs = UpdateRuns(no_decay, group_of)
        optimizer = OffloadOptimizer(
            runtime, groups, defaults, gradient_clipping=cfg.gradient_clipping, scaler=scaler
        )
        clipping.register(optimizer)  # torch's clipping would see no gradient: guard it
    except BaseException:
        done = False  # (module Note: a wrap that stops, on a second Ctrl-C)
        while not done:
            try:
                with interrupts_deferred():
                    _undo(
                        model, built[0] if built else None, resources, buffers, devices, comm.world
                    )
                    done = True
            except KeyboardInterrupt:
                pass
        raise
    logger.info(
        "offload: %d units (+root), params on %s, optimizer on %s, compute %s on %s, piece %d "
        "elements%s",
        len(plan.units) - 1,
        placement.param_home,
        placement.optim_home,
        cfg.dtype,
        placement.device,
        placement.piece_numel,
        f", ZeRO stage {placement.stage} over {comm.world} ranks (rank {comm.rank}, {comm.backend})"
        if sharded
        else "",
    )
    return model, optimizer
