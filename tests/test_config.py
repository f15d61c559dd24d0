"""OffloadConfig: defaults, round trips through dict / JSON / YAML, sizes, and bad configs that
must each be refused with one line naming the dotted key and the bad value."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

import offload
from offload.config import (
    AioConfig,
    ConfigError,
    LossScaleConfig,
    OffloadConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerConfig,
    PrefetchConfig,
    TelemetryConfig,
    WrapConfig,
    load_config,
    parse_size,
)
from offload.config._reference import field_docs, reference_markdown

SECTION_CLASSES = [
    OptimizerConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    AioConfig,
    PrefetchConfig,
    LossScaleConfig,
    WrapConfig,
    TelemetryConfig,
]

# Every section away from its defaults, sizes written in several units.
FULL = {
    "device": "cuda:1",
    "dtype": "fp16",
    "optimizer": {
        "type": "adam",
        "lr": 3e-4,
        "betas": [0.8, 0.95],
        "eps": 1e-6,
        "weight_decay": 0.1,
        "bias_correction": False,
    },
    "offload_optimizer": {
        "device": "nvme",
        "nvme_path": "/local_nvme/opt",
        "pin_memory": False,
        "buffer_count": 5,
        "buffer_size": "64MiB",
        "threads": 7,
    },
    "offload_param": {
        "device": "nvme",
        "nvme_path": "/local_nvme/params",
        "pin_memory": True,
        "buffer_count": 6,
        "buffer_size": "128M",
        "persistence_threshold": 4096,
    },
    "aio": {
        "block_size": "4k",
        "queue_depth": 32,
        "thread_count": 4,
        "direct_io": False,
        "checksum": True,
    },
    "prefetch": {"depth": 3},
    "gradient_clipping": 1.0,
    "loss_scale": {
        "initial": 1024.0,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": 50,
        "min_scale": 2.0,
    },
    "wrap": {"module_classes": ["GPTBlock", "my_pkg.model.Layer"], "min_params": 1_000_000},
    "telemetry": {"jsonl_path": "/tmp/offload-telemetry.jsonl"},
}

# The same config as a YAML file written by hand: unquoted 3e-4 / 1e-6 (YAML 1.1 reads them
# as strings; offload's loader must not), flow mappings, comments, byte sizes as strings.
FULL_YAML = """\
device: cuda:1
dtype: float16          # alias of fp16
optimizer:
  type: Adam
  lr: 3e-4
  betas: [0.8, 0.95]
  eps: 1e-6
  weight_decay: 0.1
  bias_correction: false
offload_optimizer: {device: nvme, nvme_path: /local_nvme/opt, pin_memory: no, buffer_count: 5,
                    buffer_size: 67108864, threads: 7}
offload_param:
  device: nvme
  nvme_path: /local_nvme/params
  buffer_count: 6
  buffer_size: 128 MiB
  persistence_threshold: 4096
aio: {block_size: 4KiB, queue_depth: 32, thread_count: 4, direct_io: false, checksum: true}
prefetch: {depth: 3}
gradient_clipping: 1
loss_scale: {initial: 1024, growth_factor: 4, backoff_factor: 0.25, growth_interval: 50,
             min_scale: 2}
