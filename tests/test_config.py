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
    AutoSize,
    ConfigError,
    DistributedConfig,
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
    resolve_auto_buffer_size,
)
from offload.config._reference import field_docs, reference_markdown
from offload.config.sections import DEFAULT_BUFFER_SIZE

SECTION_CLASSES = [
    OptimizerConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    AioConfig,
    PrefetchConfig,
    LossScaleConfig,
    WrapConfig,
    TelemetryConfig,
    DistributedConfig,
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
    "distributed": {"stage": 3, "timeout": 120.0, "reduce_dtype": "fp16"},
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
distributed: {stage: 3, timeout: 120, reduce_dtype: half}
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
        "AutoSize",
        "resolve_auto_buffer_size",
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
        ("1e8", 100_000_000),
        ("1E8", 100_000_000),
        ("1e+8", 100_000_000),
        ("1.5e3", 1500),
        ("2.5e3MB", 2_500_000_000),
        ("16MB", 16_000_000),
        ("16MiB", 16 * 2**20),
        (100_000_000, 100_000_000),
        ("15e-1KB", 1500),
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
        "1e-3",
        "1e999999999",
        "1e31",
        "9" * 70,
        "\u0663",  # an Arabic-Indic digit: \\d without re.ASCII would take it
        "4\u212a",  # the Kelvin sign lower-cases to 'k'
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
    ({"offload_optimizer": {"buffer_size": "lots"}}, "offload_optimizer.buffer_size", "lots"),
    ({"offload_optimizer": {"buffer_size": 0}}, "offload_optimizer.buffer_size", 0),
    ({"offload_optimizer": {"buffer_size": "0MB"}}, "offload_optimizer.buffer_size", "0MB"),
    ({"offload_optimizer": {"buffer_size": "2TiB"}}, "offload_optimizer.buffer_size", "2TiB"),
    ({"offload_optimizer": {"buffer_size": math.nan}}, "offload_optimizer.buffer_size", math.nan),
    ({"offload_optimizer": {"buffer_size": math.inf}}, "offload_optimizer.buffer_size", math.inf),
    ({"offload_optimizer": {"buffer_size": True}}, "offload_optimizer.buffer_size", True),
    ({"offload_optimizer": {"buffer_size": "-16MB"}}, "offload_optimizer.buffer_size", "-16MB"),
    ({"offload_optimizer": {"buffer_size": 1.5}}, "offload_optimizer.buffer_size", 1.5),
    ({"offload_optimizer": {"buffer_size": None}}, "offload_optimizer.buffer_size", None),
    ({"offload_optimizer": {"buffer_size": "autoo"}}, "offload_optimizer.buffer_size", "autoo"),
    ({"offload_optimizer": {"threads": -1}}, "offload_optimizer.threads", -1),
    ({"offload_param": {"device": "disk"}}, "offload_param.device", "disk"),
    ({"offload_param": {"device": "nvme", "nvme_path": ""}}, "offload_param.nvme_path", ""),
    ({"offload_param": {"buffer_size": -4096}}, "offload_param.buffer_size", -4096),
    ({"offload_param": {"persistence_threshold": 1.5}}, "offload_param.persistence_threshold", 1.5),
    ({"aio": {"block_size": 0}}, "aio.block_size", 0),
    ({"aio": {"block_size": "auto"}}, "aio.block_size", "auto"),
    ({"aio": {"block_size": 2**30 + 1}}, "aio.block_size", 2**30 + 1),
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
    ({"loss_scale": {"enabled": "yes"}}, "loss_scale.enabled", "yes"),
    ({"loss_scale": {"enabled": 1}}, "loss_scale.enabled", 1),
    # fp16 compute's gradients need the scale
    ({"dtype": "fp16", "loss_scale": {"enabled": False}}, "loss_scale.enabled", False),
    ({"wrap": {"module_classes": "GPTBlock"}}, "wrap.module_classes", "GPTBlock"),
    ({"wrap": {"module_classes": ["not a name"]}}, "wrap.module_classes", ["not a name"]),
    ({"wrap": {"min_params": -5}}, "wrap.min_params", -5),
    ({"wrap": {"check_reads": -1}}, "wrap.check_reads", -1),
    ({"wrap": {"check_reads": True}}, "wrap.check_reads", True),
    ({"telemetry": {"jsonl_path": 3}}, "telemetry.jsonl_path", 3),
    ({"distributed": {"reduce_dtype": "fp8"}}, "distributed.reduce_dtype", "fp8"),
    ({"distributed": {"reduce_dtype": 32}}, "distributed.reduce_dtype", 32),
    ({"distributed": {"reduce_dtype": None}}, "distributed.reduce_dtype", None),
    # a sum in a 16-bit dtype other than the compute dtype
    ({"distributed": {"reduce_dtype": "fp16"}}, "distributed.reduce_dtype", "fp16"),
    (
        {"dtype": "fp32", "distributed": {"reduce_dtype": "bf16"}},
        "distributed.reduce_dtype",
        "bf16",
    ),
    (
        {"dtype": "fp16", "distributed": {"reduce_dtype": "bf16"}},
        "distributed.reduce_dtype",
        "bf16",
    ),
    # every wrap refused it, after `offload config` had called the file valid
    (
        {"offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 3}},
        "offload_optimizer.buffer_count",
        3,
    ),
]


def test_a_path_starting_with_a_tilde_is_in_the_home_directory(monkeypatch, tmp_path):
    """`nvme_path: ~/nvme` made a directory named '~' in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(
        {
            "offload_optimizer": {"device": "nvme", "nvme_path": "~/nvme"},
            "offload_param": {"device": "nvme", "nvme_path": "~"},
            "telemetry": {"jsonl_path": "~/steps.jsonl"},
        }
    )
    assert cfg.offload_optimizer.nvme_path == str(tmp_path / "nvme")
    assert cfg.offload_param.nvme_path == str(tmp_path)
    assert cfg.telemetry.jsonl_path == str(tmp_path / "steps.jsonl")
    monkeypatch.chdir(tmp_path)
    jsonl = load_config({"telemetry": {"jsonl_path": "a~/b"}}).telemetry.jsonl_path
    assert jsonl == str(tmp_path / "a~" / "b")


def test_a_relative_path_is_made_absolute_when_the_config_is_read(monkeypatch, tmp_path):
    """A relative nvme_path was kept as written and reopened at every swap read and write, so
    an os.chdir() between steps (a notebook's %cd) failed the next step. Every spelling the
    loader takes (a dict, a file, a section built in code, a DeepSpeed config) now holds the
    path joined to the working directory of the moment it is read; absolute paths stay as
    written, and a '..' is kept (the kernel resolves it after any link before it)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    run = tmp_path / "run"
    data = {
        "offload_param": {"device": "NVMe ", "nvme_path": "swap"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "./swap/../opt"},
        "telemetry": {"jsonl_path": "steps.jsonl"},
    }
    (run / "c.yaml").write_text(yaml.safe_dump(data))
    deepspeed = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": "swap"},
            "offload_optimizer": {"device": "nvme", "nvme_path": "123"},
        }
    }
    configs = [load_config(data), load_config("c.yaml"), load_config(deepspeed)]
    section = OffloadOptimizerConfig(device="nvme", nvme_path=Path("swap"))
    monkeypatch.chdir(tmp_path / "elsewhere")
    for cfg in configs[:2]:
        assert cfg.offload_param.nvme_path == str(run / "swap")
        assert cfg.offload_optimizer.nvme_path == f"{run}/swap/../opt"
        assert cfg.telemetry.jsonl_path == str(run / "steps.jsonl")
    assert configs[2].offload_param.nvme_path == str(run / "swap")
    assert configs[2].offload_optimizer.nvme_path == str(run / "123")
    assert section.nvme_path == str(run / "swap")
    assert OffloadConfig.from_dict(configs[0].to_dict()) == configs[0]  # read back elsewhere
    assert load_config({"telemetry": {"jsonl_path": "/x//y/"}}).telemetry.jsonl_path == "/x//y/"


