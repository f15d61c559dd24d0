"""Field checks shared by the config sections: each returns the normalized value or raises.

Note: what counts as which type
    - bool: ``True``/``False`` only. Strings such as ``"yes"`` are refused (YAML's unquoted
      ``yes``/``no`` already arrive as booleans).
    - int: an ``int`` or an integral ``float`` (``1e5`` in JSON); never a bool, never a string.
    - float: an ``int`` or ``float``, finite; never a bool, never a string (YAML's ``1e-4`` is
      read as a float by offload's YAML loader, see ``loader.py``).
    - choice: a string matched case-insensitively against the allowed names and their aliases;
      the canonical name is stored.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from offload.config.errors import ConfigError
from offload.config.sizes import AutoSize, format_size, is_auto, parse_bytes, round_up

logger = logging.getLogger("offload.config")

_INT_MAX = 2**62


def as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError.bad(key, value, "true or false (a boolean, not a string)")


def _range_text(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {_number(lo)}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {_number(hi)}")
    return " and ".join(parts)


def _number(x: float) -> str:
    """A bound as written: an integer in full (1048576, not 1.04858e+06), else ``:g``."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def as_int(
    key: str, value: Any, *, lo: int | None = None, hi: int | None = None, what: str = ""
) -> int:
    """An integer in [lo, hi]; ``what`` is a short phrase about its meaning and unit."""
    rng = _range_text(lo, hi, False, False)
    allowed = " ".join(x for x in ("an integer", rng, f"({what})" if what else "") if x)
    if isinstance(value, bool):
        raise ConfigError.bad(key, value, allowed)
    if isinstance(value, float) and value.is_integer() and abs(value) < _INT_MAX:
        value = int(value)
    if not isinstance(value, int):
        raise ConfigError.bad(key, value, allowed)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ConfigError.bad(key, value, allowed)
    return value


def as_float(
    key: str,
    value: Any,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
    what: str = "",
) -> float:
    """A finite float in the given range (open or closed at each end)."""
    rng = _range_text(lo, hi, lo_open, hi_open)
    allowed = " ".join(x for x in ("a finite number", rng, f"({what})" if what else "") if x)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError.bad(key, value, allowed)
    try:
        out = float(value)
    except OverflowError:  # an int beyond the float range
        raise ConfigError.bad(key, value, allowed) from None
    if not math.isfinite(out):
        raise ConfigError.bad(key, value, allowed)
    if lo is not None and (out <= lo if lo_open else out < lo):
        raise ConfigError.bad(key, value, allowed)
    if hi is not None and (out >= hi if hi_open else out > hi):
        raise ConfigError.bad(key, value, allowed)
    return out