wrap: {module_classes: [GPTBlock, my_pkg.model.Layer], min_params: 1e6}
telemetry: {jsonl_path: /tmp/offload-telemetry.jsonl}
"""


def test_defaults_fit_a_24gb_gpu_with_64gb_ram():
    cfg = load_config(None)
    assert cfg == OffloadConfig() == load_config({})
    assert cfg.device == "auto" and cfg.dtype == "bf16"
    assert cfg.offload_optimizer.device == "cpu" and cfg.offload_param.device == "none"
    pinned = (
        cfg.offload_optimizer.buffer_count * cfg.offload_optimizer.buffer_size
        + cfg.offload_param.buffer_count * cfg.offload_param.buffer_size
    )
    assert pinned <= 4 * 2**30  # a small slice of 64 GB
    assert cfg.aio.block_size % 4096 == 0 and cfg.gradient_clipping == 0.0


def test_dict_json_yaml_give_equal_objects(tmp_path: Path):
    from_dict = load_config(FULL)
    (tmp_path / "c.json").write_text(json.dumps(FULL))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(FULL))
    (tmp_path / "hand.yml").write_text(FULL_YAML)
    assert from_dict == load_config(tmp_path / "c.json")
    assert from_dict == load_config(str(tmp_path / "c.yaml"))
    assert from_dict == load_config(tmp_path / "hand.yml")
    assert from_dict.optimizer.lr == 3e-4 and from_dict.optimizer.betas == (0.8, 0.95)
    assert from_dict.offload_optimizer.buffer_size == 64 * 2**20
    assert from_dict.offload_param.buffer_size == 128 * 2**20
    assert from_dict.aio.block_size == 4096
    assert from_dict != OffloadConfig()


def test_to_dict_round_trips_and_is_json(tmp_path: Path):
    cfg = load_config(FULL)
    plain = cfg.to_dict()
    assert json.loads(json.dumps(plain)) == plain
    assert OffloadConfig.from_dict(plain) == cfg
    assert plain["offload_param"]["buffer_size"] == 128 * 2**20  # sizes as int bytes
    assert plain["optimizer"]["betas"] == [0.8, 0.95]
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(plain))
    assert load_config(tmp_path / "again.yaml") == cfg
    assert OffloadConfig().to_dict() == OffloadConfig.from_dict(OffloadConfig().to_dict()).to_dict()


def test_load_config_of_a_config_validates_again():
    cfg = load_config(FULL)
    again = load_config(cfg)
    assert again == cfg and again is not cfg
    cfg.optimizer.lr = -1.0  # sections are plain mutable dataclasses ...
    with pytest.raises(ConfigError, match=r"^optimizer\.lr: got -1\.0"):
        load_config(cfg)  # ... and load_config() checks them again
    with pytest.raises(ConfigError, match="optimizer.lr"):
        dataclasses.replace(cfg.optimizer)


def test_sections_are_kw_only_slotted_and_documented():
    for cls in [*SECTION_CLASSES, OffloadConfig]:
        params = dataclasses.fields(cls)
        assert params and all(f.kw_only for f in params), cls
        assert "__slots__" in cls.__dict__ and not hasattr(cls(), "__dict__"), cls
        with pytest.raises(TypeError):
            cls(params[0].default)  # positional arguments are refused
        docs = field_docs(cls)
        for f in params:
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            assert "\n" not in docs[f.name]


def test_sections_can_be_built_directly_and_normalize():
    opt = OffloadOptimizerConfig(buffer_size="64MiB", device="NVMe", nvme_path=Path("/x"))
    assert opt.buffer_size == 64 * 2**20 and opt.device == "nvme" and opt.nvme_path == "/x"
    cfg = OffloadConfig(
        dtype="bfloat16", device="CUDA:0", offload_optimizer=opt, aio={"block_size": "2MiB"}
    )
    assert cfg.dtype == "bf16" and cfg.device == "cuda:0" and cfg.aio.block_size == 2 * 2**20
    assert OptimizerConfig(type="AdamW").type == "adamw"
    assert OptimizerConfig(betas=[0, 0.5]).betas == (0.0, 0.5)
    assert WrapConfig(module_classes=["A", "A", "B"]).module_classes == ["A", "B"]


def test_empty_sections_take_defaults(tmp_path: Path):
    (tmp_path / "c.yaml").write_text("telemetry:\nprefetch:\n  depth: 0\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.telemetry == TelemetryConfig() and cfg.prefetch.depth == 0
    (tmp_path / "empty.yaml").write_text("# nothing\n")
    assert load_config(tmp_path / "empty.yaml") == OffloadConfig()


def test_public_face():
    assert offload.OffloadConfig is OffloadConfig
    assert offload.load_config is load_config and offload.ConfigError is ConfigError
    assert issubclass(ConfigError, ValueError)
    import offload.config as c

    assert set(c.__all__) == {
        "OffloadConfig",
        "load_config",
        "ConfigError",
        "parse_size",
        *(cls.__name__ for cls in SECTION_CLASSES),
    }


@pytest.mark.parametrize(
    "text, expected",
    [
        (4096, 4096),
        (0, 0),
        ("4096", 4096),
        ("4k", 4096),
        ("4K", 4096),
        ("4KiB", 4096),
        ("4kib", 4096),
        ("4KB", 4000),
        ("256MB", 256 * 10**6),
        ("256 MiB", 256 * 2**20),
        ("256M", 256 * 2**20),
        ("1GiB", 2**30),
        ("1g", 2**30),
        ("1GB", 10**9),
        ("2TB", 2 * 10**12),
        ("1T", 2**40),
        ("1.5GiB", 3 * 2**29),
        ("0.5KB", 500),
        (" 7 B ", 7),
        (1e8, 100_000_000),
        (2.0**20 + 3, 2**20 + 3),
    ],
)
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected
    assert type(parse_size(text)) is int


UNIT_FACTORS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
}


@given(
    n=st.integers(0, 10**6),
    unit=st.sampled_from(sorted(UNIT_FACTORS)),
    space=st.sampled_from(["", " "]),
    upper=st.booleans(),
)
def test_parse_size_is_number_times_unit(n, unit, space, upper):
    text = f"{n}{space}{unit.upper() if upper else unit.lower()}"
    assert parse_size(text) == n * UNIT_FACTORS[unit]


def test_choice_typos_get_a_suggestion():
    pattern = r"allowed: one of 'none', 'cpu', 'nvme' \(did you mean 'nvme'\?\)$"
    with pytest.raises(ConfigError, match=pattern):
        load_config({"offload_param": {"device": "nvm"}})


@pytest.mark.parametrize(
    "bad",
    [
        -1,
        -4096.0,
        1.5,
        "1.5",
        "-4k",
        "4 kbit",
        "4kk",
        "1e6",
        "",
        "GiB",
        True,
        None,
        [4096],
        float("inf"),
        float("nan"),
        "0.3B",
    ],
)
def test_parse_size_refuses(bad):
    with pytest.raises(ConfigError) as err:
        parse_size(bad, key="aio.block_size")
    msg = str(err.value)
    assert msg.startswith("aio.block_size: got ") and repr(bad) in msg and "\n" not in msg
    assert err.value.key == "aio.block_size"


# (config, dotted key named in the error, bad value as the user wrote it)
BAD = [
    ({"device": "gpu"}, "device", "gpu"),
    ({"device": "cuda:-1"}, "device", "cuda:-1"),
    ({"device": "cuda:01"}, "device", "cuda:01"),
    ({"dtype": "float8"}, "dtype", "float8"),
    ({"dtype": 16}, "dtype", 16),
    ({"optimizer": "adam"}, "optimizer", "adam"),
    ({"optimizer": {"type": "sgd"}}, "optimizer.type", "sgd"),
    ({"optimizer": {"lr": 0}}, "optimizer.lr", 0),
    ({"optimizer": {"lr": -1e-3}}, "optimizer.lr", -1e-3),
    ({"optimizer": {"lr": "1e-4"}}, "optimizer.lr", "1e-4"),
    ({"optimizer": {"lr": math.inf}}, "optimizer.lr", math.inf),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas", [0.9, 1.0]),
    ({"optimizer": {"betas": [0.9]}}, "optimizer.betas", [0.9]),
    ({"optimizer": {"betas": [-0.1, 0.9]}}, "optimizer.betas", [-0.1, 0.9]),
    ({"optimizer": {"eps": 0.0}}, "optimizer.eps", 0.0),
    ({"optimizer": {"weight_decay": -0.01}}, "optimizer.weight_decay", -0.01),
    ({"optimizer": {"bias_correction": 1}}, "optimizer.bias_correction", 1),
    ({"offload_optimizer": {"device": "gpu"}}, "offload_optimizer.device", "gpu"),
    ({"offload_optimizer": {"device": "nvme"}}, "offload_optimizer.nvme_path", None),
    ({"offload_optimizer": {"pin_memory": "yes"}}, "offload_optimizer.pin_memory", "yes"),
    ({"offload_optimizer": {"buffer_count": 0}}, "offload_optimizer.buffer_count", 0),
    ({"offload_optimizer": {"buffer_count": "4"}}, "offload_optimizer.buffer_count", "4"),
    ({"offload_optimizer": {"buffer_count": 2.5}}, "offload_optimizer.buffer_count", 2.5),
    ({"offload_optimizer": {"buffer_size": "12KB"}}, "offload_optimizer.buffer_size", "12KB"),
    ({"offload_optimizer": {"buffer_size": "lots"}}, "offload_optimizer.buffer_size", "lots"),
    ({"offload_optimizer": {"buffer_size": 0}}, "offload_optimizer.buffer_size", 0),
    ({"offload_optimizer": {"buffer_size": "2TiB"}}, "offload_optimizer.buffer_size", "2TiB"),
    ({"offload_optimizer": {"threads": -1}}, "offload_optimizer.threads", -1),
    ({"offload_param": {"device": "disk"}}, "offload_param.device", "disk"),
    ({"offload_param": {"device": "nvme", "nvme_path": ""}}, "offload_param.nvme_path", ""),
    ({"offload_param": {"buffer_size": -4096}}, "offload_param.buffer_size", -4096),
    ({"offload_param": {"persistence_threshold": 1.5}}, "offload_param.persistence_threshold", 1.5),
    ({"aio": {"block_size": 1000}}, "aio.block_size", 1000),
    ({"aio": {"queue_depth": 0}}, "aio.queue_depth", 0),
    ({"aio": {"thread_count": True}}, "aio.thread_count", True),
    ({"aio": {"direct_io": "on"}}, "aio.direct_io", "on"),
    ({"aio": {"checksum": None}}, "aio.checksum", None),
    ({"prefetch": {"depth": -1}}, "prefetch.depth", -1),
    ({"gradient_clipping": -1.0}, "gradient_clipping", -1.0),
    ({"gradient_clipping": "1.0"}, "gradient_clipping", "1.0"),
    ({"loss_scale": {"initial": 0}}, "loss_scale.initial", 0),
    ({"loss_scale": {"backoff_factor": 1.5}}, "loss_scale.backoff_factor", 1.5),
    ({"loss_scale": {"growth_factor": 0.5}}, "loss_scale.growth_factor", 0.5),
    ({"loss_scale": {"growth_interval": 0}}, "loss_scale.growth_interval", 0),
    ({"loss_scale": {"min_scale": 1e6}}, "loss_scale.min_scale", 1e6),
    ({"wrap": {"module_classes": "GPTBlock"}}, "wrap.module_classes", "GPTBlock"),
    ({"wrap": {"module_classes": ["not a name"]}}, "wrap.module_classes", ["not a name"]),
    ({"wrap": {"min_params": -5}}, "wrap.min_params", -5),
    ({"telemetry": {"jsonl_path": 3}}, "telemetry.jsonl_path", 3),
]


@pytest.mark.parametrize("config, key, value", BAD, ids=[f"{k}={v!r}" for _, k, v in BAD])
def test_bad_config_names_key_and_value(config, key, value):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    msg = str(err.value)
    assert msg.startswith(f"{key}: got {value!r}; allowed: "), msg
    assert "\n" not in msg and len(msg) < 400
    assert err.value.key == key


@pytest.mark.parametrize(
    "config, key, suggestion",
    [
        ({"offload_optimzer": {}}, "offload_optimzer", "offload_optimizer"),
        ({"aio": {"queue_deph": 8}}, "aio.queue_deph", "aio.queue_depth"),
        (
            {"offload_param": {"buffer_sz": "1MiB"}},
            "offload_param.buffer_sz",
            "offload_param.buffer_size",
        ),
        ({"lr": 1e-3}, "lr", "optimizer.lr"),
        ({"nvme_path": "/x"}, "nvme_path", "offload_optimizer.nvme_path"),
        ({"wrap": {"classes": ["Block"]}}, "wrap.classes", "wrap.module_classes"),
    ],
)
def test_unknown_keys_suggest_the_right_one(config, key, suggestion):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    msg = str(err.value)
    assert msg.startswith(f"{key}: unknown key; did you mean '{suggestion}'?"), msg
    assert "\n" not in msg and err.value.key == key


def test_unknown_key_without_a_close_match_lists_the_allowed_keys():
    with pytest.raises(ConfigError, match=r"^prefetch\.zzz: unknown key; allowed: depth$"):
        load_config({"prefetch": {"zzz": 1}})


def test_errors_from_a_file_name_the_file(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizer:\n  lr: -2\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert (
        str(err.value) == f"optimizer.lr: got -2; allowed: a finite number > 0 (learning "
        f"rate) (in {bad})"
    )
    assert err.value.key == "optimizer.lr" and err.value.source == str(bad)


@pytest.mark.parametrize(
    "name, text, pattern",
    [
        ("missing.json", None, "config file not found"),
        ("broken.json", '{"dtype": "bf16",}', "not valid JSON: .* line 1 column"),
        ("broken.yaml", "optimizer: {lr: [\n", "not valid YAML"),
        ("twice.json", '{"dtype": "bf16", "dtype": "fp16"}', "key 'dtype' appears twice"),
        (
            "twice.yaml",
            "aio:\n  queue_depth: 4\n  queue_depth: 8\n",
            "key 'queue_depth' appears twice .*line 3",
        ),
        ("config.toml", "dtype = 'bf16'", "unsupported config file extension '.toml'"),
        ("list.json", "[1, 2]", "<config>: got \\[1, 2\\]"),
    ],
)
def test_file_problems_are_one_line_errors(tmp_path: Path, name, text, pattern):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=pattern) as err:
        load_config(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_load_config_refuses_other_types():
    with pytest.raises(ConfigError, match="<config>: got 42"):
        load_config(42)


def test_readme_reference_is_generated_from_the_code():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = "<!-- config-reference:start -->\n"
    body = readme[readme.index(start) + len(start) : readme.index("<!-- config-reference:end -->")]
    assert body == reference_markdown(), (
        "README config reference is stale: regenerate with python -m offload.config._reference"
    )
    for cls in SECTION_CLASSES:
        for f in dataclasses.fields(cls):
            assert f"`{cls.KEY}.{f.name}`" in body