def test_a_relative_nvme_path_survives_a_chdir_between_steps(monkeypatch, tmp_path):
    """Wrapped with a relative nvme_path, a step after os.chdir() failed reading
    'swap/offload-.../...', left the engine in its failed state, and close() left the swap
    directories behind."""
    from engine_models import batches, lm_loss, make_model, placement_config

    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    model, opt = offload.wrap(make_model(), placement_config("nvme", "nvme", Path("swap")))
    data = batches(2)
    try:
        for tokens in data:
            lm_loss(model, tokens).backward()
            opt.step()
            opt.zero_grad()
            monkeypatch.chdir(tmp_path / "elsewhere")
    finally:
        opt.close()
    swap = tmp_path / "run" / "swap"
    assert [list(d.iterdir()) for d in (swap / "nvme_p", swap / "nvme_o")] == [[], []]
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.parametrize("config, key, value", BAD, ids=[f"{k}={v!r}" for _, k, v in BAD])
def test_bad_config_names_key_and_value(config, key, value):
    with pytest.raises(ConfigError) as err:
        load_config(config)
    msg = str(err.value)
    assert msg.startswith(f"{key}: got {value!r}; allowed: "), msg
    assert "\n" not in msg and len(msg) < 400
    assert err.value.key == key


@pytest.mark.parametrize(
    "stage", [10**400, -(10**400), float("nan"), 2.5], ids=["1e400", "-1e400", "nan", "2.5"]
)
def test_a_stage_no_float_can_hold_is_refused_by_name(stage):
    """An int beyond the float range once raised OverflowError (found by test_config_fuzz)."""
    with pytest.raises(ConfigError) as err:
        load_config({"distributed": {"stage": stage}})
    assert err.value.key == "distributed.stage"
    assert "allowed: 1, 2, 3" in str(err.value) and len(str(err.value)) < 400


