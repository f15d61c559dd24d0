"""``offload.wrap(model, config) -> (model, optimizer)``: builds the runtime of a model from its plan.

The plan (``offload.plan``) decides everything once; this module turns its decisions into
objects through the tables below (param home, gradient owner, optimizer-state home, step
schedule), fills the homes from the model's current values piece by piece, and installs the
hooks. Everything that can be checked before training is checked by the plan or here, with
errors naming the config key, the value and what to change: buffers too small for one piece,
pools larger than RAM, an unwritable ``nvme_path``, a model on the meta device, a model wrapped
twice.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import weakref
from collections import defaultdict
from dataclasses import dataclass

import psutil
import torch
import torch.nn as nn

from offload import _native
from offload.api.loss_scale import DynamicLossScaler
from offload.api.optimizer import OffloadOptimizer
from offload.config import ConfigError, OffloadConfig, load_config
from offload.device import HostMemory, Transfers, for_device
from offload.homes.grads import AutogradGrads, HeldNvmeGrads, HostGrads, NvmeGrads
from offload.homes.optim import HostMaster, HostOptim, NvmeOptim, ParamsMaster
from offload.homes.params import DeviceParams, HostParams, NvmeParams
from offload.plan import (
    GradOwner,
    MasterOwner,
    Plan,
    Schedule,
    check_host_buffers,
    make_plan,
)
from offload.runtime import Runtime
from offload.runtime.grads import Grads
from offload.runtime.schedule import Background, Immediate, InBackward
from offload.runtime.telemetry import Telemetry, check_jsonl_path
from offload.runtime.values import LiveParams

logger = logging.getLogger("offload.api")

# model -> runtime; the registry (not attributes on the user's objects) detects double wrapping
_RUNTIMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_of(model: nn.Module) -> Runtime:
    """The runtime of a wrapped model (raises if the model was not wrapped)."""
    runtime = _RUNTIMES.get(model)
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


# ------------------------------------------------------------------ the plan's choices as objects
PARAM_HOMES = {
    "none": lambda b: DeviceParams(
        b.plan, b.transfers, b.memory, b.writer(b.transfers, b.memory, b.plan.placement.dtype)
    ),
    "cpu": lambda b: HostParams(
        b.plan, b.transfers, b.memory, b.plan.placement.pin["offload_param"]
    ),
    "nvme": lambda b: NvmeParams(b.plan, b.transfers, b.memory, b.stores["offload_param"]),
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
OPTIM_HOMES = {
    MasterOwner.PARAMS: lambda b, p, g: HostOptim(b.plan, p, g, ParamsMaster(p)),
    MasterOwner.HOST: lambda b, p, g: HostOptim(b.plan, p, g, HostMaster(p)),
    MasterOwner.NVME: lambda b, p, g: NvmeOptim(b.plan, p, g, b.stores["offload_optimizer"]),
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


def _close_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit: a runtime nobody closed is closed (its update thread joined, its
    files removed) before the IO layer shuts down (``offload.io.lifecycle``'s Note on order:
    registered at wrap time, so it runs before the IO layer's own handler)."""
    runtime = ref()
    if runtime is not None and not runtime.closed:
        runtime.close()


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload.wrap: expected a torch.nn.Module, got {type(model).__name__}")
    for wrapped, runtime in list(_RUNTIMES.items()):
        if runtime.closed:
            continue
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
        if p.is_meta:
            raise ValueError(
                f"offload.wrap: parameter '{name}' is on the meta device (no weights); materialize "
                "the model first (e.g. model.to_empty(device='cpu') then initialize or load weights)"
            )


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


def _make_store(cfg: OffloadConfig, section: str, depth: int, b: _Parts, aio, resources: list):
    from offload.io import BufferPool, NvmeStore  # noqa: PLC0415
    from offload.store import TieredStore  # noqa: PLC0415

    sec = getattr(cfg, section)
    size = b.plan.placement.buffer_sizes[section]
    check_host_buffers(section, sec.buffer_count, size, psutil.virtual_memory().available)
    try:
        nvme = NvmeStore(sec.nvme_path, aio=aio, checksum=cfg.aio.checksum)
    except OSError as exc:
        raise ConfigError(f"{section}.nvme_path={sec.nvme_path!r}: {exc}") from exc
    resources.append(nvme)
    pin = b.memory.pins(b.plan.placement.pin[section])
    pool = BufferPool(sec.buffer_count, size, pin=pin)
    resources.append(pool)
    return TieredStore(pool=pool, nvme=nvme, prefetch_depth=depth, name=section)


