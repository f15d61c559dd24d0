"""The config sections: one typed dataclass per component, validated on construction.

Note: validation and normalization
    Every section checks its fields in ``__post_init__`` and stores the normalized value (sizes
    as ``int`` bytes, betas as a tuple, choice names in canonical lower case), so two configs
    that mean the same compare equal. A bad field raises :class:`ConfigError` naming the dotted
    key (``<section>.<field>``), the value and what is allowed. Sections stay mutable plain
    dataclasses; ``dataclasses.replace`` and ``load_config(cfg)`` validate again.

Note: 4096-byte multiples
    ``buffer_size`` and ``aio.block_size`` are used as multiples of 4096 bytes, whatever the
    device: shards are padded to 4096 bytes, pool buffers are 4096-aligned, and O_DIRECT needs
    offsets and lengths in 4096 multiples. Any size is accepted (``"16MB"``, ``1e8``) and rounded
    UP to the next multiple of 4096: a buffer never gets smaller than asked, and the difference
    is at most 4095 bytes. The rounding is logged at INFO and the stored (and printed) value is
    the rounded one. Zero, negative, non-finite and non-numeric values are refused.

Note: "auto" buffer sizes
    ``offload_param.buffer_size`` and ``offload_optimizer.buffer_size`` default to ``"auto"``:
    the smaller of ``DEFAULT_BUFFER_SIZE`` (256 MiB, the former fixed default) and what the
    model's largest unit needs (its bytes in fp32 for the optimizer pool, in the compute dtype
    for the param pool), so a 3M-parameter model does not reserve 13 x 256 MiB. Only ``wrap``
    sees the model, so the field holds an :class:`~offload.config.sizes.AutoSize`: an ``int``
    equal to the 256 MiB cap (a correct upper bound for code that reads it as a number) whose
    type says "auto"; ``buffer_size_is_auto`` tells, and
    :func:`offload.config.resolve_auto_buffer_size` gives the size for a model. The counts stay
    fixed numbers: they set how many pieces are in flight (the NVMe step needs 4 per piece),
    not how large the model is.

Note: defaults
    The defaults fit one 24 GB GPU with 64 GB of RAM: optimizer state on the CPU, parameters on
    the device; when they are moved to NVMe, 8 optimizer swap buffers (enough for the step to
    read the next piece while updating this one) and 5 parameter buffers of at most 256 MiB
    each ("auto"), so 3.25 GiB of host buffers at most; 1 MiB IO blocks 8 deep on 2 IO threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from offload.config._checks import (
    as_betas,
    as_bool,
    as_buffer_size,
    as_choice,
    as_float,
    as_group_list,
    as_int,
    as_name_list,
    as_opt_path,
    as_pattern_list,
    as_size,
)
from offload.config.errors import ConfigError
from offload.config.sizes import AutoSize

MiB = 2**20
ALIGN = 4096
DEFAULT_BUFFER_SIZE = 256 * MiB
"""Bytes: the most an "auto" swap buffer holds (the fixed default before "auto")."""
_MAX_BUFFER = 2**40  # 1 TiB: far above any sane pinned buffer, catches unit mistakes
_MAX_COUNT = 4096
NVME_OPT_BUFFERS = 4  # master, exp_avg, exp_avg_sq and grad of one piece in flight


class _Section:
    """Mixin: the section's top-level key and the dotted name of one of its fields."""

    __slots__ = ()
    KEY: ClassVar[str] = ""

    def _k(self, name: str) -> str:
        return f"{self.KEY}.{name}"


class _SwapPool(_Section):
    """Mixin of the two sections with a host swap buffer pool (``buffer_count`` x
    ``buffer_size``)."""

    __slots__ = ()

    @property
    def buffer_size_is_auto(self) -> bool:
        """Whether ``buffer_size`` is "auto" (sized to the model at wrap, at most its value)."""
        return isinstance(self.buffer_size, AutoSize)  # type: ignore[attr-defined]

    def _check_buffer_size(self, value: object) -> int:
        return as_buffer_size(
            self._k("buffer_size"),
            value,
            cap=DEFAULT_BUFFER_SIZE,
            lo=1,
            hi=_MAX_BUFFER,
            align=ALIGN,
        )