@pytest.mark.parametrize(
    "dtype, value, stored, summed",
    [
        ("bf16", None, "fp32", "fp32"),  # the default: the master's dtype
        ("bf16", "BFloat16", "bf16", "bf16"),
        ("bf16", "bfp16", "bf16", "bf16"),  # DeepSpeed's spelling
        ("bf16", "auto", "auto", "bf16"),  # the compute dtype
        ("fp16", "half", "fp16", "fp16"),
        ("fp16", "auto", "auto", "fp16"),
        ("fp16", "float32", "fp32", "fp32"),
        ("fp32", "auto", "auto", "fp32"),
    ],
)
def test_reduce_dtype_is_fp32_unless_asked_and_auto_is_the_compute_dtype(
    dtype, value, stored, summed
):
    section = {} if value is None else {"reduce_dtype": value}
    cfg = load_config({"dtype": dtype, "distributed": section})
    assert cfg.distributed.reduce_dtype == stored
    assert cfg.distributed.resolve_reduce_dtype(cfg.dtype) == summed
    assert load_config(cfg.to_dict()) == cfg


def test_a_reduce_dtype_the_compute_dtype_cannot_use_says_what_it_can():
    with pytest.raises(ConfigError) as err:
        load_config({"dtype": "bf16", "distributed": {"reduce_dtype": "fp16"}})
    assert str(err.value) == (
        "distributed.reduce_dtype: got 'fp16'; allowed: 'fp32', 'auto' or the compute dtype "
        "(dtype is 'bf16')"
    )
    with pytest.raises(ConfigError) as err:
        load_config({"distributed": {"reduce_dtype": "fp8"}})
    assert "allowed: one of 'fp32', 'bf16', 'fp16', 'auto'" in str(err.value)


@pytest.mark.parametrize(
    "dtype, value, added",
    [
        ("bf16", None, "fp32"),  # the default: as stages 2 and 3 and one rank add them
        ("bf16", "bfloat16", "bf16"),
        ("bf16", "auto", "bf16"),
        ("fp16", "fp16", "fp16"),
        ("fp32", "auto", "fp32"),
    ],
)
def test_grad_accum_dtype_is_fp32_unless_asked(dtype, value, added):
    section = {} if value is None else {"grad_accum_dtype": value}
    cfg = load_config({"dtype": dtype, "distributed": section})
    assert cfg.distributed.resolve_grad_accum_dtype(cfg.dtype) == added
    assert load_config(cfg.to_dict()) == cfg


def test_a_grad_accum_dtype_the_compute_dtype_cannot_use_says_what_it_can():
    with pytest.raises(ConfigError) as err:
        load_config({"dtype": "fp16", "distributed": {"grad_accum_dtype": "bf16"}})
    assert str(err.value) == (
        "distributed.grad_accum_dtype: got 'bf16'; allowed: 'fp32', 'auto' or the compute "
        "dtype (dtype is 'fp16')"
    )
    assert err.value.key == "distributed.grad_accum_dtype"
    with pytest.raises(ConfigError, match="allowed: one of 'fp32', 'bf16', 'fp16', 'auto'"):
        load_config({"distributed": {"grad_accum_dtype": "int8"}})


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


