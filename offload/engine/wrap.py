"""``offload.wrap(model, config) -> (model, optimizer)``: builds the engine for a model.

Placement strategies are chosen here, once (STYLE: strategies, not flags): the parameter home
(device / host / NVMe) and the optimizer-state home (host / NVMe). Everything that can be checked
before training is checked here, with errors naming the config key, the value and what to change:
buffers too small for one piece, pools larger than RAM, an unwritable ``nvme_path``, a model on the
meta device, a model wrapped twice.
"""

from __future__ import annotations

import ctypes
import logging
import weakref

import psutil
import torch
import torch.nn as nn

from offload import _native
from offload.config import ConfigError, OffloadConfig, load_config
from offload.engine.engine import DTYPES, Engine
from offload.engine.layout import PAGE_ELEMS, FlatLayout
from offload.engine.loss_scale import DynamicLossScaler
from offload.engine.optimizer import OffloadOptimizer
from offload.engine.optstate import HostOptimState, NvmeOptimState
from offload.engine.params import DeviceParams, HostParams, NvmeParams, flatten_values
from offload.engine.policy import select_units
from offload.engine.telemetry import Telemetry, check_jsonl_path
from offload.engine.transfer import Transfers
from offload.engine.units import Unit

logger = logging.getLogger("offload.engine")

# model -> engine; the registry (not attributes on the user's objects) detects double wrapping
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

NVME_OPT_BUFFERS = 4  # master, exp_avg, exp_avg_sq and grad of one piece in flight


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={name!r}: CUDA is not available on this machine; use 'cpu' or 'auto'"
        )
    return dev


def engine_of(model: nn.Module) -> Engine:
    """The engine of a wrapped model (raises if the model was not wrapped)."""
    engine = _ENGINES.get(model)
    if engine is None:
        raise ValueError("this model was not wrapped with offload.wrap (or was closed)")
    return engine


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"offload.wrap: expected a torch.nn.Module, got {type(model).__name__}")
    for wrapped, engine in list(_ENGINES.items()):
        if engine.closed:
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


def _build_units(model: nn.Module, cfg: OffloadConfig) -> list[Unit]:
    chosen = select_units(model, list(cfg.wrap.module_classes), cfg.wrap.min_params)
    users: dict[nn.Parameter, set[int]] = {}
    names: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, name)
    for i, (_, mod) in enumerate(chosen):
        for _, p in mod.named_parameters(remove_duplicate=False):
            users.setdefault(p, set()).add(i)
    per_unit: list[list[tuple[str, nn.Parameter]]] = [[] for _ in chosen]
    root: list[tuple[str, nn.Parameter]] = []
    for p, name in names.items():
        owners = users.get(p, set())
        (per_unit[next(iter(owners))] if len(owners) == 1 else root).append((name, p))
    units = [Unit(0, "", model, FlatLayout.build(root), is_root=True)]
    for i, ((qual, mod), named) in enumerate(zip(chosen, per_unit)):
        units.append(Unit(i + 1, qual, mod, FlatLayout.build(named)))
    threshold = cfg.offload_param.persistence_threshold
    for unit in units[1:]:
        unit.persistent = cfg.offload_param.device != "none" and unit.layout.total <= threshold
    return units


def _piece_numel(cfg: OffloadConfig, dtype: torch.dtype) -> int:
    """Elements per piece: what one swap buffer holds (fp32 for optimizer state, the compute
    dtype for params), rounded down to the padding granule."""
    limits = []
    if cfg.offload_optimizer.device == "nvme":
        limits.append(("offload_optimizer.buffer_size", cfg.offload_optimizer.buffer_size, 4))
    if cfg.offload_param.device == "nvme":
        limits.append(
            (
                "offload_param.buffer_size",
                cfg.offload_param.buffer_size,
                torch.empty((), dtype=dtype).element_size(),
            )
        )
    piece = 1 << 62
    for key, size, itemsize in limits:
        n = size // itemsize // PAGE_ELEMS * PAGE_ELEMS
        if n == 0:
            raise ConfigError(
                f"{key}={size}: a swap buffer must hold at least one piece of {PAGE_ELEMS} "
                f"elements ({PAGE_ELEMS * itemsize} bytes); raise it (e.g. to 64MiB)"
            )
        piece = min(piece, n)
    return piece