@dataclass(kw_only=True, slots=True)
class OptimizerConfig(_Section):
    """The optimizer run on the CPU over fp32 master weights (``offload.CPUAdam``)."""

    KEY: ClassVar[str] = "optimizer"

    type: str = "adamw"
    """Update rule: "adamw" (decoupled weight decay) or "adam" (L2 added to the gradient)."""
    lr: float = 1e-3
    """Learning rate (> 0); an LR scheduler may change it at run time."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates, each in [0, 1)."""
    eps: float = 1e-8
    """Term added to the denominator for numerical stability (> 0)."""
    weight_decay: float = 0.0
    """Weight decay coefficient (>= 0); decoupled for "adamw", L2 for "adam"."""
    no_decay: list[str] = field(default_factory=list)
    """Regular expressions on parameter names: trainable parameters one matches are not decayed."""
    bias_correction: bool = True
    """Divide the moments by (1 - beta**step) as in the Adam paper."""
    param_groups: list[dict] = field(default_factory=list)
    """Param groups of their own, after a first group of the parameters none names (with the values above): each {params: [regular expressions on parameter names], and any of name, lr, betas, eps, weight_decay}."""

    def __post_init__(self) -> None:
        self.type = as_choice(self._k("type"), self.type, {"adamw": (), "adam": ()})
        self.lr = as_float(self._k("lr"), self.lr, lo=0.0, lo_open=True, what="learning rate")
        self.betas = as_betas(self._k("betas"), self.betas)
        self.eps = as_float(self._k("eps"), self.eps, lo=0.0, lo_open=True)
        self.weight_decay = as_float(self._k("weight_decay"), self.weight_decay, lo=0.0)
        self.no_decay = as_pattern_list(self._k("no_decay"), self.no_decay)
        self.bias_correction = as_bool(self._k("bias_correction"), self.bias_correction)
        self.param_groups = as_group_list(self._k("param_groups"), self.param_groups)


def _check_nvme_path(section: _Section, device: str, nvme_path: str | None) -> None:
    if device == "nvme" and nvme_path is None:
        raise ConfigError(
            f"{section._k('nvme_path')}: got None; allowed: a directory path on a fast local "
            f"disk, required because {section._k('device')} is 'nvme'",
            key=section._k("nvme_path"),
            value=None,
            allowed="a directory path",
        )


@dataclass(kw_only=True, slots=True)
class OffloadOptimizerConfig(_SwapPool):
    """Where the fp32 master weights, gradients and Adam moments live between steps."""

    KEY: ClassVar[str] = "offload_optimizer"

    device: str = "cpu"
    """Home of the optimizer state: "cpu" (host memory) or "nvme" (files under nvme_path)."""
    nvme_path: str | None = None
    """Directory for the state files when device is "nvme" (created 0700 if missing; a private
    subdirectory is made in it, and a crashed run's is reclaimed by the next)."""
    pin_memory: bool = True
    """Accepted as DeepSpeed configs set it; never page-locks: no device copy reads or writes
    the optimizer's host memory (gradients cross through a pinned staging buffer of their own)."""
    buffer_count: int = 8
    """Host swap buffers for streaming the state from NVMe (count; wrap needs >= 4 with "nvme")."""
    buffer_size: int | str = "auto"
    """Bytes per swap buffer (rounded up to 4096), or "auto": the largest unit in fp32, at most
    256 MiB; the NVMe step streams fp32 pieces this size."""
    threads: int = 0
    """CPU threads of the optimizer step, caller included (count; 0 = all cores)."""
    step_in_backward: bool = True
    """With "nvme": update each unit as soon as the last backward of a step (see
    gradient_accumulation_steps) has produced its gradients, so the update's disk traffic
    overlaps the backward; the update is speculative and kept or redone exactly at
    optimizer.step() (clipping, fp16 overflow); it writes to a second NVMe extent of the master
    and moments (12 more bytes of disk per parameter). False: the update runs after the
    backward, in the background. No effect with "cpu"."""

    def __post_init__(self) -> None:
        self.device = as_choice(self._k("device"), self.device, {"cpu": (), "nvme": ()})
        self.nvme_path = as_opt_path(self._k("nvme_path"), self.nvme_path)
        self.pin_memory = as_bool(self._k("pin_memory"), self.pin_memory)
        self.buffer_count = as_int(
            self._k("buffer_count"), self.buffer_count, lo=1, hi=_MAX_COUNT, what="count"
        )
        self.buffer_size = self._check_buffer_size(self.buffer_size)
        self.threads = as_int(
            self._k("threads"), self.threads, lo=0, hi=_MAX_COUNT, what="count; 0 = all cores"
        )
        self.step_in_backward = as_bool(self._k("step_in_backward"), self.step_in_backward)
        _check_nvme_path(self, self.device, self.nvme_path)
        if self.device == "nvme" and self.buffer_count < NVME_OPT_BUFFERS:
            # any model's wrap refuses it (plan.placement); `offload config` called it valid
            raise ConfigError.bad(
                self._k("buffer_count"),
                self.buffer_count,
                f"an integer >= {NVME_OPT_BUFFERS} when {self._k('device')} is 'nvme' (the "
                "NVMe step holds master, exp_avg, exp_avg_sq and grad of one piece at once; 8 "
                "or more prefetch the next piece)",
            )