# --- any byte size, rounded up to the IO alignment where the key needs it ------------------

SWAP_KEYS = ["offload_param.buffer_size", "offload_optimizer.buffer_size", "aio.block_size"]


def _with(dotted: str, value) -> dict:
    section, name = dotted.split(".")
    return {section: {name: value}}


def _get(cfg: OffloadConfig, dotted: str):
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


@pytest.mark.parametrize("key", SWAP_KEYS)
@pytest.mark.parametrize(
    "value, expected",
    [
        ("16MB", 16_003_072),  # 16,000,000 is not a multiple of 4096: 3907 x 4096 is next
        ("256MB", 256_000_000),  # happens to be one already (62,500 x 4096)
        ("16MiB", 16 * 2**20),
        (1e8, 100_003_840),
        ("1e8", 100_003_840),
        (100_000_000, 100_003_840),
        (1000, 4096),
        (1, 4096),
        (4096, 4096),
        (4097, 8192),
        ("1GB", 1_000_001_536),
    ],
)
def test_sizes_are_rounded_up_to_4096(key, value, expected):
    cfg = load_config(_with(key, value))
    got = _get(cfg, key)
    assert got == expected and type(got) is int and got % 4096 == 0
    assert 0 <= got - parse_size(value) < 4096  # up, never down, by less than one page
    assert load_config(cfg.to_dict()) == cfg  # the rounded value is stable


def test_rounding_is_logged_with_key_value_and_result(caplog):
    with caplog.at_level("INFO", logger="offload.config"):
        load_config({"offload_param": {"buffer_size": "16MB"}})
    (record,) = [r for r in caplog.records if "rounded" in r.getMessage()]
    text = record.getMessage()
    assert text.startswith("offload_param.buffer_size: '16MB' is 16000000 bytes")
    assert "rounded up to 16003072" in text and "4096" in text
    caplog.clear()
    with caplog.at_level("INFO", logger="offload.config"):
        load_config({"offload_optimizer": {"buffer_size": 1000}})
    assert (
        caplog.records[-1]
        .getMessage()
        .startswith(
            "offload_optimizer.buffer_size: 1000, rounded up to 4096 (4 KiB), a multiple of 4096"
        )
    )
    caplog.clear()
    with caplog.at_level("INFO", logger="offload.config"):
        load_config({"offload_param": {"buffer_size": "16MiB"}})  # nothing to round
    assert not [r for r in caplog.records if "rounded" in r.getMessage()]


def test_size_errors_say_what_is_allowed_once_and_clearly():
    """The old message for a too-small size said both '>= 0' and '>= 4096' and never mentioned
    the multiple-of-4096 rule; now every size error states the range and the rounding once."""
    for bad in (0, -1, "0MB", math.nan, "garbage"):
        with pytest.raises(ConfigError) as err:
            load_config({"offload_optimizer": {"buffer_size": bad}})
        msg = str(err.value)
        assert msg.startswith(f"offload_optimizer.buffer_size: got {bad!r}; allowed: ")
        assert ">= 0" not in msg and ">= 4096" not in msg
        assert "> 0" in msg and "rounded up to a multiple of 4096" in msg and "'auto'" in msg
    with pytest.raises(ConfigError) as err:
        load_config({"aio": {"block_size": 2**30 + 1}})
    assert str(err.value).endswith(
        f"{2**30 + 1} bytes rounds up to {2**30 + 4096}, above the maximum"
    )
    assert load_config({"aio": {"block_size": 2**30 - 1}}).aio.block_size == 2**30


# --- "auto" swap buffer sizes ------------------------------------------------------------

POOLS = ["offload_param", "offload_optimizer"]


@pytest.mark.parametrize("section", POOLS)
def test_buffer_size_defaults_to_auto_capped_at_the_old_default(section):
    sec = getattr(OffloadConfig(), section)
    assert sec.buffer_size_is_auto and isinstance(sec.buffer_size, AutoSize)
    # code that reads the field as a number (wrap, today) gets the cap: the former default
    assert int(sec.buffer_size) == DEFAULT_BUFFER_SIZE == 256 * 2**20
    assert sec.buffer_size // 4 == DEFAULT_BUFFER_SIZE // 4 and sec.buffer_size % 4096 == 0
    for spelled in ("auto", "AUTO", " Auto "):
        assert getattr(
            load_config({section: {"buffer_size": spelled}}), section
        ).buffer_size_is_auto
    explicit = load_config({section: {"buffer_size": "256MiB"}})
    assert not getattr(explicit, section).buffer_size_is_auto
    assert explicit != OffloadConfig()  # "auto" and an explicit 256 MiB are different requests


