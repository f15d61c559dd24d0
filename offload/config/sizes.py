"""Byte sizes written by people: ``4096``, ``"256MB"``, ``"1GiB"``, ``"4k"``, ``1e8``, ``"1e8"``.

Note: units
    A size is a non-negative integer number of bytes, or a string ``<number><unit>`` with
    optional spaces between. Units are case-insensitive:

    - ``B`` or none: bytes;
    - ``KB MB GB TB``: decimal, 10**3, 10**6, 10**9, 10**12 (as disk vendors and the SI use them);
    - ``KiB MiB GiB TiB``: binary, 2**10, 2**20, 2**30, 2**40;
    - ``K M G T`` (no ``B``): binary, as ``dd``, ``fio`` and ``ulimit`` read them, so ``"4k"``
      is 4096.

    The number may have a fraction and an exponent (``"1.5GiB"``, ``"1e8"``, ``"2.5e3MB"``) when
    the result is a whole number of bytes; it is computed exactly (``fractions.Fraction``), never
    through a binary float. Floats are accepted only when integral (``1e8`` from a JSON file).
    There are no bit units, and booleans are not sizes. Whether a size may be zero, how large
    it may be and whether it is rounded up to an alignment is the caller's business
    (``offload.config._checks.as_size``).

Note: bounded work
    The text of a number is limited to ``_MAX_NUMBER_CHARS`` characters and its exponent to
    ``_MAX_EXPONENT``, so a config cannot make the parser build a gigantic integer
    (``"1e999999999"`` is refused at once, not computed).
"""

from __future__ import annotations

import numbers
import re
from fractions import Fraction
from typing import Any

from offload.config.errors import ConfigError

SIZE_UNITS: dict[str, int] = {  # also the units of `offload estimate`'s sizes
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}

_PATTERN = re.compile(
    r"^\s*((?:\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?)\s*([a-z]*)\s*$", re.IGNORECASE | re.ASCII
)
_MAX_NUMBER_CHARS = 64
_MAX_EXPONENT = 30

SIZE_HELP = (
    "a byte count: an integer, 1e8, or a string such as '16MB' (10**6), '16MiB' (2**20), "
    "'1e8' or '4k' (bare K/M/G/T are binary)"
)


def parse_size(value: Any, *, key: str = "size") -> int:
    """Bytes from an int, an integral float or a string such as ``"256MB"`` / ``"1GiB"`` / ``"1e8"``.

    Args:
        value: the size as written (see the module's ``Note: units``).
        key: dotted config key named in the error.

    Returns:
        The size in bytes (an ``int`` >= 0).

    Raises:
        ConfigError: naming ``key``, the value and the accepted forms.
    """
    nbytes, problem = parse_bytes(value)
    if nbytes is None:
        raise ConfigError.bad(key, value, SIZE_HELP + (f"; {problem}" if problem else ""))
    return nbytes


def parse_bytes(value: Any) -> tuple[int | None, str]:
    """``(bytes, "")``, or ``(None, why)`` when ``value`` is not a size (``why`` may be empty when
    the form itself is wrong). For callers that write their own message (``as_size``)."""
    if isinstance(value, bool):
        return None, ""
    if isinstance(value, numbers.Integral):  # int, numpy integers
        return (None, "not negative") if value < 0 else (int(value), "")
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None, "a finite number"
        if value < 0:
            return None, "not negative"
        if not value.is_integer():
            return None, "a whole number of bytes"
        return int(value), ""
    if not isinstance(value, str):
        return None, ""
    match = _PATTERN.match(value)
    if match is None or match.group(3).lower() not in SIZE_UNITS:
        return None, ""
    number_text, exponent = match.group(1), match.group(2)
    if len(number_text) > _MAX_NUMBER_CHARS or (  # checked first: int() below stays cheap
        exponent is not None and abs(int(exponent)) > _MAX_EXPONENT
    ):
        return None, f"at most {_MAX_NUMBER_CHARS} characters, exponent within +-{_MAX_EXPONENT}"
    number = Fraction(number_text) * SIZE_UNITS[match.group(3).lower()]
    if number.denominator != 1:
        return None, "a whole number of bytes"
    return int(number), ""


def round_up(nbytes: int, align: int) -> int:
    """``nbytes`` rounded up to a multiple of ``align`` (``align`` >= 1)."""
    return -(-nbytes // align) * align


def format_size(nbytes: int) -> str:
    """A short human form in binary units: ``268435456`` -> ``"256 MiB"``, exact when it is a
    whole number of the largest fitting unit, else two decimals (``"23.54 GiB"``)."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor:
            if nbytes % factor == 0:
                return f"{nbytes // factor} {unit}"
            return f"{nbytes / factor:.2f} {unit}"
    return f"{nbytes} B"


class AutoSize(int):
    """A byte size written as ``"auto"``.

    Its value as an ``int`` is the most the size can become (the fixed default that ``"auto"``
    replaces), so code that reads the field as a number gets a safe upper bound;
    :func:`offload.config.resolve_auto_buffer_size` turns it into the size for a given model.
    The type is the flag, so "auto" survives ``dataclasses.replace``, copies and
    ``load_config(cfg)``; ``to_dict()`` writes it back as ``"auto"``. It never equals a plain
    ``int``: ``"auto"`` and an explicit 256 MiB are different requests.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"AutoSize({int(self)})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, AutoSize):
            return int(self) == int(other)
        if isinstance(other, int):
            return False
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(("auto", int(self)))


def is_auto(value: Any) -> bool:
    """Whether ``value`` asks for an automatic size: the string ``"auto"`` (any case) or an
    :class:`AutoSize`."""
    return isinstance(value, AutoSize) or (
        isinstance(value, str) and value.strip().lower() == "auto"
    )
