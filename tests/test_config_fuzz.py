"""Fuzzing the config loader: whatever a dict, a JSON file or a YAML file holds, in offload's format
or DeepSpeed's, ``load_config`` returns a valid config or raises ``ConfigError``; nothing else
escapes, and nothing takes long.

The generators know the schema (offload's sections and fields, DeepSpeed's mapped keys) and
valid values for each key, so a drawn config is mostly valid and its few random values (of every JSON/YAML type: huge
integers, NaN, infinities, nested lists and dicts, size strings, "auto", odd keys) reach the
check they are meant for. The default suite runs 200 configs (each as a dict, a JSON file and a
YAML file), 200 raw texts and 150 generator probes, about 10 s on the shared 2-core machine;
``-m slow`` runs 5,000 of each.
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

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LONG = settings(max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- what the generators know ------------------------------------------------------------

Tree = dict[str, Any]  # key -> subtree (a dict) or, at a leaf, a list of valid values

# Valid values besides the defaults, so a drawn config is mostly valid and its one or two random
# values reach the check they are meant for (a random value in the first field checked would
# hide every field after it).
OFFLOAD_GOOD: dict[str, list[Any]] = {
    "device": ["cpu", "CUDA:1"],
    "dtype": ["fp32", "fp16", "bfloat16"],
    "optimizer.type": ["adam", "AdamW"],
    "optimizer.lr": [3e-4, 1],
    "optimizer.betas": [[0.8, 0.95], (0, 0.5)],
    "offload_optimizer.device": ["nvme"],
    "offload_optimizer.nvme_path": ["/nvme/opt"],
    "offload_optimizer.buffer_size": ["16MB", 1e8, "1e8", "AUTO", 4096, 1000],
    "offload_optimizer.step_in_backward": [True],
    "offload_param.device": ["cpu", "nvme"],
    "offload_param.nvme_path": ["/nvme/params"],
    "offload_param.buffer_size": ["16MB", 1e8, "auto", "128M", 1],
    "aio.block_size": ["1e6", "64KiB", 4097],
    "gradient_clipping": [1.0, 0],
    "gradient_accumulation_steps": [2, "auto"],
    "loss_scale.initial": [1024, 1.0],
    "loss_scale.min_scale": [2.0],
    "wrap.module_classes": [["Block", "pkg.Layer"]],
    "telemetry.jsonl_path": ["/tmp/t.jsonl"],
}
DEEPSPEED_GOOD: dict[str, list[Any]] = {
    "zero_optimization.stage": [0, 3],
    "zero_optimization.stage3_param_persistence_threshold": [1e5, 0, "auto"],
    "zero_optimization.offload_param.device": ["cpu", "nvme", "none"],
    "zero_optimization.offload_param.nvme_path": ["/nvme"],
    "zero_optimization.offload_param.pin_memory": [True, False],
    "zero_optimization.offload_param.buffer_count": [5],
    "zero_optimization.offload_param.buffer_size": [1e8, "auto", 1000],
    "zero_optimization.offload_optimizer.device": ["cpu", "nvme", "none"],
    "zero_optimization.offload_optimizer.nvme_path": ["/nvme"],
    "zero_optimization.offload_optimizer.pin_memory": [True],
    "zero_optimization.offload_optimizer.buffer_count": [4, 8],
    "zero_optimization.offload_optimizer.ratio": [1, 0.5],
    "optimizer.type": ["Adam", "AdamW"],
    "optimizer.params.lr": [1e-4, "auto"],
    "optimizer.params.betas": [[0.9, 0.999]],
    "optimizer.params.eps": [1e-8],
    "optimizer.params.weight_decay": [0.0, 0.1],
    "optimizer.params.bias_correction": [True],
    "optimizer.params.adam_w_mode": [True, False],
    "optimizer.params.amsgrad": [False, True],
    "bf16.enabled": [True, False, "auto"],
    "bfloat16.enabled": [True],
    "fp16.enabled": [True, False],
    "fp16.loss_scale": [0, 128],
    "fp16.initial_scale_power": [16],
    "fp16.loss_scale_window": [1000],
    "fp16.min_loss_scale": [1],
    "fp16.hysteresis": [2, 1],
    "gradient_clipping": [1.0, "auto"],
    "aio.block_size": [1048576, 1e6],
    "aio.queue_depth": [8],
    "aio.thread_count": [1],
    "aio.intra_op_parallelism": [2],
    "aio.single_submit": [False, True],
    "aio.overlap_events": [True],
    "aio.use_gds": [False],
}
FALLBACK_GOOD = [1, 8, True, "auto"]  # DeepSpeed keys offload only lists in its warning


def _offload_tree() -> Tree:
    default = OffloadConfig().to_dict()
    tree: Tree = {}
    for name, value in default.items():
        if isinstance(value, dict):
            tree[name] = {k: [v, *OFFLOAD_GOOD.get(f"{name}.{k}", [])] for k, v in value.items()}
        else:
            tree[name] = [value, *OFFLOAD_GOOD.get(name, [])]
    assert set(tree) == {f.name for f in dataclasses.fields(OffloadConfig)}
    return tree


def _deepspeed_tree() -> Tree:
    def convert(prefix: str, table: dict[str, Any]) -> Tree:
        return {
            k: convert(f"{prefix}{k}.", v)
            if isinstance(v, dict)
            else DEEPSPEED_GOOD.get(f"{prefix}{k}", FALLBACK_GOOD)
            for k, v in table.items()
        }

    tree = convert("", _MAP)
    for dotted in [*_SAME_BEHAVIOUR, *DEEPSPEED_MARKERS]:
        node = tree
        *heads, leaf = dotted.split(".")
        for head in heads:
            node = node.setdefault(head, {})
            if not isinstance(node, dict):
                break
        else:
            node.setdefault(leaf, DEEPSPEED_GOOD.get(dotted, FALLBACK_GOOD))
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

# Hypothesis draws the first entries of a sampled_from more often: the nastiest come first.
EXTREMES = [
    10**400, math.nan, -(10**400), math.inf, -math.inf, 2**64, -1, 0, 1e300, 5e-324, -0.0,
    4095, 4096, 4097, 2**30 + 1, 2**40, 2**40 + 1, 2**62, 1e8, 1.5, 0.999, 1.0, 1,
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(EXTREMES),
    st.sampled_from(EXTREMES),
    st.sampled_from(WORDS),
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
# edge values and words more often than anything else, a wrong scalar more often than a wrong shape
mutations = st.one_of(st.sampled_from(EXTREMES), st.sampled_from(WORDS), scalars, values)
odd_keys = st.one_of(st.text(max_size=12), st.integers(-5, 5), st.none(), st.booleans())


@st.composite
def valid_dict(draw: st.DrawFn, tree: Tree) -> dict[str, Any]:
    """A dict over about half of ``tree``'s keys, nested where the tree nests, each leaf one of
    its valid values."""
    out: dict[str, Any] = {}
    for key, sub in tree.items():
        if draw(st.booleans()):
            out[key] = (
                draw(valid_dict(sub)) if isinstance(sub, dict) else draw(st.sampled_from(sub))
            )
    return out


def _paths(data: dict[Any, Any], prefix: tuple = ()) -> list[tuple]:
    out = []
    for key, value in data.items():
        out.append((*prefix, key))
        if isinstance(value, dict):
            out += _paths(value, (*prefix, key))
    return out


@st.composite
def schema_dict(draw: st.DrawFn, tree: Tree) -> dict[Any, Any]:
    """A mostly valid dict over ``tree`` (see :func:`valid_dict`) with 0-3 of its entries (a
    leaf or a whole section) replaced by a random value, or all of them; and now and then an
    unknown key somewhere."""
    data = draw(valid_dict(tree))
    paths = _paths(data)
    count = draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3, len(paths)]))
    for _ in range(count if paths else 0):
        path = draw(st.sampled_from(paths))
        node = data
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[path[-1]] = draw(mutations)
    if draw(st.integers(0, 9)) == 0:
        dicts = [data, *(v for p in paths if isinstance(v := _at(data, p), dict))]
        draw(st.sampled_from(dicts))[draw(odd_keys)] = draw(values)
    return data


def _at(data: dict[Any, Any], path: tuple) -> Any:
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


offload_dicts = schema_dict(OFFLOAD_TREE)
deepspeed_dicts = schema_dict(DEEPSPEED_TREE)
# offload's and DeepSpeed's schema twice as often as a dict of anything
any_dicts = st.one_of(
    offload_dicts,
    deepspeed_dicts,
    offload_dicts,
    deepspeed_dicts,
    st.dictionaries(odd_keys, values, max_size=5),
)
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
@given(data=any_dicts, flag=deepspeed_flag)
def test_fuzz_configs(tmp_path_factory, data, flag):
    """Each drawn config three ways: the dict itself, a JSON file and a YAML file."""
    check_dict(data, flag)
    check_files(tmp_path_factory.mktemp("f"), data, flag)


@settings(FAST, max_examples=200)
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
    ("deep.json", "[" * 20_000 + "]" * 20_000),  # far beyond the interpreter's stack
    ("deep.yaml", "[" * 2_000 + "]" * 2_000),
    ("deep_dict.json", '{"a":' * 20_000 + "1" + "}" * 20_000),
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
    drawn config is valid, and which keys the errors come from (deterministic examples)."""
    valid, keys = 0, set()

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(data=offload_dicts)
    def probe(data):
        nonlocal valid
        out = load_or_config_error(data)
        if isinstance(out, OffloadConfig):
            valid += 1
        elif out.key:
            keys.add(out.key)

    probe()
    sections = {s.KEY for s in SECTIONS}
    reached = {k for k in keys if k.split(".")[0] in sections}
    print(
        f"valid {valid} of 300; {len(reached)} keys; sections {sorted({k.split('.')[0] for k in reached})}"
    )
    assert valid >= 30, valid  # one in ten or more
    assert len({k.split(".")[0] for k in reached}) >= len(sections) - 1, keys
    assert len(reached) >= 15, keys


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
def test_fuzz_configs_long(tmp_path_factory, data, flag):
    check_dict(data, flag)
    check_files(tmp_path_factory.mktemp("f"), data, flag)


@pytest.mark.slow
@LONG
@given(text=st.text(max_size=2000))
def test_fuzz_raw_text_long(tmp_path_factory, text):
    test_fuzz_raw_text.hypothesis.inner_test(tmp_path_factory, text)