def _trim_host_heap() -> None:
    """Gives the heap pages freed by moving the model's storage out back to the OS (glibc keeps
    freed heap memory mapped otherwise, so RSS would stay as if the model were still there)."""
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


def _build(
    model: nn.Module, cfg: OffloadConfig, plan: Plan, hyper, resources: list, buffer_dtypes: dict
) -> Runtime:
    placement = plan.placement
    memory, staging, writer = for_device(placement.device)
    transfers = Transfers(placement.device)
    b = _Parts(plan, cfg, transfers, memory, staging, writer, {})
    aio = None  # one IO engine for every store, made with the first
    for section, depth in placement.stores.items():
        aio = aio or _new_aio(cfg, resources)
        b.stores[section] = _make_store(cfg, section, depth, b, aio, resources)
        resources.append(b.stores[section])
    params = PARAM_HOMES[placement.param_home](b)
    grad_home = GRAD_HOMES[(placement.grads, placement.schedule)](b)
    optim = OPTIM_HOMES[placement.master](b, params, grad_home)
    for unit in plan.units:  # piece by piece from the live values (see offload.runtime.values)
        params.create(unit, lambda lo, hi, u=unit: LiveParams.values(u, lo, hi, placement.dtype))
        grad_home.create(unit)
        optim.create(unit, lambda lo, hi, u=unit: LiveParams.values(u, lo, hi, torch.float32))
        params.attach(unit)
    largest = max((u.layout.trainable for u in plan.units), default=0)
    timers: dict[str, float] = defaultdict(float)
    stepped = [u for u in plan.units if plan.trainable_pieces(u)]
    trace_starts: dict[str, list] = {}
    for section, store in b.stores.items():
        trace_starts.setdefault(TRACE_STARTS[section], []).append(store)
    return Runtime(
        model,
        plan,
        params=params,
        optim=optim,
        grads=Grads(grad_home, staging(transfers, memory, placement.dtype, largest), plan.units),
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


def wrap(model: nn.Module, config=None, *, _keep_grads: bool | None = None):
    """Wraps ``model`` for offloaded training; returns ``(model, optimizer)``.

    ``config`` is a dict, a path to a JSON/YAML file (ours or DeepSpeed's), an
    :class:`~offload.OffloadConfig`, or None for the defaults. The model stays the same object
    and its parameters stay the same ``nn.Parameter`` objects.
    """
    cfg = load_config(config)
    _check_model(model)
    check_jsonl_path(cfg.telemetry.jsonl_path)
    plan = make_plan(model, cfg, keep_grads=_keep_grads)
    placement = plan.placement
    trainable = [p for u in plan.units for p in u.trainable_params]
    if not trainable:
        raise ValueError(
            "offload.wrap: the model has no trainable parameters (all requires_grad=False)"
        )
    opt = cfg.optimizer
    group = {
        "params": trainable,
        "lr": opt.lr,
        "betas": tuple(opt.betas),
        "eps": opt.eps,
        "weight_decay": opt.weight_decay,
        "adamw_mode": opt.type == "adamw",
        "bias_correction": opt.bias_correction,
    }
    if cfg.offload_optimizer.threads:
        _native.set_num_threads(cfg.offload_optimizer.threads)
    scaler = None
    if placement.dtype == torch.float16:
        ls = cfg.loss_scale
        scaler = DynamicLossScaler(
            initial=ls.initial,
            growth_factor=ls.growth_factor,
            backoff_factor=ls.backoff_factor,
            growth_interval=ls.growth_interval,
            min_scale=ls.min_scale,
        )
    buffer_dtypes = _cast_buffers(model, placement.device, placement.dtype)
    resources: list = []  # pools, NVMe stores and the IO engine, closed with the runtime
    try:
        hyper = lambda: OffloadOptimizer.hyper_of(group, scaler)  # noqa: E731
        runtime = _build(model, cfg, plan, hyper, resources, buffer_dtypes)
    except BaseException:
        for res in reversed(resources):
            res.close()
        raise
    runtime.install_hooks()
    _RUNTIMES[model] = runtime
    atexit.register(_close_at_exit, weakref.ref(runtime))
    _trim_host_heap()
    optimizer = OffloadOptimizer(
        runtime, group, gradient_clipping=cfg.gradient_clipping, scaler=scaler
    )
    logger.info(
        "offload: %d units (+root), params on %s, optimizer on %s, compute %s on %s, piece %d "
        "elements",
        len(plan.units) - 1,
        placement.param_home,
        placement.optim_home,
        cfg.dtype,
        placement.device,
        placement.piece_numel,
    )
    return model, optimizer
