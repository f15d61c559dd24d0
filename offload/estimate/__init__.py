"""Memory arithmetic for ZeRO stages 0-3 with and without CPU / NVMe offload (torch-free).

Everything here is plain integer arithmetic on parameter counts; nothing imports torch, so the
``offload estimate`` command answers "will a 7B / 13B / 70B model fit, and how?" in milliseconds
on a laptop. Byte sizes use decimal units (GB = 10**9) as the ZeRO paper does.

Note: the model-state arithmetic
    Per parameter, mixed-precision Adam keeps P = 2 bytes of compute params (bf16/fp16), G = 2
    bytes of gradients and K = 12 bytes of optimizer state (fp32 master, Adam m, Adam v). With N
    data-parallel ranks ZeRO partitions the optimizer state (stage >= 1), then the gradients
    (stage >= 2), then the parameters (stage 3), so the bytes per device are
        stage 0: (P + G + K) Psi            stage 1: (P + G) Psi + K Psi / N
        stage 2: P Psi + (G + K) Psi / N    stage 3: (P + G + K) Psi / N
    which for Psi = 7.5e9 and N = 64 gives the paper's 120, 31.4, 16.6 and 1.9 GB. With fp32
    compute P = G = 4 and K = 8 (the params are their own master copy).

Note: offload placements
    ``cpu_optimizer`` (ZeRO-Offload): the optimizer runs on the host over fp32 master, m, v and
    an fp32 gradient accumulator (16 bytes per parameter of the rank's partition); the device
    keeps its compute params and streams each unit's gradients off as backward finishes it.
    ``cpu_optimizer_params``: the compute params live on the host too (P bytes per parameter of
    the partition); the device holds only the units being computed. At stage 1 over several
    ranks the device also keeps the whole gradient until the step (each unit is
    reduce-scattered once per step), which stage 2 streams off unit by unit instead: G bytes
    per parameter, or with gradient accumulation (``accumulation`` > 1) the micro-steps' sum
    in ``distributed.grad_accum_dtype``, 4 bytes by default (``held_grad_bytes``). ``nvme``
    (ZeRO-Infinity):
    both live on NVMe and the host holds only the pinned staging pools, sized as ``wrap`` sizes
    them (see the Note on staging pools). The step in backward (the default with NVMe) writes
    its speculative update to a second extent of the master and moments, so the NVMe figure
    adds 12 bytes per parameter of the partition for it (``VERSIONED_OPTIMIZER_BYTES``; without
    ``offload_optimizer.step_in_backward`` they are not reserved). With fp32 compute on one rank
    the params on NVMe are the master (``offload.plan.ownership``): 4 + 4 bytes of master fewer,
    and the params' own second extent (P) more. Partitioning follows the stage in every placement
    (optimizer and fp32 grads split at stage >= 1, params at stage 3), so stage 0 with offload
    means every rank keeps a full copy on its host or disk.

Note: collectives
    ``comm_per_rank`` is the textbook volume per rank and optimizer step (of
    ``accumulation`` micro-steps, 1 by default), as ``offload.dist`` counts it: params in bytes
    of the compute dtype,
    gradients in those of ``distributed.reduce_dtype`` (fp32 by default: ``reduce_dtype``).
    Stage 0 (DDP's, for comparison: offload's ranks run stages 1-3) all-reduces the gradients
    in the compute dtype (2 Psi), stages 1 and 2 reduce-scatter them and
    all-gather the updated params (2 Psi), stage 3 all-gathers every unit for its forward and
    again for its backward and reduce-scatters the gradients (3 Psi). Each extra micro-step
    adds Psi at stage 2 (a reduce-scatter) and 3 Psi at stage 3; stage 1 reduces once per
    step. One rank: 0.

Note: staging pools
    With NVMe placement each rank holds two pinned pools, ``offload_param`` and
    ``offload_optimizer``, of ``buffer_count`` x ``buffer_size`` bytes. With several ranks a
    piece never holds more than one rank's share of a unit, so "auto" sizes them for the
    largest unit divided by the ranks. The counts and the
    "auto" size come from ``offload.config`` (the very defaults ``wrap`` uses, never copied
    here): "auto" is the largest unit's bytes (in the compute dtype for params, fp32 for the
    optimizer state), rounded up to 4096, at least one IO block, at most 256 MiB
    (``offload.config.resolve_auto_buffer_size``). ``Machine.buffer_count`` /
    ``Machine.buffer_size``, when given, replace them for both pools. Those are the config's
    figures, which bound what wrap allocates: it makes the param pool's buffers no larger than
    the largest piece (``offload.homes.params``, Note on the pool's buffer size), so with a
    ``buffer_size`` above a unit's share that pool is smaller than shown. With the compute on
    the CPU the param pool also has a buffer for each piece of a unit (the pages its gathers
    lend to the unit: ``offload.device.pages``), which stands in for the unit's own memory;
    on the devices estimated here (GPUs) there are none.

Note: the documented host budget
    README "Memory: what host RAM holds": with params and optimizer state on NVMe, training grows
    the process's resident memory (over the process before the model existed) by at most the
    pool buffers + ``HOST_UNITS`` (4) x the largest unit in fp32 (the root and the unit being
    run, its grads, the next unit gathered) + ``HOST_FIXED_BYTES`` (48 MiB: interpreter objects,
    hooks, per-shard records, IO threads' arenas, allocator slack); activations come on top.
    :func:`host_memory_budget` is that sum, part by part (``offload demo`` draws it).

Note: the working set
    Units (one transformer block by default) are gathered on the device while they compute:
    ``live_units`` (the running one and the prefetched one) x unit params x P bytes whenever the
    params are partitioned (stage 3) or offloaded, plus one unit's gradients (x G bytes) while
    they stream off the device when the optimizer is offloaded. It is an estimate of the
    transient peak, reported beside the persistent model states, never mixed into them.

Note: activations (approximate)
    Per transformer layer with 2-byte activations and no tensor/sequence parallelism
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"):
    s b h (34 + 5 a s / h) bytes, where s = sequence length, b = micro-batch, h = hidden size,
    a = attention heads; the 5 a s / h term (attention scores, softmax, dropout mask) vanishes
    with a fused/flash attention kernel. With activation checkpointing only each layer's input
    is kept (2 s b h bytes per layer) plus one layer's full set during recomputation. The logits
    add about 4 b s V bytes (fp32 for the loss). Real numbers depend on the kernels, the gated
    MLP (LLaMA's is wider than 4h) and the framework's temporaries: treat it as +-30 %.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from offload.config import ConfigError, OffloadConfig, resolve_auto_buffer_size
from offload.config.sections import NVME_OPT_BUFFERS, OffloadOptimizerConfig, OffloadParamConfig
from offload.config.sizes import SIZE_UNITS
from offload.estimate.errors import EstimateError as EstimateError
from offload.estimate.hf import (
    ModelShape as ModelShape,
)
from offload.estimate.hf import (
    count_params as count_params,
)
from offload.estimate.hf import (
    embedding_params as embedding_params,
)
from offload.estimate.hf import (
    layer_params as layer_params,
)
from offload.estimate.hf import (
    load_hf_config as load_hf_config,
)
from offload.estimate.hf import (
    params_from_hf_config as params_from_hf_config,
)
from offload.estimate.hf import (
    shape_from_hf_config as shape_from_hf_config,
)
from offload.estimate.hf import (
    unknown_layout as unknown_layout,
)

GB = 10**9

STAGES: tuple[int, ...] = (0, 1, 2, 3)
PLACEMENTS: tuple[str, ...] = ("none", "cpu_optimizer", "cpu_optimizer_params", "nvme")
PLACEMENT_TITLES: dict[str, str] = {
    "none": "no offload",
    "cpu_optimizer": "optimizer on CPU",
    "cpu_optimizer_params": "optimizer+params on CPU",
    "nvme": "optimizer+params on NVMe",
}

# Bytes per parameter on the host or NVMe for an offloaded optimizer: fp32 master, m, v, grad.
OFFLOADED_OPTIMIZER_BYTES = 16
# The step in backward's second NVMe extent of fp32 master, m and v (the default with NVMe).
VERSIONED_OPTIMIZER_BYTES = 12
# The documented host budget (see the module Note): fp32 copies of the largest unit, fixed bytes.
HOST_UNITS = 4
HOST_FIXED_BYTES = 48 * 2**20


@dataclass(frozen=True, slots=True)
class HostBudget:
    """The documented bound on host memory growth with state on NVMe, part by part (bytes)."""

    buffers: int  # the pools: buffer_count x buffer_size, both sections
    units: int  # HOST_UNITS x the largest unit in fp32
    fixed: int  # HOST_FIXED_BYTES

    @property
    def total(self) -> int:
        return self.buffers + self.units + self.fixed


def host_memory_budget(buffer_bytes: int, largest_unit_params: int) -> HostBudget:
    """README "Memory: what host RAM holds" for pools of ``buffer_bytes`` and a largest unit of
    ``largest_unit_params`` parameters (see the module Note)."""
    for key, value in (
        ("buffer_bytes", buffer_bytes),
        ("largest_unit_params", largest_unit_params),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise EstimateError(f"{key}: must be an integer >= 0, got {value!r}")
    return HostBudget(buffer_bytes, HOST_UNITS * 4 * largest_unit_params, HOST_FIXED_BYTES)


@dataclass(frozen=True, slots=True)
class Precision:
    """Bytes per parameter for one compute dtype."""

    name: str
    params: int  # P: compute-dtype params on the device (bytes)
    grads: int  # G: gradients on the device (bytes)
    optimizer: int  # K: optimizer state when it lives on the device (bytes)


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision("bf16", 2, 2, 12),
    "fp16": Precision("fp16", 2, 2, 12),
    "fp32": Precision("fp32", 4, 4, 8),
}


# ---------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------

_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(value: str | int | float, *, what: str = "--params") -> int:
    """A positive count such as ``7e9``, ``7B``, ``6.7b``, ``350M`` or ``1.5T`` (decimal)."""
    if isinstance(value, bool):
        raise EstimateError(f"{what}: expected a number such as 7e9 or 7B, got {value!r}")
    if isinstance(value, int | float):
        number, scale = float(value), 1
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]?)\s*", value)
        if m is None or m.group(2).lower() not in _COUNT_SUFFIX:
            raise EstimateError(
                f"{what}: expected a number such as 7e9, 7B, 350M or 1.5T, got {value!r}"
            )
        number, scale = float(m.group(1)), _COUNT_SUFFIX[m.group(2).lower()]
    count = number * scale
    if not math.isfinite(count) or count < 1:
        raise EstimateError(f"{what}: must be a finite count >= 1, got {value!r}")
    return int(round(count))


def parse_bytes(value: str | int | float, *, what: str = "size") -> int:
    """A byte size: ``80GB`` (10**9), ``64GiB`` (2**30), ``512MB``, ``3.84TB`` or an integer.

    The units of ``offload.config.parse_size`` (MB = 10**6, MiB = 2**20, a bare K/M/G/T binary),
    but a fraction of a byte is rounded (machine sizes such as ``3.84TB`` are estimates, not
    buffer sizes).
    """
    if isinstance(value, bool):
        raise EstimateError(f"{what}: expected a size such as 80GB or 64GiB, got {value!r}")
    if isinstance(value, int | float):
        number, scale = float(value), 1
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if m is None or m.group(2).lower() not in SIZE_UNITS:
            raise EstimateError(
                f"{what}: expected a size such as 80GB, 512GB, 64GiB or 3.84TB "
                f"(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; a bare K, M, G, T is binary, as "
                f"in the config), got {value!r}"
            )
        number, scale = float(m.group(1)), SIZE_UNITS[m.group(2).lower()]
    size = number * scale
    if not math.isfinite(size) or size < 1:
        raise EstimateError(f"{what}: must be a size >= 1 byte, got {value!r}")
    return int(round(size))


# ---------------------------------------------------------------------------------------------
# the arithmetic
# ---------------------------------------------------------------------------------------------


def _split(n: int, parts: int) -> int:
    """Bytes of one partition when ``n`` bytes are split over ``parts`` ranks (padded up)."""
    return -(-n // parts)


def zero_model_state_bytes(params: int, ranks: int, stage: int, precision: str = "bf16") -> int:
    """Bytes of model state per device for a ZeRO stage with nothing offloaded (the paper's
    formula; see the module Note)."""
    prec = _precision(precision)
    return _device_states(params, ranks, stage, "none", prec)


def _precision(name: str) -> Precision:
    try:
        return PRECISIONS[name]
    except KeyError:
        raise EstimateError(
            f"--dtype: unknown compute dtype {name!r}; allowed: {', '.join(PRECISIONS)}"
        ) from None


def _check_stage(stage: int) -> None:
    if stage not in STAGES:
        raise EstimateError(f"ZeRO stage must be one of 0, 1, 2, 3, got {stage!r}")


def _device_states(
    params: int, ranks: int, stage: int, placement: str, prec: Precision, held_bytes: int = 0
) -> int:
    """``held_bytes``: per parameter, what stage 1 keeps of the gradients on the device over
    several ranks with offload (``held_grad_bytes``; 0: the compute dtype's G)."""
    _check_stage(stage)
    n_opt = ranks if stage >= 1 else 1
    n_grad = ranks if stage >= 2 else 1
    n_par = ranks if stage >= 3 else 1
    par = _split(prec.params * params, n_par)
    if placement == "none":
        return par + _split(prec.grads * params, n_grad) + _split(prec.optimizer * params, n_opt)
    # stage 1 keeps the gradients until the step (Note: offload placements)
    held = (held_bytes or prec.grads) * params if stage == 1 and ranks > 1 else 0
    if placement == "cpu_optimizer":
        return par + held
    return held


def comm_bytes(
    params: int,
    ranks: int,
    stage: int,
    precision: str = "bf16",
    reduce_dtype: str = "fp32",
    accumulation: int = 1,
) -> int:
    """Collective bytes per rank and optimizer step of ``accumulation`` micro-steps (see the
    module Note on collectives)."""
    _check_stage(stage)
    if ranks == 1:
        return 0
    p, g = _precision(precision).params, reduce_bytes(precision, reduce_dtype)
    a = _check_accumulation(accumulation)
    if stage == 0:  # DDP's all-reduce in the compute dtype (offload's ranks run stages 1-3)
        return 2 * p * params
    if stage == 1:
        return (g + p) * params
    if stage == 2:
        return (a * g + p) * params
    return a * (g + 2 * p) * params


def _check_accumulation(accumulation: int) -> int:
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise EstimateError(f"--accum: must be an integer >= 1, got {accumulation!r}")
    return accumulation


def held_grad_bytes(precision: str, accumulation: int = 1, grad_accum_dtype: str = "fp32") -> int:
    """Bytes per parameter stage 1 keeps of a step's gradients on each device over several
    ranks (module Note on offload placements): the compute dtype's ``p.grad`` for one
    micro-step; with more, their sum in ``distributed.grad_accum_dtype`` (fp32 or the compute
    dtype, "auto")."""
    prec = _precision(precision)
    a = _check_accumulation(accumulation)
    if grad_accum_dtype == "auto" or grad_accum_dtype == prec.name:
        return prec.grads
    if grad_accum_dtype == "fp32":
        return 4 if a > 1 else prec.grads
    raise EstimateError(
        f"--grad-accum-dtype {grad_accum_dtype!r}: allowed fp32, auto or the compute dtype "
        f"({prec.name}), as distributed.grad_accum_dtype"
    )


REDUCE_DTYPES = ("fp32", "bf16", "fp16", "auto")


def reduce_bytes(precision: str, reduce_dtype: str) -> int:
    """Bytes a gradient element takes in the ranks' sums (``distributed.reduce_dtype``: fp32 or
    the compute dtype, "auto")."""
    prec = _precision(precision)
    if reduce_dtype == "auto" or reduce_dtype == prec.name:
        return prec.params
    if reduce_dtype == "fp32":
        return 4
    raise EstimateError(
        f"--reduce-dtype {reduce_dtype!r}: allowed fp32, auto or the compute dtype "
        f"({prec.name}), as distributed.reduce_dtype"
    )


@dataclass(frozen=True, slots=True)
class Machine:
    """What the estimate is checked against. ``None`` limits are not checked."""

    gpus_per_node: int = 1
    nodes: int = 1
    gpu_mem: int | None = None  # bytes per device
    host_mem: int | None = None  # bytes per node
    nvme: int | None = None  # bytes of NVMe per node
    buffer_count: int | None = None  # staging buffers per pool; None: wrap's default per pool
    buffer_size: int | None = None  # bytes per staging buffer; None: wrap's "auto"

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes

    def __post_init__(self) -> None:
        for key in ("gpus_per_node", "nodes", "buffer_count", "buffer_size"):
            value = getattr(self, key)
            if value is None and key.startswith("buffer"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EstimateError(f"{key}: must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class Pool:
    """One pinned staging pool per rank (NVMe placement): ``count`` buffers of ``size`` bytes."""

    section: str  # the config section that owns it: "offload_param" or "offload_optimizer"
    count: int
    size: int  # bytes per buffer
    auto: bool  # the size is wrap's "auto" (the largest unit, at most 256 MiB)

    @property
    def nbytes(self) -> int:
        return self.count * self.size


def staging_pools(machine: Machine, unit_params: int, precision: str = "bf16") -> list[Pool]:
    """The two pools wrap allocates per rank with params and optimizer state on NVMe, with its
    defaults unless ``machine`` overrides them (see the module's Note on staging pools)."""
    prec = _precision(precision)
    if machine.ranks > 1:  # a piece holds one rank's share of a unit
        unit_params = _split(unit_params, machine.ranks)
    sections = {"offload_param": OffloadParamConfig, "offload_optimizer": OffloadOptimizerConfig}
    if machine.buffer_count is not None and machine.buffer_count < NVME_OPT_BUFFERS:
        # the NVMe row was shown for pools wrap refuses (offload_optimizer.buffer_count)
        raise EstimateError(
            f"--buffer-count {machine.buffer_count}: the NVMe optimizer pool needs at least "
            f"{NVME_OPT_BUFFERS} buffers (offload_optimizer.buffer_count); allowed: "
            f"{NVME_OPT_BUFFERS} or more"
        )
    try:
        cfg = OffloadConfig(
            **{
                name: cls(
                    buffer_count=machine.buffer_count or cls().buffer_count,
                    buffer_size=machine.buffer_size or "auto",
                )
                for name, cls in sections.items()
            }
        )
    except ConfigError as exc:  # e.g. a buffer size above 1 TiB
        raise EstimateError(f"--buffer-count / --buffer-size: {exc}") from None
    unit_bytes = {"offload_param": unit_params * prec.params, "offload_optimizer": unit_params * 4}
    return [
        Pool(
            section=name,
            count=getattr(cfg, name).buffer_count,
            size=resolve_auto_buffer_size(name, cfg, unit_bytes[name]),
            auto=getattr(cfg, name).buffer_size_is_auto,
        )
        for name in sections
    ]


@dataclass(frozen=True, slots=True)
class Activations:
    """Activation bytes per device for one micro-batch (an estimate, see the module Note)."""

    seq_len: int
    micro_batch: int
    flash_attention: bool
    without_checkpointing: int
    with_checkpointing: int
    logits: int


def activation_bytes(
    shape: ModelShape,
    seq_len: int,
    micro_batch: int,
    *,
    flash_attention: bool = False,
    dtype_bytes: int = 2,
) -> Activations:
    """Korthikanti et al. per-layer activations, with and without checkpointing, plus logits."""
    for key, value in (("--seq-len", seq_len), ("--micro-batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise EstimateError(f"{key}: must be an integer >= 1, got {value!r}")
    s, b, h, a = seq_len, micro_batch, shape.hidden_size, shape.num_heads
    scale = dtype_bytes / 2  # the formula counts 2-byte activations
    per_layer = s * b * h * 34 + (0 if flash_attention else 5 * a * s * s * b)
    per_layer = int(per_layer * scale)
    logits = 4 * b * s * shape.vocab_size
    without = shape.num_layers * per_layer + logits
    with_ckpt = int(shape.num_layers * 2 * s * b * h * scale) + per_layer + logits
    return Activations(s, b, flash_attention, without, with_ckpt, logits)


@dataclass(frozen=True, slots=True)
class Row:
    """One (stage, placement) line of the estimate. All sizes in bytes."""

    stage: int
    placement: str
    device_states: int  # persistent model state per device (the ZeRO paper's figure)
    device_working: int  # transient: gathered units and streaming grads
    device_activations: int  # 0 when not estimated
    device_total: int
    host_per_rank: int  # offloaded state + pinned buffers, per rank
    host_per_node: int
    nvme_per_rank: int
    nvme_per_node: int
    comm_per_rank: int  # collective bytes per rank and optimizer step (module Note)
    fits_device: bool | None  # None: limit not given
    fits_host: bool | None
    fits_nvme: bool | None
    fits: bool  # all given limits hold (unknown limits count as fitting)


def placement_row(
    params: int,
    stage: int,
    placement: str,
    machine: Machine,
    *,
    precision: str = "bf16",
    unit_params: int,
    live_units: int = 2,
    activations: int = 0,
    staging: list[Pool] | None = None,
    reduce_dtype: str = "fp32",
    accumulation: int = 1,
    grad_accum_dtype: str = "fp32",
) -> Row:
    """The bytes one placement needs per device, per host and on NVMe (see the module Notes).
    ``staging``: the NVMe placement's pools when the caller has them (``staging_pools``, built
    once for every row: each build says a rounded buffer size again)."""
    if placement not in PLACEMENTS:
        raise EstimateError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    prec = _precision(precision)
    ranks = machine.ranks
    n_opt = ranks if stage >= 1 else 1
    n_par = ranks if stage >= 3 else 1
    held = held_grad_bytes(precision, accumulation, grad_accum_dtype)
    states = _device_states(params, ranks, stage, placement, prec, held)
    params_gathered = stage == 3 or placement in ("cpu_optimizer_params", "nvme")
    grads_stream = placement != "none"
    working = (live_units * unit_params * prec.params if params_gathered else 0) + (
        unit_params * prec.grads if grads_stream else 0
    )
    if ranks > 1 and stage >= 1:  # two units' gradients flattened for the reduce-scatter
        working += 2 * unit_params * prec.grads
    opt_state = _split(OFFLOADED_OPTIMIZER_BYTES * params, n_opt)
    param_state = _split(prec.params * params, n_par)
    host = nvme = 0
    if placement == "cpu_optimizer":
        host = opt_state
    elif placement == "cpu_optimizer_params":
        host = opt_state + param_state
    elif placement == "nvme":
        pools = staging if staging is not None else staging_pools(machine, unit_params, precision)
        host = sum(pool.nbytes for pool in pools)
        nvme = opt_state + _split(VERSIONED_OPTIMIZER_BYTES * params, n_opt) + param_state
        if ranks == 1 and prec.name == "fp32":
            # the params are the master: no master of its own nor its second extent, the
            # params' second extent instead (offload.plan.ownership)
            nvme += param_state - 2 * 4 * params
    total = states + working + activations
    r = machine.gpus_per_node
    fits_device = None if machine.gpu_mem is None else total <= machine.gpu_mem
    fits_host = None if machine.host_mem is None else host * r <= machine.host_mem
    fits_nvme = None if machine.nvme is None else nvme * r <= machine.nvme
    fits = all(f is not False for f in (fits_device, fits_host, fits_nvme))
    return Row(
        stage=stage,
        placement=placement,
        device_states=states,
        device_working=working,
        device_activations=activations,
        device_total=total,
        host_per_rank=host,
        host_per_node=host * r,
        nvme_per_rank=nvme,
        nvme_per_node=nvme * r,
        comm_per_rank=comm_bytes(params, ranks, stage, precision, reduce_dtype, accumulation),
        fits_device=fits_device,
        fits_host=fits_host,
        fits_nvme=fits_nvme,
        fits=fits,
    )


@dataclass(slots=True)
class Estimate:
    """The full answer: inputs, assumptions and one row per (stage, placement)."""

    params: int
    params_source: str
    precision: str
    machine: Machine
    unit_params: int
    unit_source: str
    live_units: int
    activations: Activations | None
    activation_checkpointing: bool
    staging: list[Pool] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        prec = PRECISIONS[self.precision]
        return {
            "params": self.params,
            "params_source": self.params_source,
            "dtype": self.precision,
            "bytes_per_param": {
                "params": prec.params,
                "grads": prec.grads,
                "optimizer": prec.optimizer,
                "offloaded_optimizer": OFFLOADED_OPTIMIZER_BYTES,
                "versioned_optimizer_nvme": VERSIONED_OPTIMIZER_BYTES,
            },
            "machine": asdict(self.machine) | {"ranks": self.machine.ranks},
            "unit_params": self.unit_params,
            "unit_source": self.unit_source,
            "live_units": self.live_units,
            "activations": None if self.activations is None else asdict(self.activations),
            "activation_checkpointing": self.activation_checkpointing,
            "staging": [asdict(p) for p in self.staging],
            "rows": [asdict(r) for r in self.rows],
        }


def estimate(
    params: int,
    machine: Machine,
    *,
    precision: str = "bf16",
    shape: ModelShape | None = None,
    params_source: str = "--params",
    unit_params: int | None = None,
    live_units: int = 2,
    seq_len: int | None = None,
    micro_batch: int = 1,
    activation_checkpointing: bool = False,
    flash_attention: bool = False,
    reduce_dtype: str = "fp32",
    accumulation: int = 1,
    grad_accum_dtype: str = "fp32",
) -> Estimate:
    """Every stage x placement for ``params`` parameters on ``machine``.

    ``unit_params`` (the largest unit moved at once) defaults to the larger of one block and the
    root unit wrap makes (the embeddings, an untied head, the final norm) when ``shape`` is known, else to params / 32. Activations are estimated only
    when both ``shape`` and ``seq_len`` are given.
    """
    _precision(precision)
    reduce_bytes(precision, reduce_dtype)  # checked before any row
    held_grad_bytes(precision, accumulation, grad_accum_dtype)
    if isinstance(live_units, bool) or not isinstance(live_units, int) or live_units < 1:
        raise EstimateError(f"--live-units: must be an integer >= 1, got {live_units!r}")
    if unit_params is not None:
        if unit_params > params:
            raise EstimateError(
                f"--unit-params {unit_params}: the largest unit cannot hold more parameters "
                f"than the model ({params_source} {params}); allowed: 1 to {params}"
            )
        unit_source = "--unit-params"
    elif shape is not None:
        # the blocks the model has: an MoE model's dense ones, its expert ones, or both (every
        # layer dense sized its unit as an expert block, larger than the whole model)
        blocks = [layer_params(shape)] if shape.num_layers > shape.dense_layers else []
        blocks += [layer_params(shape, dense=True)] if shape.dense_layers else []
        # wrap's root unit: the embeddings with the untied head and the final norm
        unit_params = max([*blocks, embedding_params(shape)])
        unit_source = "largest block or the root (embeddings, untied head) of the config"
    else:
        unit_params = _split(params, 32)
        unit_source = "assumed params / 32 (pass --hf-config or --unit-params)"
    acts = None
    act_bytes = 0
    if shape is not None and seq_len is not None:
        dtype_bytes = 4 if precision == "fp32" else 2
        acts = activation_bytes(
            shape, seq_len, micro_batch, flash_attention=flash_attention, dtype_bytes=dtype_bytes
        )
        act_bytes = (
            acts.with_checkpointing if activation_checkpointing else acts.without_checkpointing
        )
    est = Estimate(
        params=params,
        params_source=params_source,
        precision=precision,
        machine=machine,
        unit_params=unit_params,
        unit_source=unit_source,
        live_units=live_units,
        activations=acts,
        activation_checkpointing=activation_checkpointing,
        staging=staging_pools(machine, unit_params, precision),
    )
    for stage in STAGES:
        for placement in PLACEMENTS:
            est.rows.append(
                placement_row(
                    params,
                    stage,
                    placement,
                    machine,
                    precision=precision,
                    unit_params=unit_params,
                    live_units=live_units,
                    activations=act_bytes,
                    staging=est.staging,
                    reduce_dtype=reduce_dtype,
                    accumulation=accumulation,
                    grad_accum_dtype=grad_accum_dtype,
                )
            )
    return est


def collapse_rows(rows: list[Row]) -> list[tuple[str, Row]]:
    """Rows that differ only in their stage, merged: ``(stages, row)`` in first-seen order, the
    stages written ``"0-2"`` (a run) or ``"0,3"``. With one rank ZeRO partitions nothing, so
    stages 0-2 (and for some placements 3) give the same numbers."""
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        key = tuple(v for k, v in asdict(row).items() if k != "stage")
        groups.setdefault(key, []).append(row)
    return [(_stage_label([r.stage for r in same]), same[0]) for same in groups.values()]


def _stage_label(stages: list[int]) -> str:
    stages = sorted(stages)
    if len(stages) > 1 and stages == list(range(stages[0], stages[-1] + 1)):
        return f"{stages[0]}-{stages[-1]}"
    return ",".join(str(s) for s in stages)
