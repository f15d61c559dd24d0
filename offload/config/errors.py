"""The one error type of the config layer.

Note: one line, key first
    Every config problem is reported as a single line that starts with the dotted key
    (``offload_optimizer.buffer_size``), then the bad value as the user wrote it, then what is
    allowed. A file name is appended when the config came from a file. The parts are also kept
    as attributes (``key``, ``value``, ``allowed``, ``source``) so callers and tests do not have
    to parse the text.
"""

from __future__ import annotations

from typing import Any

_UNSET: Any = object()


def _show(value: Any) -> str:
    """repr() of a value, shortened to one line of at most 80 characters."""
    text = repr(value).replace("\n", " ")
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