def _make_store(cfg, section: str, device, aio, pin: bool, resources: list):
    from offload.io import BufferPool, NvmeStore  # noqa: PLC0415
    from offload.store import TieredStore  # noqa: PLC0415

    sec = getattr(cfg, section)
    need = BufferPool.required_bytes(sec.buffer_count, sec.buffer_size)
    avail = psutil.virtual_memory().available
    if need > avail * 0.9:
        raise ConfigError(
            f"{section}.buffer_count x {section}.buffer_size = {sec.buffer_count} x {sec.buffer_size} "
            f"= {need} bytes of host buffers, but only {avail} bytes of RAM are available; "
            f"lower {section}.buffer_count or {section}.buffer_size"
        )
    try:
        nvme = NvmeStore(sec.nvme_path, aio=aio, checksum=cfg.aio.checksum)
    except OSError as exc:
        raise ConfigError(f"{section}.nvme_path={sec.nvme_path!r}: {exc}") from exc
    resources.append(nvme)
    pool = BufferPool(sec.buffer_count, sec.buffer_size, pin=pin and device.type == "cuda")
    resources.append(pool)
    # prefetch.depth counts pieces ahead; an optimizer piece is 4 shards (master, moments, grad)
    depth = cfg.prefetch.depth * (4 if section == "offload_optimizer" else 1)
    return TieredStore(device=device, pool=pool, nvme=nvme, prefetch_depth=depth, name=section)


