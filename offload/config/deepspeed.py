"""Reading a DeepSpeed config file and mapping it onto :class:`OffloadConfig`.

Note: what maps, what does not
    DeepSpeed's ``zero_optimization.offload_param`` / ``offload_optimizer``, ``aio``,
    ``optimizer``, ``bf16`` / ``fp16``, ``gradient_clipping``, ``communication_data_type`` and
    ``data_types.grad_accum_dtype`` have offload counterparts (the table ``_MAP`` below and the
    README's mapping table). Every other key present in the file is listed in ONE warning on
    the ``offload.config`` logger, never dropped silently. A few keys are consumed without a
    warning because offload always behaves the way they ask (``_SAME_BEHAVIOUR``), e.g.
    ``aio.single_submit: false`` or ``offload_optimizer.pipeline_read``.

Note: units that differ
    DeepSpeed's ``offload_param.buffer_size`` counts ELEMENTS of the compute dtype; offload's
    counts bytes. The mapping multiplies by the element size of the mapped dtype (2 for bf16 and
    fp16, 4 for fp32) and rounds up to a multiple of 4096. ``fp16.initial_scale_power`` p becomes
    ``loss_scale.initial = 2**p``; a static ``fp16.loss_scale`` S > 0 becomes ``initial = S`` with
    growth and backoff factors 1.

Note: gradient accumulation
    ``gradient_accumulation_steps`` maps as is, but offload's key only says which backward is a
    step's last (for the step in backward). DeepSpeed's ``engine.backward`` divides the loss by
    it and ``engine.step()`` updates only at every N-th call; offload's ``optimizer.step()``
    updates at every call and the loss is the caller's, so a DeepSpeed loop translated call for
    call would step every micro-batch and clip the sum instead of the mean (logged at INFO and
    in the README's table).

Note: numbers written as strings
    DeepSpeed validates ``zero_optimization`` (its offload sections included) with a pydantic
    model in lax mode, which takes an integer written as a string where an integer goes
    (``"stage": "3"``, ``" 7 "``; not ``"1e4"`` or ``"1.5"``): DeepSpeed 0.19.8 trains at
    stage 3 there. The mapping does the same in that section (``_lax_number``; not for
    ``nvme_path``, a directory that may be named "123").
    Elsewhere DeepSpeed reads values as they are (``optimizer.params`` go to the optimizer's
    constructor, ``aio`` to the native engine), where a string fails, so a string stays a
    string here too and is refused with its DeepSpeed key.

Note: defaults and "auto"
    A key absent from the DeepSpeed file takes offload's default, not DeepSpeed's (so
    ``pin_memory`` defaults to true). One exception follows DeepSpeed's meaning: with neither
    ``bf16`` nor ``fp16`` enabled the dtype is fp32. ``"auto"`` values (written by the Hugging
    Face Trainer's templates, which fill them in from its own arguments) also take offload's
    defaults; they are listed in one INFO line. An unsupported key set to "auto" is not warned
    about: nothing was asked of it.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from offload.config._checks import as_bool, as_float, as_int
from offload.config.errors import ConfigError, _show, dotted_key
from offload.config.offload_config import OffloadConfig

logger = logging.getLogger("offload.config")

# Top-level keys that only DeepSpeed configs have (any one marks a DeepSpeed config).
DEEPSPEED_MARKERS = frozenset(
    {
        "zero_optimization",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "bf16",
        "bfloat16",
        "fp16",
        "amp",
        "steps_per_print",
        "wall_clock_breakdown",
        "scheduler",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "activation_checkpointing",
        "flops_profiler",
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comms_logger",
        "communication_data_type",
        "prescale_gradients",
        "gradient_predivide_factor",
        "sparse_gradients",
        "data_types",
        "checkpoint",
        "elasticity",
        "compression_training",
        "memory_breakdown",
        "dump_state",
        "seq_parallel_communication_data_type",
    }
)
# Top-level keys that only offload configs have (refused inside a DeepSpeed config).
OFFLOAD_ONLY = frozenset(
    {
        "device",
        "dtype",
        "offload_optimizer",
        "offload_param",
        "prefetch",
        "loss_scale",
        "wrap",
        "telemetry",
    }
)

_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
_ALIGN = 4096

# DeepSpeed key -> the value offload always behaves as (None: any value is honoured as is).
_SAME_BEHAVIOUR: dict[str, Any] = {
    "zero_optimization.offload_optimizer.pipeline_read": None,  # the step is always pipelined
    "zero_optimization.offload_optimizer.pipeline_write": None,
    "zero_optimization.offload_optimizer.pipeline": None,
    "zero_optimization.offload_optimizer.ratio": 1.0,
    "optimizer.params.adam_w_mode": None,  # read when choosing adam/adamw
    "optimizer.params.torch_adam": None,  # offload always uses its own CPU Adam
    "optimizer.params.amsgrad": False,
    "fp16.hysteresis": 1,
    "fp16.consecutive_hysteresis": False,
    "aio.single_submit": False,
    "aio.overlap_events": True,
    "aio.use_gds": False,
}
# Hints shown next to unsupported keys in the warning.
_HINTS = {
    "zero_optimization.stage3_prefetch_bucket_size": "use prefetch.depth, counted in units",
    "zero_optimization.sub_group_size": "use offload_optimizer.buffer_size, in bytes",
    "zero_optimization.stage3_max_live_parameters": "use offload_param.buffer_count",
    "zero_optimization.offload_param.max_in_cpu": "use offload_param.device",
}


@dataclass(kw_only=True, slots=True)
class DeepSpeedMapping:
    """The result of mapping a DeepSpeed config: the config and what was left out."""

    config: OffloadConfig
    """The mapped, validated config."""
    unsupported: list[str] = field(default_factory=list)
    """Dotted DeepSpeed keys present in the file that offload ignores (with hints)."""
    auto: list[str] = field(default_factory=list)
    """Dotted DeepSpeed keys whose value was "auto" (offload's default used)."""


def is_deepspeed_config(data: Mapping[str, Any]) -> bool:
    """Whether a dict looks like a DeepSpeed config rather than an offload config."""
    if any(k in DEEPSPEED_MARKERS for k in data):
        return True
    opt = data.get("optimizer")
    return isinstance(opt, Mapping) and "params" in opt


def from_deepspeed(data: Mapping[str, Any]) -> OffloadConfig:
    """Map a DeepSpeed config dict onto :class:`OffloadConfig`; unsupported keys are listed in
    one warning and "auto" values in one INFO line (both on the ``offload.config`` logger)."""
    result = map_deepspeed(data)
    if result.unsupported:
        logger.warning(
            "DeepSpeed config: %d key(s) not supported by offload are ignored: %s",
            len(result.unsupported),
            "; ".join(result.unsupported),
        )
    if result.auto:
        logger.info(
            'DeepSpeed config: "auto" values take offload\'s defaults: %s', ", ".join(result.auto)
        )
    steps = result.config.gradient_accumulation_steps
    if isinstance(steps, int) and steps > 1:
        logger.info(GAS_NOTE, steps, steps, steps)
    return result.config


GAS_NOTE = (
    "DeepSpeed config: gradient_accumulation_steps=%d tells offload which backward is a step's "
    "last; unlike DeepSpeed's engine, offload neither divides the loss by it nor skips "
    "optimizer.step() calls between boundaries: divide the loss by %d and call "
    "optimizer.step() once every %d backwards"
)


def map_deepspeed(data: Mapping[str, Any]) -> DeepSpeedMapping:
    """Map without logging; see :func:`from_deepspeed`."""
    mixed = [k for k in data if k in OFFLOAD_ONLY]
    if mixed:
        marker = _first_marker(data)
        why = (
            f"found DeepSpeed keys such as {marker!r}"
            if marker
            else "it was read as one, as asked (deepspeed=True, `--deepspeed`), and has no "
            "DeepSpeed key"
        )
        raise ConfigError(
            f"{mixed[0]}: offload key in a DeepSpeed config ({why}); allowed: one format per "
            "file (convert with `offload config FILE`, which prints offload's format)",
            key=mixed[0],
            value=data[mixed[0]],
            allowed="DeepSpeed keys only",
        )
    m = _Mapper()
    if "bf16" in data and "bfloat16" in data:  # both mapped, the last in the file won
        m.unsupported.append(
            "bfloat16 (DeepSpeed's older name of bf16, which it reads only where bf16 is "
            "absent: bf16 is used)"
        )
        data = {k: v for k, v in data.items() if k != "bfloat16"}
    m.walk("", data, _MAP)
    out, origin = m.finish()
    try:
        config = OffloadConfig.from_dict(out)
    except ConfigError as exc:
        ds_key = origin.get(exc.key or "") or _default_origin(exc.key or "")
        if ds_key and ds_key != exc.key:
            raise exc.renamed(ds_key, f"(DeepSpeed key; offload's {exc.key})") from None
        raise
    return DeepSpeedMapping(config=config, unsupported=m.unsupported, auto=m.auto)


# Where an offload key would have come from in a DeepSpeed file (for errors about keys the file
# did not set, e.g. a missing nvme_path).
_DEFAULT_ORIGIN = {
    "offload_param.": "zero_optimization.offload_param.",
    "offload_optimizer.": "zero_optimization.offload_optimizer.",
    "optimizer.": "optimizer.params.",
}


def _default_origin(key: str) -> str | None:
    for ours, theirs in _DEFAULT_ORIGIN.items():
        if key.startswith(ours) and key != "optimizer.type":
            return theirs + key[len(ours) :]
    return None


def _did_you_mean(key: Any, table: Mapping[str, Any]) -> str | None:
    close = difflib.get_close_matches(str(key), list(table), n=1, cutoff=0.8)
    return f"did you mean {close[0]}?" if close else None


def _first_marker(data: Mapping[str, Any]) -> str | None:
    """The first key that makes ``data`` DeepSpeed's (``is_deepspeed_config``); None where it
    has none (read as DeepSpeed's because the caller said so)."""
    found = next((k for k in data if k in DEEPSPEED_MARKERS), None)
    opt = data.get("optimizer")
    if found is None and isinstance(opt, Mapping) and "params" in opt:
        found = "optimizer.params"
    return found


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


_INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*")


def _lax_number(ds_key: str, value: Any) -> Any:
    """An integer written as a string in ``zero_optimization`` as the integer (the Note:
    numbers written as strings); any other value as it is."""
    if not ds_key.startswith("zero_optimization.") or ds_key.endswith("nvme_path"):
        return value
    if isinstance(value, str) and _INTEGER.fullmatch(value):
        return int(value)
    return value


class _Mapper:
    """Walks the DeepSpeed dict against ``_MAP``, collecting offload keys and leftovers."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}  # offload dotted key -> value
        self.origin: dict[str, str] = {}  # offload dotted key -> DeepSpeed dotted key
        self.raw: dict[str, Any] = {}  # DeepSpeed dotted key -> value, for deferred mapping
        self.unsupported: list[str] = []
        self.auto: list[str] = []

    def put(self, ours: str, ds_key: str, value: Any) -> None:
        self.values[ours] = value
        self.origin[ours] = ds_key

    def walk(self, prefix: str, data: Any, table: Mapping[str, Any]) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError.bad(
                prefix.rstrip(".") or "<config>", data, "a mapping (DeepSpeed section)"
            )
        for key, value in data.items():
            ds_key = dotted_key(prefix, key)
            rule = table.get(key)
            if _is_auto(value):
                self.auto.append(ds_key)
                continue
            value = _lax_number(ds_key, value)
            if isinstance(rule, dict):
                self.walk(ds_key + ".", value, rule)
            elif isinstance(rule, str):
                self.put(rule, ds_key, value)
            elif callable(rule):
                rule(self, ds_key, value)
            elif ds_key in _SAME_BEHAVIOUR:
                expected = _SAME_BEHAVIOUR[ds_key]
                if expected is not None and value != expected:
                    self.unsupported.append(f"{ds_key}={_show(value)} (offload: {expected!r})")
                else:
                    self.raw[ds_key] = value
            else:
                hint = _HINTS.get(ds_key) or _did_you_mean(key, table)
                self.unsupported.append(f"{ds_key} ({hint})" if hint else ds_key)

    def finish(self) -> tuple[dict[str, Any], dict[str, str]]:
        self._finish_dtype()
        self._finish_optimizer_type()
        self._finish_loss_scale()
        self._finish_buffer_size()
        self._check_stage()
        out: dict[str, Any] = {}
        for dotted, value in self.values.items():
            head, _, tail = dotted.partition(".")
            if tail:
                out.setdefault(head, {})[tail] = value
            else:
                out[head] = value
        return out, self.origin

    def _check_stage(self) -> None:
        key = "zero_optimization.stage"
        if key in self.raw:
            stage = as_int(key, self.raw[key], lo=0, hi=3, what="ZeRO stage")
            if stage == 0:  # offload always shards the optimizer state across ranks
                logger.info(
                    "DeepSpeed config: %s=0 runs as distributed.stage 1 (offload always "
                    "partitions the fp32 master and moments across ranks; the training is the "
                    "same data parallel)",
                    key,
                )
            self.put("distributed.stage", key, max(stage, 1))

    def _finish_dtype(self) -> None:
        enabled = {}
        # the section's older name, which map_deepspeed keeps only where bf16 is absent
        bf16 = "bfloat16.enabled" if "bfloat16.enabled" in self.raw else "bf16.enabled"
        for name, key in (("bf16", bf16), ("fp16", "fp16.enabled")):
            if key in self.raw:
                enabled[name] = as_bool(key, self.raw[key])
        if enabled.get("bf16") and enabled.get("fp16"):
            raise ConfigError.bad(
                "fp16.enabled", True, f"false when {bf16} is true (one compute dtype)"
            )
        auto = any(k in self.auto for k in ("bf16.enabled", "bfloat16.enabled", "fp16.enabled"))
        if enabled.get("bf16"):
            self.put("dtype", bf16, "bf16")
        elif enabled.get("fp16"):
            self.put("dtype", "fp16.enabled", "fp16")
        elif not auto or enabled.get("bf16") is False:
            # DeepSpeed: no mixed precision section on. Also bf16 said off beside an fp16
            # "auto" (offload cannot know what the Trainer would fill in): offload's default
            # dtype, bf16, would be the one said off
            self.put("dtype", bf16, "fp32")

    def _finish_optimizer_type(self) -> None:
        if "optimizer.type" not in self.raw:
            return
        value = self.raw["optimizer.type"]
        name = value.strip().lower() if isinstance(value, str) else None
        if name == "adam":
            w_mode = self.raw.get("optimizer.params.adam_w_mode", True)
            w_mode = as_bool("optimizer.params.adam_w_mode", w_mode)
            self.put("optimizer.type", "optimizer.type", "adamw" if w_mode else "adam")
        elif name == "adamw":
            self.put("optimizer.type", "optimizer.type", "adamw")
        else:
            raise ConfigError.bad(
                "optimizer.type",
                value,
                "'Adam' (AdamW unless params.adam_w_mode is false) or 'AdamW'; offload runs its "
                "own CPU Adam only",
            )

    def _finish_loss_scale(self) -> None:
        static = self.raw.get("fp16.loss_scale", 0)
        # finite: NaN would pass every < / > test below and mean "dynamic" by accident
        static_f = as_float(
            "fp16.loss_scale", static, lo=0.0, what="0 = dynamic, else a static scale"
        )
        if static_f > 0:
            self.put("loss_scale.initial", "fp16.loss_scale", static_f)
            self.put("loss_scale.growth_factor", "fp16.loss_scale", 1.0)
            self.put("loss_scale.backoff_factor", "fp16.loss_scale", 1.0)
            self.put("loss_scale.min_scale", "fp16.loss_scale", min(static_f, 1.0))
        elif "fp16.initial_scale_power" in self.raw:
            power = as_int(
                "fp16.initial_scale_power",
                self.raw["fp16.initial_scale_power"],
                lo=0,
                hi=126,
                what="the initial scale is 2**power",
            )
            self.put("loss_scale.initial", "fp16.initial_scale_power", float(2**power))

    def _finish_buffer_size(self) -> None:
        key = "zero_optimization.offload_param.buffer_size"
        if key not in self.raw:
            return
        dtype = self.values.get("dtype", OffloadConfig().dtype)
        elements = as_int(key, self.raw[key], lo=1, what="elements of the compute dtype")
        nbytes = elements * _ITEMSIZE[dtype]
        self.put("offload_param.buffer_size", key, -(-nbytes // _ALIGN) * _ALIGN)


def _keep(mapper: _Mapper, ds_key: str, value: Any) -> None:
    """Keep the raw value for a mapping that needs other keys first (see ``_Mapper.finish``)."""
    mapper.raw[ds_key] = value


def _optimizer_device(mapper: _Mapper, ds_key: str, value: Any) -> None:
    if isinstance(value, str) and value.strip().lower() == "none":
        mapper.unsupported.append(
            f"{ds_key}='none' (the optimizer step always runs on the CPU here; mapped to 'cpu')"
        )
        return
    mapper.put("offload_optimizer.device", ds_key, value)


def _thread_count(mapper: _Mapper, ds_key: str, value: Any) -> None:
    if "aio.thread_count" in mapper.values and ds_key == "aio.thread_count":
        return  # intra_op_parallelism (the newer name) wins
    mapper.put("aio.thread_count", ds_key, value)


_Rule = str | Callable[[_Mapper, str, Any], None] | dict[str, Any]

_MAP: dict[str, _Rule] = {
    "zero_optimization": {
        "stage": _keep,
        "stage3_param_persistence_threshold": "offload_param.persistence_threshold",
        "offload_param": {
            "device": "offload_param.device",
            "nvme_path": "offload_param.nvme_path",
            "pin_memory": "offload_param.pin_memory",
            "buffer_count": "offload_param.buffer_count",
            "buffer_size": _keep,  # elements -> bytes once the dtype is known
        },
        "offload_optimizer": {
            "device": _optimizer_device,
            "nvme_path": "offload_optimizer.nvme_path",
            "pin_memory": "offload_optimizer.pin_memory",
            "buffer_count": "offload_optimizer.buffer_count",
        },
    },
    "optimizer": {
        "type": _keep,
        "params": {
            "lr": "optimizer.lr",
            "betas": "optimizer.betas",
            "eps": "optimizer.eps",
            "weight_decay": "optimizer.weight_decay",
            "bias_correction": "optimizer.bias_correction",
        },
    },
    "bf16": {"enabled": _keep},
    "fp16": {
        "enabled": _keep,
        "loss_scale": _keep,
        "initial_scale_power": _keep,
        "loss_scale_window": "loss_scale.growth_interval",
        "min_loss_scale": "loss_scale.min_scale",
    },
    "gradient_clipping": "gradient_clipping",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "communication_data_type": "distributed.reduce_dtype",
    "data_types": {"grad_accum_dtype": "distributed.grad_accum_dtype"},
    "aio": {
        "block_size": "aio.block_size",
        "queue_depth": "aio.queue_depth",
        "thread_count": _thread_count,
        "intra_op_parallelism": "aio.thread_count",
    },
}
_MAP["bfloat16"] = {"enabled": _keep}  # bf16's older name (_finish_dtype)