def test_auto_survives_every_copy(tmp_path: Path):
    cfg = load_config({"offload_param": {"device": "cpu"}})
    assert cfg.to_dict()["offload_param"]["buffer_size"] == "auto"
    assert load_config(cfg) == cfg and load_config(cfg).offload_param.buffer_size_is_auto
    assert dataclasses.replace(cfg.offload_param, device="none").buffer_size_is_auto
    assert OffloadConfig(offload_param=cfg.offload_param).offload_param.buffer_size_is_auto
    (tmp_path / "c.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    assert load_config(tmp_path / "c.json") == cfg == load_config(tmp_path / "c.yaml")
    assert repr(cfg.offload_param.buffer_size) == f"AutoSize({DEFAULT_BUFFER_SIZE})"


@pytest.mark.parametrize(
    "largest, expected",
    [
        (0, 2**20),  # never below one IO block (aio.block_size, 1 MiB)
        (1, 2**20),
        (2**20, 2**20),
        (2**20 + 1, 2**20 + 4096),  # rounded up to 4096
        (10_000_000, 10_002_432),
        (DEFAULT_BUFFER_SIZE, DEFAULT_BUFFER_SIZE),
        (DEFAULT_BUFFER_SIZE + 1, DEFAULT_BUFFER_SIZE),  # never above the old default
        (10**12, DEFAULT_BUFFER_SIZE),
    ],
)
@pytest.mark.parametrize("section", POOLS)
def test_resolve_auto_buffer_size(section, largest, expected):
    assert resolve_auto_buffer_size(section, OffloadConfig(), largest) == expected


def test_resolve_auto_follows_the_io_block_and_leaves_explicit_sizes_alone():
    small_blocks = load_config({"aio": {"block_size": "64KiB"}})
    assert resolve_auto_buffer_size("offload_param", small_blocks, 1000) == 64 * 1024
    assert resolve_auto_buffer_size("offload_param", small_blocks, 100_000) == 102_400
    explicit = load_config({"offload_optimizer": {"buffer_size": "16MB"}})
    for largest in (0, 10**3, 10**12):  # an explicit size is what wrap allocates, as is
        got = resolve_auto_buffer_size("offload_optimizer", explicit, largest)
        assert got == 16_003_072 and type(got) is int
    assert resolve_auto_buffer_size("offload_param", explicit, 10**3) == 2**20  # still auto


@given(
    largest=st.integers(0, 2**34),
    block=st.sampled_from(["4KiB", "64KiB", "1MiB", "8MiB", "512MiB"]),
    section=st.sampled_from(POOLS),
)
def test_resolve_auto_bounds(largest, block, section):
    cfg = load_config({"aio": {"block_size": block}})
    got = resolve_auto_buffer_size(section, cfg, largest)
    assert got % 4096 == 0 and got <= DEFAULT_BUFFER_SIZE
    assert got >= min(DEFAULT_BUFFER_SIZE, cfg.aio.block_size)
    if largest <= DEFAULT_BUFFER_SIZE:
        assert got >= largest  # the largest unit fits one buffer: one piece per unit
    assert got <= resolve_auto_buffer_size(section, cfg, largest + 4096)  # monotone


@pytest.mark.parametrize(
    "args, match",
    [
        (("offload_params", 1), "section must be one of"),
        (("aio", 1), "section must be one of"),
        (("offload_param", -1), ">= 0"),
        (("offload_param", True), "must be an int"),
        (("offload_param", 1.5), "must be an int"),
    ],
)
def test_resolve_auto_refuses_programming_errors(args, match):
    section, largest = args
    with pytest.raises(ValueError, match=match):
        resolve_auto_buffer_size(section, OffloadConfig(), largest)


def test_an_integer_bound_is_written_as_an_integer():
    """The allowed range printed ``<= 1.04858e+06`` for gradient_accumulation_steps."""
    with pytest.raises(ConfigError, match=r"allowed: an integer >= 1 and <= 1048576 ") as err:
        load_config({"gradient_accumulation_steps": 0})
    assert "e+0" not in str(err.value)
