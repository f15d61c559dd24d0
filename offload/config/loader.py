"""``load_config``: one entry point for every form a config arrives in.

Note: YAML floats and duplicate keys
    PyYAML follows YAML 1.1, where ``lr: 1e-4`` (no dot) is the *string* "1e-4". offload's YAML
    loader adds the YAML 1.2 float pattern, so ``1e-4`` is the float users expect, and every
    other string stays a string (and a string where a number is needed is an error). Both the
    JSON and the YAML reader refuse a key given twice in one mapping instead of keeping the last.

Note: every file problem is a ConfigError
    Besides syntax errors, the parsers raise ``RecursionError`` (``[[[[...`` nested deeper than
    the interpreter's stack), ``ValueError`` (an integer with more than 4300 digits, an
    impossible YAML date such as ``2001-02-30``, a NUL in the path) and, for a YAML mapping key
    that is a list or a mapping, an unhashable-key error. All of them become one-line
    ``ConfigError`` lines naming the file, so ``load_config`` lets nothing else escape
    (``tests/test_config_fuzz.py``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from offload.config.deepspeed import from_deepspeed, is_deepspeed_config
from offload.config.errors import ConfigError, _show
from offload.config.offload_config import OffloadConfig

ConfigSource = Mapping[str, Any] | str | os.PathLike | OffloadConfig | None


def load_config(src: ConfigSource = None, *, deepspeed: bool | None = None) -> OffloadConfig:
    """A validated :class:`OffloadConfig` from any of the accepted forms.

    Args:
        src: ``None`` (all defaults); a dict in offload's format or DeepSpeed's; a path to a
            ``.json``, ``.yaml`` or ``.yml`` file holding either; or an ``OffloadConfig``
            (validated again, returned as a normalized copy).
        deepspeed: ``None`` detects a DeepSpeed config by its keys (``zero_optimization``,
            ``train_batch_size``, ``bf16``/``fp16``, ``optimizer.params``, ...); ``True`` or
            ``False`` forces the format.

    Raises:
        ConfigError: one line naming the dotted key, the value and what is allowed (and the
            file, when there is one); also for a missing or unparseable file.
    """
    if isinstance(src, OffloadConfig):
        return OffloadConfig.from_dict(src.to_dict())
    if src is None:
        return OffloadConfig()
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        data = read_config_file(path)
        try:
            return _from_data(data, deepspeed)
        except ConfigError as exc:
            raise exc.with_source(path) from None
    if isinstance(src, Mapping):
        return _from_data(src, deepspeed)
    raise ConfigError.bad(
        "<config>", src, "None, a dict, a .json/.yaml/.yml path or an OffloadConfig"
    )


def nvme_sections_without_path(data: Any) -> list[dict]:
    """The offload sections of a config as read (offload's format, or DeepSpeed's under
    ``zero_optimization``) that put their tier on NVMe, spelled as the loader accepts it (any
    case, spaces around), and name no ``nvme_path``: those to which a command gives its own
    swap directory (``offload finetune``'s ``OUT/swap``, the demo's). The dicts themselves, to
    fill in."""
    if not isinstance(data, dict):
        return []
    sections = data.get("zero_optimization") if is_deepspeed_config(data) else data
    if not isinstance(sections, dict):
        return []
    found = []
    for name in ("offload_param", "offload_optimizer"):
        sec = sections.get(name)
        device = sec.get("device") if isinstance(sec, dict) else None
        if isinstance(device, str) and device.strip().lower() == "nvme":
            if not sec.get("nvme_path"):
                found.append(sec)
    return found


def _from_data(data: Any, deepspeed: bool | None) -> OffloadConfig:
    if data is None:
        return OffloadConfig()
    if not isinstance(data, Mapping):
        raise ConfigError.bad("<config>", data, "a mapping of config sections at the top level")
    if deepspeed is None:
        deepspeed = is_deepspeed_config(data)
    return from_deepspeed(data) if deepspeed else OffloadConfig.from_dict(data)


def read_config_file(path: str | os.PathLike) -> Any:
    """The parsed content of a ``.json``, ``.yaml`` or ``.yml`` file (not yet validated)."""
    path = os.fspath(path)
    suffix = Path(path).suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(
            f"{path}: unsupported config file extension {suffix or '(none)'!r}; "
            "allowed: .json, .yaml, .yml",
            source=None,
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # ValueError: a NUL in the path
        shown = path if path.isprintable() else _show(path)
        raise ConfigError(f"{shown}: cannot read config file ({exc})") from None
    if suffix == ".json":
        try:
            return json.loads(text, object_pairs_hook=_json_pairs)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from None
        except _DuplicateKey as exc:
            raise ConfigError(
                f"{path}: key {_show(exc.args[0])} appears twice in one mapping; "
                "allowed: each key once"
            ) from None
        except (RecursionError, ValueError) as exc:
            raise ConfigError(f"{path}: not valid JSON: {_why(exc)}") from None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except _DuplicateKey as exc:
        raise ConfigError(
            f"{path}: key {_show(exc.args[0])} appears twice in one mapping "
            f"({exc.args[1]}); allowed: each key once"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML: {problem}{where}") from None
    except (RecursionError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{path}: not valid YAML: {_why(exc)}") from None


def _why(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class _DuplicateKey(Exception):
    pass


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _Loader(yaml.SafeLoader):
    """SafeLoader + YAML 1.2 floats (``1e-4``) + duplicate-key detection."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    out: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found a {type(key).__name__} as a key (keys are names)",
                key_node.start_mark,
            ) from None
        if key in out:
            mark = key_node.start_mark
            raise _DuplicateKey(key, f"line {mark.line + 1}")
        out[key] = loader.construct_object(value_node, deep=True)
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
