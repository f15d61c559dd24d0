"""The one error type of the config layer.

Note: one line, key first
    Every config problem is reported as a single line that starts with the dotted key
    (``offload_optimizer.buffer_size``), then the bad value as the user wrote it, then what is
    allowed. A file name is appended when the config came from a file. The parts are also kept
    as attributes (``key``, ``value``, ``allowed``, ``source``) so callers and tests do not have
    to parse the text.

Note: showing a value costs little, whatever it is
    The value in a message is ``repr()`` cut to 80 characters, but a YAML file can hold a value
    whose full ``repr`` is astronomically long (nine nested lists of nine aliases each: 9**9
    leaves from a few hundred bytes of text). So a value with more than ``_SMALL`` nested items
    is shown through ``reprlib``, which stops after a few items per level and a few levels.
"""

from __future__ import annotations

import re
import reprlib
from typing import Any

_UNSET: Any = object()
_SMALL = 64  # nested items up to which repr() is used as is
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 4, 4, 4
_REPR.maxset = _REPR.maxfrozenset = 4
_REPR.maxstring = _REPR.maxother = 80


def _is_small(value: Any) -> bool:
    """Whether ``value`` holds at most ``_SMALL`` items in all (containers, keys and leaves),
    counted without recursing, so a shared or self-referencing structure ends the count early."""
    stack, seen = [value], 0
    while stack:
        item = stack.pop()
        seen += 1
        if seen > _SMALL:
            return False
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
    return True


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*\Z")


def dotted_key(prefix: str, key: Any) -> str:
    """``prefix + key`` for a plain key (``offload_param.`` + ``buffer_size``); any other key (not
    a string, empty, with spaces, dots or control characters) is shown quoted, so the message
    still starts with something readable: ``offload_param.' '``."""
    if isinstance(key, str) and _PLAIN_KEY.match(key):
        return f"{prefix}{key}"
    return f"{prefix}{_show(key)}"


def _show(value: Any) -> str:
    """repr() of a value, shortened to one line of at most 80 characters (see the Note)."""
    try:
        text = repr(value) if _is_small(value) else _REPR.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an int too long for str(); or a broken __repr__
        what = f"of {value.bit_length()} bits" if isinstance(value, int) else "object"
        text = f"<{type(value).__name__} {what}>"
    text = text.replace("\n", " ")
    return text if len(text) <= 80 else text[:77] + "..."


class ConfigError(ValueError):
    """An invalid config: names the dotted key, the bad value and what is allowed, in one line."""

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        value: Any = _UNSET,
        allowed: str | None = None,
        source: str | None = None,
    ) -> None:
        self.key = key
        self.value = None if value is _UNSET else value
        self.allowed = allowed
        self.source = source
        self.detail = " ".join(message.split())  # always one line
        super().__init__(self._text())

    def _text(self) -> str:
        return self.detail if self.source is None else f"{self.detail} (in {self.source})"

    def __str__(self) -> str:
        return self._text()

    @classmethod
    def bad(cls, key: str, value: Any, allowed: str) -> ConfigError:
        """``<key>: got <value>; allowed: <allowed>``."""
        return cls(
            f"{key}: got {_show(value)}; allowed: {allowed}", key=key, value=value, allowed=allowed
        )

    def with_source(self, source: str) -> ConfigError:
        """The same error, naming the file (or other origin) the config came from."""
        err = ConfigError(
            self.detail, key=self.key, value=self.value, allowed=self.allowed, source=source
        )
        return err

    def renamed(self, key: str, note: str = "") -> ConfigError:
        """The same error under another dotted key (e.g. the DeepSpeed key that produced it)."""
        detail = self.detail
        if self.key is not None and detail.startswith(self.key + ":"):
            detail = key + detail[len(self.key) :]
        if note:
            detail = f"{detail} {note}"
        return ConfigError(
            detail, key=key, value=self.value, allowed=self.allowed, source=self.source
        )
