"""Byte sizes written by people: ``4096``, ``"256MB"``, ``"1GiB"``, ``"4k"``.

Note: units
    A size is a non-negative integer number of bytes, or a string ``<number><unit>`` with
    optional spaces between. Units are case-insensitive:

    - ``B`` or none: bytes;
    - ``KB MB GB TB``: decimal, 10**3, 10**6, 10**9, 10**12 (as disk vendors and the SI use them);
    - ``KiB MiB GiB TiB``: binary, 2**10, 2**20, 2**30, 2**40;
    - ``K M G T`` (no ``B``): binary, as ``dd``, ``fio`` and ``ulimit`` read them, so ``"4k"``
      is 4096.

    The number may have a fraction (``"1.5GiB"``) when the result is a whole number of bytes;
    it is computed exactly (``fractions.Fraction``), never through a binary float. Floats are
    accepted only when integral (``1e8`` from a JSON file). There are no bit units, and booleans
    are not sizes.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from offload.config.errors import ConfigError

_UNITS: dict[str, int] = {
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

_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)

SIZE_HELP = (
    "a byte count >= 0: an integer, or a string like '4096', '256MB' (10**6), '1GiB' (2**30), "
    "'4k' (bare K/M/G/T are binary)"
)


def parse_size(value: Any, *, key: str = "size") -> int:
    """Bytes from an int, an integral float or a string such as ``"256MB"`` / ``"1GiB"``.

    Args:
        value: the size as written (see the module's ``Note: units``).
        key: dotted config key named in the error.

    Returns:
        The size in bytes (an ``int`` >= 0).

    Raises:
        ConfigError: naming ``key``, the value and the accepted forms.
    """
    if isinstance(value, bool):
        raise ConfigError.bad(key, value, SIZE_HELP)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError.bad(key, value, SIZE_HELP)
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")) or value < 0:
            raise ConfigError.bad(key, value, SIZE_HELP)
        if not value.is_integer():
            raise ConfigError.bad(key, value, SIZE_HELP + "; a whole number of bytes")
        return int(value)
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ConfigError.bad(key, value, SIZE_HELP)
        number = Fraction(match.group(1)) * _UNITS[match.group(2).lower()]
        if number.denominator != 1:
            raise ConfigError.bad(key, value, SIZE_HELP + "; a whole number of bytes")
        return int(number)
    raise ConfigError.bad(key, value, SIZE_HELP)


def format_size(nbytes: int) -> str:
    """A short human form in binary units: ``268435456`` -> ``"256 MiB"``, exact when it is a
    whole number of the largest fitting unit, else two decimals (``"23.54 GiB"``)."""
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor:
            if nbytes % factor == 0:
                return f"{nbytes // factor} {unit}"
            return f"{nbytes / factor:.2f} {unit}"
    return f"{nbytes} B"