@dataclass(kw_only=True, slots=True)
class OffloadParamConfig(_SwapPool):
    """Where the compute-dtype parameters live while not in use by forward or backward."""

    KEY: ClassVar[str] = "offload_param"

    device: str = "none"
    """Home of the parameters: "none" (stay on the compute device), "cpu" or "nvme"."""
    nvme_path: str | None = None
    """Directory for the parameter files when device is "nvme" (created 0700 if missing)."""
    pin_memory: bool = True
    """Page-lock the host buffers for fast asynchronous device copies (CUDA only)."""
    buffer_count: int = 5
    """Number of host buffers for parameter shards in flight (count)."""
    buffer_size: int | str = "auto"
    """Bytes per buffer (rounded up to 4096), or "auto": the largest unit in the compute dtype,
    at most 256 MiB; parameters stream from NVMe in pieces this size."""
    persistence_threshold: int = 100_000
    """Units with at most this many parameters stay on the compute device (elements)."""

    def __post_init__(self) -> None:
        self.device = as_choice(self._k("device"), self.device, {"none": (), "cpu": (), "nvme": ()})
        self.nvme_path = as_opt_path(self._k("nvme_path"), self.nvme_path)
        self.pin_memory = as_bool(self._k("pin_memory"), self.pin_memory)
        self.buffer_count = as_int(
            self._k("buffer_count"), self.buffer_count, lo=1, hi=_MAX_COUNT, what="count"
        )
        self.buffer_size = self._check_buffer_size(self.buffer_size)
        self.persistence_threshold = as_int(
            self._k("persistence_threshold"), self.persistence_threshold, lo=0, what="elements"
        )
        _check_nvme_path(self, self.device, self.nvme_path)


@dataclass(kw_only=True, slots=True)
class AioConfig(_Section):
    """The asynchronous file IO engine (``offload.io.AsyncIO``) used for NVMe shards. Every
    store shares one engine; the parameter store's reads, which a forward or backward waits
    on, go ahead of the optimizer's queued reads and of every write."""

    KEY: ClassVar[str] = "aio"

    block_size: int = 1 * MiB
    """Bytes per IO request (rounded up to 4096); a transfer is split into such blocks."""
    queue_depth: int = 8
    """IO blocks in flight at most, shared over the threads (count; each thread gets one
    at least)."""
    thread_count: int = 2
    """IO worker threads (count)."""
    direct_io: bool = True
    """Open shard files with O_DIRECT (bypasses the page cache; falls back where unsupported)."""
    checksum: bool = False
    """Store a checksum per NVMe shard and verify it on every read (costs a pass over the data)."""

    def __post_init__(self) -> None:
        self.block_size = as_size(
            self._k("block_size"), self.block_size, lo=1, hi=2**30, align=ALIGN
        )
        self.queue_depth = as_int(
            self._k("queue_depth"), self.queue_depth, lo=1, hi=_MAX_COUNT, what="count"
        )
        self.thread_count = as_int(
            self._k("thread_count"), self.thread_count, lo=1, hi=1024, what="count"
        )
        self.direct_io = as_bool(self._k("direct_io"), self.direct_io)
        self.checksum = as_bool(self._k("checksum"), self.checksum)


