"""``OffloadConfig``: the whole config, built from a plain dict and turned back into one.

Note: unknown keys
    DeepSpeed ignores keys it does not know, so a typo (``"offload_optimzer"``) runs for days
    with the default. Here every key of every section must be a known field; otherwise the error
    names the dotted key and suggests the closest known one (``difflib``), or the section that
    owns a field of that name (``lr`` at the top level -> ``optimizer.lr``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from offload.config._checks import as_choice, as_float, as_int
from offload.config.errors import ConfigError, dotted_key
from offload.config.sections import (
    SECTIONS,
    AioConfig,
    DistributedConfig,
    LossScaleConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    PrefetchConfig,
    TelemetryConfig,
    WrapConfig,
    _Section,
)
from offload.config.sizes import AutoSize

DTYPES: dict[str, tuple[str, ...]] = {
    "fp32": ("float32", "float", "torch.float32"),
    "bf16": ("bfloat16", "torch.bfloat16"),
    "fp16": ("float16", "half", "torch.float16"),
}
_CUDA_N = re.compile(r"^cuda:(0|[1-9][0-9]{0,3})$")
_DEVICE_HELP = "'auto', 'cpu', 'cuda' or 'cuda:N' with N a device index >= 0 (e.g. 'cuda:0')"


def _check_device(key: str, value: Any) -> str:
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("auto", "cpu", "cuda") or _CUDA_N.match(low):
            return low
    raise ConfigError.bad(key, value, _DEVICE_HELP)


@dataclass(kw_only=True, slots=True)
class OffloadConfig:
    """Everything ``offload.wrap`` needs to know: the compute device and dtype, the optimizer,
    where parameters and optimizer state live and how they move. Build it with
    :func:`offload.load_config` (dict, JSON, YAML or a DeepSpeed config) or directly.
    """

    device: str = "auto"
    """Compute device: "auto" (cuda:0 when CUDA is available, else cpu), "cpu", "cuda", "cuda:N"."""
    dtype: str = "bf16"
    """Compute dtype of parameters, activations and gradients: "fp32", "bf16" or "fp16"."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The CPU optimizer and its hyperparameters."""
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    """Where fp32 master weights, gradients and Adam moments live."""
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    """Where compute-dtype parameters live while unused."""
    aio: AioConfig = field(default_factory=AioConfig)
    """The async NVMe IO engine."""
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    """How far ahead units are fetched."""
    gradient_clipping: float = 0.0
    """Clip gradients to this global L2 norm before the step (>= 0; 0 = off)."""
    gradient_accumulation_steps: int | str = "auto"
    """Backwards per optimizer step (count >= 1): the last one is where the step in backward
    updates each unit; fewer before optimizer.step() is fine; more is an error where the step
    in backward updates (the NVMe optimizer's default), and fine where the update runs after
    the backward. "auto": the first step counts them (its update runs after its backwards)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling: with dtype "fp16", or asked for (fp16 autocast over fp32)."""
    wrap: WrapConfig = field(default_factory=WrapConfig)
    """Which modules form offload units."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """Per-step counters output."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """ZeRO stage, gradient reduce dtype and collective timeout across the ranks of a process
    group."""

    def __post_init__(self) -> None:
        self.device = _check_device("device", self.device)
        self.dtype = as_choice("dtype", self.dtype, DTYPES)
        self.gradient_clipping = as_float(
            "gradient_clipping", self.gradient_clipping, lo=0.0, what="max global L2 norm; 0 = off"
        )
        if self.gradient_accumulation_steps != "auto":
            self.gradient_accumulation_steps = as_int(
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
                lo=1,
                hi=1 << 20,
                what='backwards per optimizer step, or "auto"',
            )
        for f in dataclasses.fields(self):
            cls = _SECTION_TYPES.get(f.name)
            if cls is None:
                continue
            value = getattr(self, f.name)
            if value is None:
                setattr(self, f.name, cls())
            elif isinstance(value, Mapping):
                setattr(self, f.name, _build_section(cls, value))
            elif not isinstance(value, cls):
                raise ConfigError.bad(
                    f.name,
                    value,
                    f"a mapping of {f.name} keys "
                    f"({', '.join(_field_names(cls))}) or {cls.__name__}",
                )
        self._check_reduce_dtype()
        if self.dtype == "fp16" and self.loss_scale.enabled is False:
            raise ConfigError.bad(
                "loss_scale.enabled",
                False,
                '"auto" or true with dtype "fp16" (its gradients underflow unscaled; a static '
                "scale is growth_factor = backoff_factor = 1)",
            )

    def _check_reduce_dtype(self) -> None:
        """The gradients are summed (across ranks, and stage 1's micro-steps) in fp32 or in the
        compute dtype: the compute dtype's gradients summed in another 16-bit dtype would only
        lose range (bf16 into fp16, with no loss scale to keep them in it) or precision (fp16
        or fp32 into bf16)."""
        dist = self.distributed
        for key, resolved in (
            ("reduce_dtype", dist.resolve_reduce_dtype(self.dtype)),
            ("grad_accum_dtype", dist.resolve_grad_accum_dtype(self.dtype)),
        ):
            if resolved not in ("fp32", self.dtype):
                raise ConfigError.bad(
                    f"distributed.{key}",
                    getattr(dist, key),
                    f"'fp32', 'auto' or the compute dtype (dtype is {self.dtype!r})",
                )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> OffloadConfig:
        """Build and validate from a plain dict in offload's own format (see ``load_config`` for
        files and DeepSpeed configs). Missing keys take their defaults."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError.bad("<config>", data, "a mapping of config sections")
        _reject_unknown("", data, _field_names(cls))
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            section = _SECTION_TYPES.get(name)
            kwargs[name] = _build_section(section, value) if section is not None else value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The normalized config as plain JSON-able values (sizes in bytes, "auto" sizes as
        ``"auto"``, betas as a list); ``OffloadConfig.from_dict(cfg.to_dict()) == cfg``."""
        return _plain(self)


_SECTION_TYPES: dict[str, type[_Section]] = {s.KEY: s for s in SECTIONS}


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _reject_unknown(prefix: str, data: Mapping[str, Any], allowed: list[str]) -> None:
    for key in data:
        if key in allowed:
            continue
        dotted = dotted_key(prefix, key)
        if not isinstance(key, str):
            raise ConfigError.bad(dotted, key, f"string keys: {', '.join(allowed)}")
        hint = ""
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        if close:
            hint = f"did you mean '{prefix}{close[0]}'? "
        else:
            owners = [s.KEY for s in SECTIONS if key in _field_names(s)]
            if not prefix and owners:
                hint = f"did you mean '{owners[0]}.{key}'? "
        raise ConfigError(
            f"{dotted}: unknown key; {hint}allowed: {', '.join(allowed)}",
            key=dotted,
            value=key,
            allowed=", ".join(allowed),
        )


def _build_section(cls: type[_Section], value: Any) -> _Section:
    if value is None:
        return cls()
    if isinstance(value, cls):
        return dataclasses.replace(value)  # validates again
    names = _field_names(cls)
    if not isinstance(value, Mapping):
        raise ConfigError.bad(cls.KEY, value, f"a mapping with keys {', '.join(names)}")
    _reject_unknown(cls.KEY + ".", value, names)
    return cls(**value)


def _plain(obj: Any) -> Any:
    if isinstance(obj, AutoSize):
        return "auto"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    return obj