def as_choice(key: str, value: Any, choices: Mapping[str, Iterable[str]]) -> str:
    """One of ``choices`` (canonical name -> aliases), matched case-insensitively."""
    names = ", ".join(repr(c) for c in choices)
    hint = ""
    if isinstance(value, str):
        low = value.strip().lower()
        for canonical, aliases in choices.items():
            if low == canonical or low in aliases:
                return canonical
        every = [*choices, *(a for aliases in choices.values() for a in aliases)]
        close = difflib.get_close_matches(low, every, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError.bad(key, value, f"one of {names}{hint}")


def _size_rule(lo: int, hi: int | None, align: int, what: str) -> str:
    """What a size key allows, in words (one clause per rule)."""
    bounds = ["> 0" if lo == 1 else f">= {lo}"] if lo else []
    if hi is not None:
        bounds.append(f"<= {hi} ({format_size(hi)})")
    text = "a byte count" + (" " + " and ".join(bounds) if bounds else "")
    if align > 1:
        text += f", rounded up to a multiple of {align} bytes (the O_DIRECT alignment)"
    text += (
        "; an integer, 1e8, or a string such as '16MB' (10**6), '16MiB' (2**20) or '4k' (binary)"
    )
    return text + (f"; {what}" if what else "")


def as_size(
    key: str, value: Any, *, lo: int = 0, hi: int | None = None, align: int = 1, what: str = ""
) -> int:
    """Bytes (see ``sizes.py``), at least ``lo``, rounded up to a multiple of ``align``, and then
    at most ``hi``. A rounding is logged (INFO, ``offload.config``) and the value stored is the
    rounded one, so ``offload config`` shows it."""
    nbytes, problem = parse_bytes(value)
    rule = _size_rule(lo, hi, align, what)
    if nbytes is None:
        raise ConfigError.bad(key, value, rule + (f"; {problem}" if problem else ""))
    rounded = round_up(nbytes, align)
    if nbytes < lo:
        raise ConfigError.bad(key, value, rule)
    if hi is not None and rounded > hi:
        why = f"{nbytes} bytes" + (f" rounds up to {rounded}" if rounded != nbytes else "")
        raise ConfigError.bad(key, value, f"{rule}; {why}, above the maximum")
    if rounded != nbytes:
        written = repr(value) + ("" if type(value) is int else f" is {nbytes} bytes")
        logger.info(
            "%s: %s, rounded up to %d (%s), a multiple of %d (the O_DIRECT alignment)",
            key, written, rounded, format_size(rounded), align,
        )  # fmt: skip
    return rounded


def as_buffer_size(key: str, value: Any, *, cap: int, lo: int, hi: int, align: int) -> int:
    """A swap buffer size: ``"auto"`` (an :class:`AutoSize` of at most ``cap`` bytes, sized to
    the model at wrap) or a byte size as :func:`as_size` takes it."""
    if is_auto(value):
        return AutoSize(cap)
    return as_size(
        key,
        value,
        lo=lo,
        hi=hi,
        align=align,
        what=f"or 'auto' (the default: the largest unit's size, at most {format_size(cap)})",
    )


def as_opt_path(key: str, value: Any) -> str | None:
    """``None`` or a non-empty path string (``os.PathLike`` accepted, stored as ``str``), made
    absolute once, here: a leading ``~`` expanded to the home directory as a shell would
    (``nvme_path: ~/nvme`` made a directory named ``~`` in the working directory, which a later
    ``rm -rf ~`` would not clean), then a relative path joined to the working directory of the
    moment the config is read. The stores and the telemetry reopen their files by this path at
    every step: kept relative, an ``os.chdir()`` between steps (a notebook's ``%cd``) sent the
    next swap read to another directory, failed the step and left the swap behind at close."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and value.strip() and "\0" not in value:
        value = os.path.expanduser(value)
        # not os.path.abspath: its normpath folds "link/.." to "." where the kernel follows link
        return value if os.path.isabs(value) else str(Path.cwd() / value)
    raise ConfigError.bad(key, value, "null or a non-empty path string")


def as_betas(key: str, value: Any) -> tuple[float, float]:
    allowed = "two numbers, each in [0, 1) (Adam's moment decay rates), e.g. [0.9, 0.999]"
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError.bad(key, value, allowed)
    out = []
    for b in value:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
            raise ConfigError.bad(key, value, allowed)
        out.append(float(b))
    return (out[0], out[1])


_DOTTED_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def as_pattern_list(key: str, value: Any) -> list[str]:
    """A list of regular expressions (each compiled here, so a bad one is named now)."""
    allowed = "a list of regular expressions on parameter names, e.g. ['bias', 'norm']"
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError.bad(key, value, allowed)
    out = []
    for pattern in value:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError.bad(key, value, allowed)
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError.bad(key, value, f"{allowed} ({pattern!r}: {e})") from None
        if pattern not in out:
            out.append(pattern)
    return out


GROUP_VALUES = ("lr", "betas", "eps", "weight_decay")
"""What a group of ``optimizer.param_groups`` may give its parameters."""


def as_group_list(key: str, value: Any) -> list[dict]:
    """Param groups by name: each a mapping with ``params`` (regular expressions on parameter
    names, :func:`as_pattern_list`), an optional ``name`` (a label) and any of
    ``GROUP_VALUES``, each checked as the optimizer section's own key is."""
    allowed = (
        "a list of groups, each {params: [regular expressions on parameter names], and any of "
        "name, lr, betas, eps, weight_decay}, e.g. [{params: ['lm_head'], lr: 1e-4}]"
    )
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
        raise ConfigError.bad(key, value, allowed)
    out = []
    for i, group in enumerate(value):
        at = f"{key}[{i}]"
        if not isinstance(group, Mapping) or "params" not in group:
            raise ConfigError.bad(at, group, allowed)
        extra = [k for k in group if k not in ("params", "name", *GROUP_VALUES)]
        if extra:
            raise ConfigError.bad(
                f"{at}.{extra[0]}", group[extra[0]], "keys params, name, " + ", ".join(GROUP_VALUES)
            )
        params = as_pattern_list(f"{at}.params", group["params"])
        if not params:
            raise ConfigError.bad(f"{at}.params", group["params"], "at least one pattern")
        checked: dict[str, Any] = {"params": params}
        if "name" in group:
            if not isinstance(group["name"], str):
                raise ConfigError.bad(f"{at}.name", group["name"], "a string (the group's label)")
            checked["name"] = group["name"]
        if "lr" in group:
            checked["lr"] = as_float(f"{at}.lr", group["lr"], lo=0.0, lo_open=True)
        if "betas" in group:
            checked["betas"] = list(as_betas(f"{at}.betas", group["betas"]))  # (JSON, YAML)
        if "eps" in group:
            checked["eps"] = as_float(f"{at}.eps", group["eps"], lo=0.0, lo_open=True)
        if "weight_decay" in group:
            checked["weight_decay"] = as_float(f"{at}.weight_decay", group["weight_decay"], lo=0.0)
        out.append(checked)
    return out


def as_name_list(key: str, value: Any) -> list[str]:
    allowed = "a list of class names, e.g. ['LlamaDecoderLayer'] or ['my_pkg.model.Block']"
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ConfigError.bad(key, value, allowed)
    out = []
    for name in value:
        if not isinstance(name, str) or not _DOTTED_NAME.match(name):
            raise ConfigError.bad(key, value, allowed)
        if name not in out:
            out.append(name)
    return out