@dataclass(kw_only=True, slots=True)
class PrefetchConfig(_Section):
    """The trace-driven prefetcher that brings units in before they are used."""

    KEY: ClassVar[str] = "prefetch"

    depth: int = 2
    """Units each NVMe store fetches ahead of the one in use, in the order the first iteration
    recorded (count: the largest unit's pieces times this, as far as the swap buffers hold
    them; 0 = fetch on demand only)."""

    def __post_init__(self) -> None:
        self.depth = as_int(self._k("depth"), self.depth, lo=0, hi=_MAX_COUNT, what="units ahead")


@dataclass(kw_only=True, slots=True)
class LossScaleConfig(_Section):
    """Dynamic loss scaling: grow after clean steps, back off and skip the step on inf/nan
    gradients. growth_factor = backoff_factor = 1 is a static scale. On with fp16 compute; with
    fp32 compute for ``torch.autocast(dtype=torch.float16)`` when ``enabled`` is true.
    """

    KEY: ClassVar[str] = "loss_scale"

    enabled: bool | str = "auto"
    """Whether the loss is scaled: "auto" (with dtype "fp16" only), true (with any dtype: fp16
    autocast over fp32 or bf16 compute) or false (refused with fp16 compute)."""
    initial: float = 65536.0
    """Loss scale of the first step (> 0; 2**16)."""
    growth_factor: float = 2.0
    """Multiplier applied after growth_interval clean steps (>= 1)."""
    backoff_factor: float = 0.5
    """Multiplier applied on an overflow, in (0, 1]."""
    growth_interval: int = 1000
    """Clean steps between two growths (steps)."""
    min_scale: float = 1.0
    """The scale never drops below this (> 0, <= initial)."""

    def __post_init__(self) -> None:
        if isinstance(self.enabled, str) and self.enabled.strip().lower() == "auto":
            self.enabled = "auto"
        elif not isinstance(self.enabled, bool):
            raise ConfigError.bad(self._k("enabled"), self.enabled, '"auto", true or false')
        self.initial = as_float(self._k("initial"), self.initial, lo=0.0, lo_open=True)
        self.growth_factor = as_float(self._k("growth_factor"), self.growth_factor, lo=1.0)
        self.backoff_factor = as_float(
            self._k("backoff_factor"), self.backoff_factor, lo=0.0, hi=1.0, lo_open=True
        )
        self.growth_interval = as_int(
            self._k("growth_interval"), self.growth_interval, lo=1, what="steps"
        )
        self.min_scale = as_float(self._k("min_scale"), self.min_scale, lo=0.0, lo_open=True)
        if self.min_scale > self.initial:
            raise ConfigError.bad(
                self._k("min_scale"),
                self.min_scale,
                f"a number > 0 and <= loss_scale.initial ({self.initial:g})",
            )

    def resolve_enabled(self, dtype: str) -> bool:
        """Whether the loss is scaled with compute dtype ``dtype``: ``enabled``, with "auto"
        decided by the dtype (fp16 only)."""
        return dtype == "fp16" if self.enabled == "auto" else self.enabled


@dataclass(kw_only=True, slots=True)
class WrapConfig(_Section):
    """Which modules form an offload unit (parameters that move together)."""

    KEY: ClassVar[str] = "wrap"

    module_classes: list[str] = field(default_factory=list)
    """Class names (plain or dotted) whose instances are units; empty = automatic policy."""
    min_params: int = 0
    """Without a class match, modules with >= this many params are units (elements; 0 = off)."""
    check_reads: int = 0
    """The first forwards in which reading a released unit's parameter outside it raises
    (count; 0 = off; slow)."""

    def __post_init__(self) -> None:
        self.module_classes = as_name_list(self._k("module_classes"), self.module_classes)
        self.min_params = as_int(self._k("min_params"), self.min_params, lo=0, what="elements")
        self.check_reads = as_int(self._k("check_reads"), self.check_reads, lo=0, what="forwards")


@dataclass(kw_only=True, slots=True)
class TelemetryConfig(_Section):
    """Per-step counters (bytes moved per tier, waits, step time)."""

    KEY: ClassVar[str] = "telemetry"

    jsonl_path: str | None = None
    """File to append one JSON line per step to; null = off."""

    def __post_init__(self) -> None:
        self.jsonl_path = as_opt_path(self._k("jsonl_path"), self.jsonl_path)


