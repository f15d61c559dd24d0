"""Fuzzing the config loader: whatever a dict, a JSON file or a YAML file holds, in offload's format
or DeepSpeed's, ``load_config`` returns a valid config or raises ``ConfigError``; nothing else
escapes, and nothing takes long.

The generators know the schema (offload's sections and fields, DeepSpeed's mapped keys), so most
examples get past "unknown key" into the value checks, where the bugs are; random keys and
random values of every JSON/YAML type (huge integers, NaN, infinities, nested lists and dicts,
size strings, "auto") fill the rest. The default suite runs a few hundred examples per test in a
few seconds; ``-m slow`` runs many more.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload.config import ConfigError, OffloadConfig, load_config
from offload.config.deepspeed import _MAP, _SAME_BEHAVIOUR, DEEPSPEED_MARKERS
from offload.config.sections import SECTIONS

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LONG = settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- what the generators know ------------------------------------------------------------

Tree = dict[str, Any]  # key -> subtree (a dict) or None (a leaf)


def _offload_tree() -> Tree:
    tree: Tree = {s.KEY: {f.name: None for f in dataclasses.fields(s)} for s in SECTIONS}
    for f in dataclasses.fields(OffloadConfig):
        tree.setdefault(f.name, None)
    return tree


def _deepspeed_tree() -> Tree:
    def convert(table: dict[str, Any]) -> Tree:
        return {k: convert(v) if isinstance(v, dict) else None for k, v in table.items()}

    tree = convert(_MAP)
    for dotted in _SAME_BEHAVIOUR:
        node = tree
        *heads, leaf = dotted.split(".")
        for head in heads:
            node = node.setdefault(head, {}) or {}
        node.setdefault(leaf, None)
    for marker in DEEPSPEED_MARKERS:
        tree.setdefault(marker, None)
    return tree


OFFLOAD_TREE = _offload_tree()
DEEPSPEED_TREE = _deepspeed_tree()

WORDS = [
    "auto", "AUTO", " auto ", "16MB", "16MiB", "16 mib", "1e8", "1E8", "2.5e3MB", "4k", "4kb",
    "1.5GiB", "0.3B", "1e999999999", "9" * 80, "-4k", "1GB", "256MB", "nvme", "NVMe", "cpu",
    "none", "cuda", "cuda:0", "cuda:-1", "bf16", "bfloat16", "fp16", "fp32", "float32", "adam",
    "Adam", "AdamW", "sgd", "yes", "no", "on", "true", "", " ", "-1", "0", "nan", "inf", "-inf",
    "1e-4", "0x10", "Block", "my_pkg.Block", "not a name", "/tmp/x", "\x00", "\u212a",
    "\u0663",
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 4095, 4096, 4097, 2**40, 2**40 + 1, 2**62, 10**400, -(10**400)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e8, 1.5, -0.0, 1e300, 5e-324]),
    st.sampled_from(WORDS),
    st.text(max_size=12),
)


def _values(leaves: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.text(max_size=8) | st.sampled_from(WORDS), inner, max_size=4)
        ),
        max_leaves=8,
    )


values = _values(scalars)
odd_keys = st.one_of(st.text(max_size=12), st.integers(-5, 5), st.none(), st.booleans())


@st.composite
def schema_dict(draw: st.DrawFn, tree: Tree, *, odd: bool = True) -> dict[Any, Any]:
    """A dict over ``tree``'s keys (a random subset), nested where the tree nests, with random
    values at the leaves, now and then a value of the wrong shape or an unknown key."""
    keys = draw(st.lists(st.sampled_from(sorted(tree)), max_size=len(tree), unique=True))
    out: dict[Any, Any] = {}
    for key in keys:
        sub = tree[key]
        if isinstance(sub, dict) and draw(st.integers(0, 9)) > 0:
            out[key] = draw(schema_dict(sub, odd=odd))
        else:
            out[key] = draw(values)
    if odd and draw(st.integers(0, 9)) == 0:
        out[draw(odd_keys)] = draw(values)
    return out


offload_dicts = schema_dict(OFFLOAD_TREE)
deepspeed_dicts = schema_dict(DEEPSPEED_TREE)
any_dicts = st.one_of(offload_dicts, deepspeed_dicts, st.dictionaries(odd_keys, values, max_size=5))
deepspeed_flag = st.sampled_from([None, True, False])


# --- the property ------------------------------------------------------------------------


def load_or_config_error(src: Any, deepspeed: bool | None = None) -> OffloadConfig | ConfigError:
    """``load_config(src)``; any exception but ConfigError fails the test. A valid config must
    survive ``to_dict`` (JSON, no NaN) and ``from_dict`` unchanged; an error must be one line
    that starts with its dotted key."""
    try:
        cfg = load_config(src, deepspeed=deepspeed)
    except ConfigError as exc:
        text = str(exc)
        assert "\n" not in text, text
        if exc.key is not None:
            assert text.startswith(exc.key), text
        return exc
    assert isinstance(cfg, OffloadConfig)
    plain = cfg.to_dict()
    json.dumps(plain, allow_nan=False)  # every stored number is finite
    assert OffloadConfig.from_dict(plain) == cfg
    for section in ("offload_param", "offload_optimizer"):
        assert getattr(cfg, section).buffer_size % 4096 == 0
    assert cfg.aio.block_size % 4096 == 0 and cfg.aio.block_size > 0
    return cfg


def check_dict(data: dict[Any, Any], deepspeed: bool | None) -> None:
    before = repr(data)
    load_or_config_error(data, deepspeed)
    assert repr(data) == before, "load_config modified its input"


def check_files(tmp: Path, data: dict[Any, Any], deepspeed: bool | None) -> None:
    direct = load_or_config_error(data, deepspeed)
    if all(isinstance(k, str) for k in _all_keys(data)):
        # JSON keeps str keys, ints, floats (NaN too), bools, None, lists and dicts exactly
        path = tmp / "fuzz.json"
        path.write_text(json.dumps(data))
        _same_outcome(load_or_config_error(path, deepspeed), direct)
    path = tmp / "fuzz.yaml"
    path.write_text(yaml.safe_dump(data))
    load_or_config_error(path, deepspeed)  # YAML 1.2 floats may read "1e8" as a number: no ==


def _all_keys(data: Any) -> list[Any]:
    if isinstance(data, dict):
        return [*data, *(k for v in data.values() for k in _all_keys(v))]
    if isinstance(data, list):
        return [k for v in data for k in _all_keys(v)]
    return []


def _same_outcome(a: OffloadConfig | ConfigError, b: OffloadConfig | ConfigError) -> None:
    if isinstance(a, ConfigError) or isinstance(b, ConfigError):
        assert isinstance(a, ConfigError) and isinstance(b, ConfigError), (a, b)
        assert a.key == b.key, (a, b)
    else:
        assert a == b


# --- default suite -------------------------------------------------------------------------


@FAST
@given(data=offload_dicts)
def test_fuzz_offload_dicts(data):
    check_dict(data, None)


@FAST
@given(data=deepspeed_dicts, flag=deepspeed_flag)
def test_fuzz_deepspeed_dicts(data, flag):
    check_dict(data, flag)


@FAST
@given(data=any_dicts, flag=deepspeed_flag)
def test_fuzz_files(tmp_path_factory, data, flag):
    check_files(tmp_path_factory.mktemp("f"), data, flag)


@FAST
@given(text=st.text(max_size=200) | st.sampled_from(["{", "[" * 50, "a: [", "- x"]))
def test_fuzz_raw_text(tmp_path_factory, text):
    tmp = tmp_path_factory.mktemp("t")
    for name in ("raw.json", "raw.yaml"):
        (tmp / name).write_text(text, encoding="utf-8", errors="surrogatepass")
        load_or_config_error(tmp / name)


LAUGHS = (
    "[&a [x, x, x, x, x, x, x, x, x], "
    + ", ".join(f"&{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi"))
    + "]"
)

# Files the generators are unlikely to write but users (or attackers) can.
NASTY_FILES = [
    ("deep.json", "[" * 100_000 + "]" * 100_000),
    ("deep.yaml", "[" * 100_000 + "]" * 100_000),
    ("deep_dict.json", '{"a":' * 50_000 + "1" + "}" * 50_000),
    ("bigint.json", '{"aio": {"queue_depth": 1' + "0" * 5000 + "}}"),
    ("bigint.yaml", "aio: {queue_depth: 1" + "0" * 5000 + "}\n"),
    ("bigfloat.yaml", "optimizer: {lr: 1e999}\n"),
    ("nan.json", '{"optimizer": {"lr": NaN}, "gradient_clipping": Infinity}'),
    ("list_key.yaml", "? [a, b]\n: 1\n"),
    ("dict_key.yaml", "? {a: 1}\n: 1\n"),
    ("nested_list_key.yaml", "optimizer:\n  ? [lr]\n  : 1\n"),
    ("python_tag.yaml", "!!python/object/apply:os.system [echo hi]\n"),
    ("bad_timestamp.yaml", "telemetry: {jsonl_path: 2001-02-30}\n"),
    ("timestamp.yaml", "optimizer: {lr: 2001-12-14}\n"),
    ("binary.yaml", "telemetry: {jsonl_path: !!binary aGVsbG8=}\n"),
    ("set.yaml", "wrap: {module_classes: !!set {A, B}}\n"),
    ("recursive.yaml", "wrap: {module_classes: &a [*a]}\n"),
    ("recursive_dict.yaml", "optimizer: &a {betas: *a}\n"),
    # nine levels of nine aliases: a few hundred bytes whose repr() has 9**9 items
    ("laughs.yaml", f"wrap: {{module_classes: {LAUGHS}}}\n"),
    ("laughs_ds.yaml", f"train_batch_size: 1\naio: {{single_submit: {LAUGHS}}}\n"),
    ("dup.yaml", "aio: {queue_depth: 1, queue_depth: 2}\n"),
    ("nul.json", '{"telemetry": {"jsonl_path": "a\\u0000b"}}'),
    ("latin1.json", None),  # bytes, below
    ("empty.json", ""),
    ("scalar.yaml", "42\n"),
    ("null.yaml", "~\n"),
]


@pytest.mark.parametrize("name, text", NASTY_FILES, ids=[n for n, _ in NASTY_FILES])
def test_nasty_files_are_config_errors_or_configs(tmp_path, name, text):
    path = tmp_path / name
    if text is None:
        path.write_bytes(b'{"dtype": "\xff\xfe"}')
    else:
        path.write_text(text)
    load_or_config_error(path)


@pytest.mark.parametrize(
    "src",
    ["bad\x00path.json", "/nonexistent/dir/c.yaml", "c.toml", b"c.json", 3.5, ["a"]],
    ids=["nul", "missing", "toml", "bytes", "float", "list"],
)
def test_odd_sources_are_config_errors(src):
    assert isinstance(load_or_config_error(src), ConfigError)


def test_directory_as_config_file(tmp_path):
    (tmp_path / "d.yaml").mkdir()
    assert isinstance(load_or_config_error(tmp_path / "d.yaml"), ConfigError)


def test_the_generators_reach_valid_configs_and_every_section():
    """The fuzzers are worth something only if they get past the first check: count how often a
    drawn config is valid, and which sections errors come from."""
    valid, keys = 0, set()

    @settings(max_examples=300, deadline=None, database=None)
    @given(data=offload_dicts)
    def probe(data):
        nonlocal valid
        out = load_or_config_error(data)
        if isinstance(out, OffloadConfig):
            valid += 1
        elif out.key:
            keys.add(out.key.split(".")[0])

    probe()
    assert valid >= 10, valid
    assert {s.KEY for s in SECTIONS} - {"telemetry"} <= keys | {"telemetry"}, keys


def test_huge_and_non_finite_numbers_name_their_key():
    for value in (10**400, -(10**400), math.nan, math.inf):
        for config, key in (
            ({"optimizer": {"lr": value}}, "optimizer.lr"),
            ({"gradient_clipping": value}, "gradient_clipping"),
            ({"fp16": {"enabled": True, "loss_scale": value}}, "fp16.loss_scale"),
            ({"offload_param": {"buffer_size": value}}, "offload_param.buffer_size"),
        ):
            out = load_or_config_error(config)
            if value == 10**400 and key == "gradient_clipping":
                assert isinstance(out, ConfigError) and out.key == key
            elif isinstance(out, OffloadConfig):
                pytest.fail(f"{config} was accepted")
            else:
                assert out.key == key, (config, out)


# --- slow: the long run --------------------------------------------------------------------


@pytest.mark.slow
@LONG
@given(data=any_dicts, flag=deepspeed_flag)
def test_fuzz_dicts_long(data, flag):
    check_dict(data, flag)


@pytest.mark.slow
@LONG
@given(data=any_dicts, flag=deepspeed_flag)
def test_fuzz_files_long(tmp_path_factory, data, flag):
    check_files(tmp_path_factory.mktemp("f"), data, flag)