def _trim_host_heap() -> None:
    """Gives the heap pages freed by moving the model's storage out back to the OS (glibc keeps
    freed heap memory mapped otherwise, so RSS would stay as if the model were still there)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def wrap(model: nn.Module, config=None, *, _keep_grads: bool | None = None):
    """Wraps ``model`` for offloaded training; returns ``(model, optimizer)``.

    ``config`` is a dict, a path to a JSON/YAML file (ours or DeepSpeed's), an
    :class:`~offload.OffloadConfig`, or None for the defaults. The model stays the same object
    and its parameters stay the same ``nn.Parameter`` objects.
    """
    cfg = load_config(config)
    _check_model(model)
    check_jsonl_path(cfg.telemetry.jsonl_path)
    device = resolve_device(cfg.device)
    dtype = DTYPES[cfg.dtype]
    if cfg.offload_optimizer.threads:
        _native.set_num_threads(cfg.offload_optimizer.threads)
    if (
        cfg.offload_optimizer.device == "nvme"
        and cfg.offload_optimizer.buffer_count < NVME_OPT_BUFFERS
    ):
        raise ConfigError(
            f"offload_optimizer.buffer_count={cfg.offload_optimizer.buffer_count}: the NVMe "
            f"optimizer step needs at least {NVME_OPT_BUFFERS} buffers in flight (master, exp_avg, "
            "exp_avg_sq and grad of one piece); use 8 or more so the next piece can be prefetched"
        )
    units = _build_units(model, cfg)
    transfers = Transfers(device)
    piece = _piece_numel(cfg, dtype)
    orig_dtype = {s.param: s.param.dtype for u in units for s in u.layout.segments}
    buffer_dtypes = {}  # (module, name) -> dtype before wrap, restored by close(restore=True)
    for m in model.modules():  # buffers live on the device, floating ones in the compute dtype
        for name, b in m._buffers.items():
            if b is not None:
                buffer_dtypes[(m, name)] = b.dtype
                m._buffers[name] = b.to(device, dtype if b.is_floating_point() else b.dtype)

    stores: dict = {}
    resources: list = []  # pools, NVMe stores and the IO engine, closed with the engine
    aio = None
    if "nvme" in (cfg.offload_optimizer.device, cfg.offload_param.device):
        from offload.io import AsyncIO  # noqa: PLC0415

        aio = AsyncIO(
            block_size=cfg.aio.block_size,
            queue_depth=cfg.aio.queue_depth,
            thread_count=cfg.aio.thread_count,
            direct_io=cfg.aio.direct_io,
        )
        resources.append(aio)
    try:
        pin_p = cfg.offload_param.pin_memory
        if cfg.offload_param.device == "nvme":
            stores["offload_param"] = _make_store(
                cfg, "offload_param", device, aio, pin_p, resources
            )
            params = NvmeParams(
                device,
                dtype,
                transfers,
                stores["offload_param"],
                piece,
                window=cfg.offload_param.buffer_count - 1,
            )
        elif cfg.offload_param.device == "cpu":
            params = HostParams(device, dtype, transfers, pin_p)
        else:
            params = DeviceParams(device, dtype, transfers)
        if cfg.offload_optimizer.device == "nvme":
            stores["offload_optimizer"] = _make_store(
                cfg, "offload_optimizer", device, aio, cfg.offload_optimizer.pin_memory, resources
            )
            count = cfg.offload_optimizer.buffer_count
            if cfg.offload_optimizer.step_in_backward:
                # 3 buffers kept for write-backs and 1 for the backward's next grad piece; the
                # step takes 3 per piece in flight (its grad comes in its own buffer); what is
                # left holds grads. One piece is read ahead if that still leaves 2 to hold.
                spare = count - 3 - 1
                ahead = 1 if spare - 3 * 2 >= 2 else 0
                hold = max(0, spare - 3 * (ahead + 1))
                optim = NvmeOptimState(
                    stores["offload_optimizer"], piece, ahead, in_backward=True, hold=hold
                )
            else:
                # pieces read ahead in the step: 4 buffers per piece, 3 kept for write-backs
                ahead = max(0, (count - NVME_OPT_BUFFERS - 3) // 4)
                optim = NvmeOptimState(stores["offload_optimizer"], piece, lookahead=ahead)
        else:
            # grads may stay in p.grad when they already sit where the optimizer runs and the
            # params' home takes per-parameter writes (see offload.engine.optstate's Note)
            keep = (
                device.type == "cpu"
                and dtype == torch.float32
                and cfg.offload_param.device != "nvme"
            )
            optim = HostOptimState(
                pin=cfg.offload_optimizer.pin_memory and device.type == "cuda",
                keep_grads=keep if _keep_grads is None else _keep_grads,
                transfers=transfers,
            )
        for unit in units:
            n = unit.layout.trainable
            master = flatten_values(unit.layout, 0, n, torch.float32) if n else None
            params.setup(unit)
            optim.setup(unit, params, master)
    except BaseException:
        for store in stores.values():
            store.close()
        for res in reversed(resources):
            res.close()
        raise

    engine = Engine(
        model,
        units,
        device=device,
        dtype=dtype,
        params=params,
        optim=optim,
        transfers=transfers,
        stores=stores,
        pin=cfg.offload_optimizer.pin_memory and device.type == "cuda",
    )
    engine.orig_dtype = orig_dtype
    engine.telemetry = Telemetry(cfg.telemetry.jsonl_path)
    engine.buffer_dtypes = buffer_dtypes
    engine.config = cfg
    engine.resources = resources
    engine.install_hooks()
    _ENGINES[model] = engine
    _trim_host_heap()
    scaler = None
    if dtype == torch.float16:
        ls = cfg.loss_scale
        scaler = DynamicLossScaler(
            initial=ls.initial,
            growth_factor=ls.growth_factor,
            backoff_factor=ls.backoff_factor,
            growth_interval=ls.growth_interval,
            min_scale=ls.min_scale,
        )
    opt = cfg.optimizer
    optimizer = OffloadOptimizer(
        engine,
        lr=opt.lr,
        betas=tuple(opt.betas),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        adamw_mode=opt.type == "adamw",
        gradient_clipping=cfg.gradient_clipping,
        scaler=scaler,
    )
    optimizer.param_groups[0]["bias_correction"] = opt.bias_correction
    logger.info(
        "offload: %d units (+root), params on %s, optimizer on %s, compute %s on %s, piece %d elements",
        len(units) - 1,
        cfg.offload_param.device,
        cfg.offload_optimizer.device,
        cfg.dtype,
        device,
        piece,
    )
    return model, optimizer