DEFAULT_TIMEOUT = 1800.0  # seconds; torch.distributed's own default for gloo and NCCL
REDUCE_DTYPES: dict[str, tuple[str, ...]] = {
    "fp32": ("float32", "float", "torch.float32"),
    "bf16": ("bfloat16", "bfp16", "torch.bfloat16"),  # bfp16: DeepSpeed's spelling
    "fp16": ("float16", "half", "torch.float16"),
    "auto": (),
}
"""``distributed.reduce_dtype``'s and ``distributed.grad_accum_dtype``'s names and their
aliases."""


@dataclass(kw_only=True, slots=True)
class DistributedConfig(_Section):
    """ZeRO sharding across the ranks of a ``torch.distributed`` process group (used when
    ``offload.wrap`` runs with more than one rank; one rank ignores it)."""

    KEY: ClassVar[str] = "distributed"

    stage: int | str = "auto"
    """ZeRO stage: 1 (fp32 master and moments sharded; gradients averaged at the step), 2 (also
    the gradients, reduce-scattered as each unit's backward ends), 3 (also the compute params,
    all-gathered per unit), or "auto": 3 when offload_param.device is not "none", else 2."""
    timeout: float = DEFAULT_TIMEOUT
    """Seconds a collective may wait for the other ranks before it fails with an error naming
    the operation (> 0)."""
    reduce_dtype: str = "fp32"
    """Dtype the ranks' gradients are summed in: "fp32" (each unit's gradients widened on the
    device before the sum, one unit at a time, in place of the second of the two buffers the
    reduction overlaps with: no more device memory, twice the bytes of a 16-bit sum on the
    wire), the compute dtype ("bf16" or "fp16": half the bytes, one more 16-bit rounding per
    step than one process makes; fp16 divides by the world first so the sum cannot
    overflow), or "auto": the compute dtype."""
    grad_accum_dtype: str = "fp32"
    """Dtype stage 1 adds a step's micro-steps (backwards) in before its one reduction: "fp32"
    (from a step's second backward on, each unit's gradients are summed in an fp32 buffer on
    the device: 4 bytes per trainable parameter, where a 16-bit p.grad takes 2), the compute
    dtype (autograd adds them in p.grad: one 16-bit rounding per micro-step), or "auto": the
    compute dtype. Stages 2 and 3 add every micro-step in fp32 whatever it says, as one rank
    does."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, str) and self.stage.strip().lower() == "auto":
            self.stage = "auto"
        else:
            allowed = '1, 2, 3 (the ZeRO stage) or "auto"'
            if isinstance(self.stage, bool) or not isinstance(self.stage, (int, float)):
                raise ConfigError.bad(self._k("stage"), self.stage, allowed)
            if self.stage not in (1, 2, 3):  # no float(): an int beyond its range (fuzz)
                raise ConfigError.bad(self._k("stage"), self.stage, allowed)
            self.stage = int(self.stage)
        self.timeout = as_float(
            self._k("timeout"), self.timeout, lo=0.0, lo_open=True, what="seconds"
        )
        self.reduce_dtype = as_choice(self._k("reduce_dtype"), self.reduce_dtype, REDUCE_DTYPES)
        self.grad_accum_dtype = as_choice(
            self._k("grad_accum_dtype"), self.grad_accum_dtype, REDUCE_DTYPES
        )

    def resolve_reduce_dtype(self, dtype: str) -> str:
        """The dtype gradients are summed in for compute ``dtype``: ``reduce_dtype``, with
        "auto" the compute dtype."""
        return dtype if self.reduce_dtype == "auto" else self.reduce_dtype

    def resolve_grad_accum_dtype(self, dtype: str) -> str:
        """The dtype stage 1 adds micro-steps in for compute ``dtype``: ``grad_accum_dtype``,
        with "auto" the compute dtype."""
        return dtype if self.grad_accum_dtype == "auto" else self.grad_accum_dtype

    def resolve_stage(self, param_device: str) -> int:
        """The stage to run: ``stage``, with "auto" decided by where the params live."""
        if self.stage == "auto":
            return 3 if param_device != "none" else 2
        return int(self.stage)


SECTIONS: tuple[type[_Section], ...] = (
    OptimizerConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    AioConfig,
    PrefetchConfig,
    LossScaleConfig,
    WrapConfig,
    TelemetryConfig,
    DistributedConfig,
)
