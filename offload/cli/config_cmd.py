"""``offload config FILE``: validate a config file and print it normalized, defaults filled in.

The plain output is YAML that ``offload.load_config`` reads back to an equal config (byte sizes
carry a comment in binary units), so it also converts a DeepSpeed config to offload's format.
Sizes are shown as stored: rounded up to 4096 where the key needs it (the rounding is also logged
on stderr), ``"auto"`` buffer sizes as ``"auto"`` with the most they can become. ``--json``
prints the same as JSON. A bad config, or a missing or unparseable file, prints the one-line error
on stderr and exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from offload.config import ConfigError, load_config
from offload.config.deepspeed import is_deepspeed_config
from offload.config.loader import read_config_file
from offload.config.sections import DEFAULT_BUFFER_SIZE
from offload.config.sizes import format_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        metavar="FILE",
        help="config file (.json, .yaml or .yml; offload's format or DeepSpeed's)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument(
        "--deepspeed",
        dest="deepspeed",
        action="store_true",
        default=None,
        help="read FILE as a DeepSpeed config (default: detected from its keys)",
    )
    fmt.add_argument(
        "--no-deepspeed",
        dest="deepspeed",
        action="store_false",
        help="read FILE as an offload config even if it looks like DeepSpeed's",
    )


def run(args: argparse.Namespace) -> int:
    log = logging.getLogger("offload.config")
    try:
        data = read_config_file(args.file)
        deepspeed = args.deepspeed
        if deepspeed is None:
            deepspeed = isinstance(data, dict) and is_deepspeed_config(data)
        config = load_config(args.file, deepspeed=deepspeed)
    except ConfigError as exc:
        print(f"offload config: error: {exc}", file=sys.stderr)
        return 1
    log.debug("config %s is valid", args.file)
    plain = config.to_dict()
    if args.json:
        print(json.dumps(plain, indent=2))
        return 0
    kind = "DeepSpeed config mapped to offload's format" if deepspeed else "offload config"
    print(f"# {args.file}: valid {kind}; normalized, defaults filled in")
    print(to_yaml(plain), end="")
    return 0


def to_yaml(plain: dict[str, Any]) -> str:
    """Block-style YAML of a normalized config; scalars in JSON syntax (valid YAML), byte sizes
    annotated in binary units."""
    lines: list[str] = []

    def emit(indent: str, key: str, value: Any) -> None:
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            for k, v in value.items():
                emit(indent + "  ", k, v)
            return
        lines.append(f"{indent}{key}: {_scalar(value)}{_size_note(key, value)}")

    for key, value in plain.items():
        emit("", key, value)
    return "\n".join(lines) + "\n"


def _scalar(value: Any) -> str:
    """A value in JSON syntax, except that a character beyond U+FFFF in a string is YAML's
    ``\\UXXXXXXXX``: JSON's surrogate pair (``\\ud83d\\udcbe``) reads back in YAML as two lone
    surrogates, so a path with such a character came back as another path."""
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if not isinstance(value, str):
        return json.dumps(value)
    body = "".join(
        f"\\U{ord(ch):08x}" if ord(ch) > 0xFFFF else json.dumps(ch)[1:-1] for ch in value
    )
    return f'"{body}"'


def _size_note(key: str, value: Any) -> str:
    """The comment after a byte size: its binary-unit form, or what "auto" can become."""
    if not key.endswith("_size"):
        return ""
    if value == "auto":
        return (
            f"  # the largest unit's size, at most {format_size(DEFAULT_BUFFER_SIZE)}, set at wrap"
        )
    if isinstance(value, int) and value >= 1024:
        return f"  # {format_size(value)}"
    return ""
