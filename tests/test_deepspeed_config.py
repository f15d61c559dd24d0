"""DeepSpeed configs load, map onto OffloadConfig, and never drop a key silently."""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path

import pytest

from offload.config import ConfigError, OffloadConfig, load_config
from offload.config.deepspeed import is_deepspeed_config, map_deepspeed

ALIGN = 4096

# A ZeRO-Infinity config as DeepSpeed's docs shape it: params and optimizer state on NVMe, an
# aio section, bf16, plus keys offload does not support (one a typo DeepSpeed would ignore).
ZERO_INFINITY = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "steps_per_print": 100,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 4,
            "pipeline_read": True,
            "pipeline_write": True,
            "fast_init": False,
        },
        "offload_paramm": {"device": "cpu"},  # typo: DeepSpeed would ignore it silently
    },
    "aio": {
        "block_size": 1048576,
        "queue_depth": 16,
        "thread_count": 2,
        "single_submit": False,
        "overlap_events": True,
        "use_gds": False,
    },
}
UNSUPPORTED = [
    "train_micro_batch_size_per_gpu",
    "steps_per_print",
    "zero_optimization.overlap_comm",
    "zero_optimization.contiguous_gradients",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.offload_param.max_in_cpu",
    "zero_optimization.offload_optimizer.fast_init",
    "zero_optimization.offload_paramm",
]


def _padded(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def _warnings(caplog) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name == "offload.config" and r.levelno >= logging.WARNING
    ]


def test_zero_infinity_config_maps_and_warns_once(caplog, tmp_path: Path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO_INFINITY))
    with caplog.at_level(logging.INFO, logger="offload.config"):
        cfg = load_config(path)
    assert isinstance(cfg, OffloadConfig)
    assert cfg.dtype == "bf16" and cfg.gradient_clipping == 1.0
    assert cfg.gradient_accumulation_steps == 8
    assert cfg.optimizer.type == "adamw" and cfg.optimizer.lr == 2e-4
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.optimizer.weight_decay == 0.1
    p, o = cfg.offload_param, cfg.offload_optimizer
    assert (p.device, p.nvme_path, p.pin_memory, p.buffer_count) == ("nvme", "/local_nvme", True, 5)
    # DeepSpeed's buffer_size is 1e8 ELEMENTS of bf16 -> 2e8 bytes, padded to 4096
    assert p.buffer_size == _padded(100_000_000 * 2) and p.buffer_size % ALIGN == 0
    assert p.persistence_threshold == 100_000
    assert (o.device, o.nvme_path, o.pin_memory, o.buffer_count) == ("nvme", "/local_nvme", True, 4)
    assert o.buffer_size == OffloadConfig().offload_optimizer.buffer_size  # offload's default
    assert o.buffer_size_is_auto and not p.buffer_size_is_auto
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.thread_count) == (2**20, 16, 2)
    assert cfg.aio.direct_io is True
    warnings = _warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    msg = warnings[0].getMessage()
    assert f"{len(UNSUPPORTED)} key(s)" in msg
    for key in UNSUPPORTED:
        assert key in msg
    assert "stage3_prefetch_bucket_size (use prefetch.depth" in msg
    # consumed without a warning: offload behaves the way these ask
    for key in ("pipeline_read", "single_submit", "overlap_events", "use_gds"):
        assert key not in msg
    listed = msg.split(": ", 1)[1].split("; ")
    assert "zero_optimization.stage" not in listed
    assert "zero_optimization.offload_paramm (did you mean offload_param?)" in listed
    assert load_config(ZERO_INFINITY) == cfg  # the dict gives the same object as the file


def test_mapping_result_lists_what_was_left_out():
    result = map_deepspeed(ZERO_INFINITY)
    assert [u.split(" ")[0] for u in result.unsupported] == UNSUPPORTED
    assert result.auto == []


@pytest.mark.parametrize(
    "dtype_section, dtype, itemsize",
    [
        ({"bf16": {"enabled": True}}, "bf16", 2),
        ({"fp16": {"enabled": True}}, "fp16", 2),
        ({"bfloat16": {"enabled": True}}, "bf16", 2),
        ({}, "fp32", 4),
        ({"bf16": {"enabled": False}, "fp16": {"enabled": False}}, "fp32", 4),
    ],
)
@pytest.mark.parametrize("elements", [1, 7, 1023, 2**20 + 3, 100_000_000])
def test_param_buffer_size_converts_elements_to_bytes(dtype_section, dtype, itemsize, elements):
    ds = {
        **dtype_section,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "buffer_size": elements},
        },
    }
    cfg = load_config(ds)
    assert cfg.dtype == dtype
    nbytes = cfg.offload_param.buffer_size
    assert nbytes % ALIGN == 0 and elements * itemsize <= nbytes < elements * itemsize + ALIGN


def test_fp16_dynamic_loss_scale_maps(caplog):
    ds = {
        "fp16": {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 12,
            "loss_scale_window": 500,
            "min_loss_scale": 0.5,
            "hysteresis": 2,
        }
    }
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        cfg = load_config(ds)
    ls = cfg.loss_scale
    assert cfg.dtype == "fp16" and ls.initial == 2.0**12 and ls.growth_interval == 500
    assert ls.min_scale == 0.5 and ls.growth_factor == 2.0 and ls.backoff_factor == 0.5
    (warning,) = _warnings(caplog)
    assert "fp16.hysteresis=2 (offload: 1)" in warning.getMessage()


def test_fp16_static_loss_scale_never_moves():
    cfg = load_config({"fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 20}})
    ls = cfg.loss_scale
    assert (ls.initial, ls.growth_factor, ls.backoff_factor) == (128.0, 1.0, 1.0)


@pytest.mark.parametrize(
    "bf16,fp16,dtype",
    [
        (False, "auto", "fp32"),
        ("auto", False, "bf16"),
        (False, True, "fp16"),
        ("auto", True, "fp16"),
    ],
)
def test_an_explicit_off_is_never_overridden_by_an_auto_beside_it(bf16, fp16, dtype):
    """bf16 said off beside fp16 "auto" gave bf16 (offload's default), against the explicit
    false: neither on is fp32, as DeepSpeed's."""
    cfg = load_config({"bf16": {"enabled": bf16}, "fp16": {"enabled": fp16}})
    assert cfg.dtype == dtype


@pytest.mark.parametrize("order", ["bf16 first", "bfloat16 first"])
def test_bf16_wins_over_its_older_name_bfloat16_as_in_deepspeed(caplog, order):
    """Both sections mapped onto one key, so the last in the file won: bf16 on and bfloat16 off
    trained in fp32 or bf16 by their order. DeepSpeed reads bfloat16 only where bf16 is
    absent; so does offload now, and lists the one it ignores. Alone, bfloat16 is read, its
    errors under its own name (they named bf16.enabled)."""
    pair = [("bf16", {"enabled": True}), ("bfloat16", {"enabled": False})]
    ds = dict(pair if order == "bf16 first" else pair[::-1])
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        assert load_config(ds).dtype == "bf16"
    (warning,) = _warnings(caplog)
    assert "bfloat16 (DeepSpeed's older name of bf16" in warning.getMessage()
    assert load_config({"bfloat16": {"enabled": True}}).dtype == "bf16"
    assert load_config({"bfloat16": {"enabled": False}}).dtype == "fp32"
    with pytest.raises(ConfigError, match=r"^bfloat16\.enabled: got 'yes'"):
        load_config({"bfloat16": {"enabled": "yes"}})
    with pytest.raises(ConfigError, match=r"false when bfloat16\.enabled is true"):
        load_config({"bfloat16": {"enabled": True}, "fp16": {"enabled": True}})


def test_hf_trainer_auto_values_take_offload_defaults(caplog):
    ds = {
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "reduce_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    with caplog.at_level(logging.INFO, logger="offload.config"):
        cfg = load_config(ds)
    default = OffloadConfig()
    assert cfg.dtype == default.dtype and cfg.optimizer == default.optimizer
    assert cfg.gradient_clipping == default.gradient_clipping
    assert cfg.offload_param == default.offload_param
    assert _warnings(caplog) == []  # nothing was asked of the unsupported keys
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1
    for key in (
        "optimizer.params.lr",
        "gradient_clipping",
        "train_batch_size",
        "zero_optimization.reduce_bucket_size",
    ):
        assert key in infos[0]


def test_hf_trainer_auto_buffer_size_is_offloads_auto():
    ds = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "buffer_size": "auto"},
        },
        "train_batch_size": 8,
    }
    assert load_config(ds).offload_param.buffer_size_is_auto


def test_deepspeed_byte_sizes_round_up_and_name_the_deepspeed_key():
    cfg = load_config({"zero_optimization": {"stage": 3}, "aio": {"block_size": 1e6}})
    assert cfg.aio.block_size == 1_003_520  # 1e6 bytes, rounded up to 245 x 4096
    with pytest.raises(ConfigError, match=r"^aio\.block_size: got 'lots'; allowed: a byte"):
        load_config({"zero_optimization": {"stage": 3}, "aio": {"block_size": "lots"}})


@pytest.mark.parametrize("w_mode, expected", [(None, "adamw"), (True, "adamw"), (False, "adam")])
def test_deepspeed_adam_is_adamw_unless_adam_w_mode_is_false(w_mode, expected):
    params = {"lr": 1e-3} if w_mode is None else {"lr": 1e-3, "adam_w_mode": w_mode}
    cfg = load_config({"optimizer": {"type": "Adam", "params": params}})
    assert cfg.optimizer.type == expected


def test_optimizer_device_none_maps_to_cpu_with_a_warning(caplog):
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}
    with caplog.at_level(logging.WARNING, logger="offload.config"):
        cfg = load_config(ds)
    assert cfg.offload_optimizer.device == "cpu"
    (warning,) = _warnings(caplog)
    assert "zero_optimization.offload_optimizer.device='none'" in warning.getMessage()


@pytest.mark.parametrize(
    "ds, key, value",
    [
        ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type", "Lamb"),
        ({"optimizer": {"type": "Adam", "params": {"lr": -1}}}, "optimizer.params.lr", -1),
        (
            {"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.5]}}},
            "optimizer.params.betas",
            [0.9, 1.5],
        ),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "fp16.enabled", True),
        ({"bf16": {"enabled": "yes"}}, "bf16.enabled", "yes"),
        ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale", -1),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", 4),
        ({"zero_optimization": True}, "zero_optimization", True),
        (
            {"zero_optimization": {"offload_param": {"device": "nvme"}}},
            "zero_optimization.offload_param.nvme_path",
            None,
        ),
        (
            {"zero_optimization": {"offload_param": {"device": "cpu", "buffer_size": 0}}},
            "zero_optimization.offload_param.buffer_size",
            0,
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "buffer_count": -1}}},
            "zero_optimization.offload_optimizer.buffer_count",
            -1,
        ),
        ({"zero_optimization": {"stage": 3}, "aio": {"block_size": 0}}, "aio.block_size", 0),
        ({"fp16": {"enabled": True, "loss_scale": float("nan")}}, "fp16.loss_scale", float("nan")),
        ({"gradient_clipping": -1, "train_batch_size": 8}, "gradient_clipping", -1),
        ({"communication_data_type": "fp8"}, "communication_data_type", "fp8"),
        (  # a bf16 model's gradients summed in fp16
            {"bf16": {"enabled": True}, "communication_data_type": "fp16"},
            "communication_data_type",
            "fp16",
        ),
    ],
)
def test_errors_name_the_deepspeed_key(ds, key, value):
    with pytest.raises(ConfigError) as err:
        load_config(ds)
    msg = str(err.value)
    assert msg.startswith(f"{key}: got {value!r}; allowed: "), msg
    assert "\n" not in msg and err.value.key == key


def test_integers_written_as_strings_in_zero_optimization_are_integers_as_in_deepspeed():
    """DeepSpeed validates zero_optimization with pydantic's lax mode: "stage": "3" and
    "buffer_count": " 6 " are integers there (0.19.8), "1e4" and "1.5" are refused. So here,
    but for nvme_path, whose "123" is a directory; outside that section strings stay strings
    (DeepSpeed hands optimizer.params to the optimizer as they are)."""
    zero = {
        "stage": "3",
        "stage3_param_persistence_threshold": "10000",
        "offload_param": {
            "device": "nvme", "nvme_path": "123", "buffer_count": " 6 ", "buffer_size": "1048576",
        },
        "offload_optimizer": {"device": "cpu", "buffer_count": "+4"},
    }  # fmt: skip
    cfg = map_deepspeed({"zero_optimization": zero, "bf16": {"enabled": True}}).config
    assert cfg.distributed.stage == 3 and cfg.offload_param.persistence_threshold == 10000
    assert cfg.offload_param.nvme_path == os.path.join(os.getcwd(), "123")  # (made absolute)
    assert cfg.offload_param.buffer_count == 6
    assert cfg.offload_param.buffer_size == 2 * 1048576 and cfg.offload_optimizer.buffer_count == 4
    for key, value in (
        ("stage", "three"),
        ("stage", "1.5"),
        ("stage3_param_persistence_threshold", "1e4"),
    ):
        with pytest.raises(ConfigError) as err:
            map_deepspeed({"zero_optimization": {key: value}})
        assert str(err.value).startswith(f"zero_optimization.{key}: got {value!r}; allowed: ")
    with pytest.raises(ConfigError) as err:
        map_deepspeed({"zero_optimization": {"stage": 2}, "optimizer": {"params": {"lr": "1e-4"}}})
    assert str(err.value).startswith("optimizer.params.lr: got '1e-4'; allowed: ")


@pytest.mark.parametrize(
    "dtype_section, value, want",
    [
        ({"bf16": {"enabled": True}}, "fp32", "fp32"),
        ({"bf16": {"enabled": True}}, "bfp16", "bf16"),  # DeepSpeed's spelling
        ({"bf16": {"enabled": True}}, "bf16", "bf16"),
        ({"fp16": {"enabled": True}}, "fp16", "fp16"),
        ({"fp16": {"enabled": True}}, None, "fp32"),  # absent: offload's default
        ({"bf16": {"enabled": True}}, "auto", "fp32"),
    ],
)
def test_communication_data_type_is_the_reduce_dtype(caplog, dtype_section, value, want):
    """DeepSpeed's ``communication_data_type`` was listed among the keys offload ignores."""
    ds = dict(dtype_section, zero_optimization={"stage": 2})
    if value is not None:
        ds["communication_data_type"] = value
    with caplog.at_level(logging.INFO, logger="offload.config"):
        cfg = load_config(ds)
    assert cfg.distributed.reduce_dtype == want
    assert not _warnings(caplog), [r.getMessage() for r in _warnings(caplog)]


@pytest.mark.parametrize(
    "dtype_section, value, want",
    [
        ({"bf16": {"enabled": True}}, "fp32", "fp32"),
        ({"bf16": {"enabled": True}}, "bf16", "bf16"),
        ({"bf16": {"enabled": True}}, None, "fp32"),  # absent: offload's default
    ],
)
def test_grad_accum_dtype_maps(caplog, dtype_section, value, want):
    """DeepSpeed's ``data_types.grad_accum_dtype`` (with ZeRO its default is the compute
    dtype; offload's is fp32)."""
    ds = dict(dtype_section, zero_optimization={"stage": 1})
    if value is not None:
        ds["data_types"] = {"grad_accum_dtype": value}
    with caplog.at_level(logging.INFO, logger="offload.config"):
        cfg = load_config(ds)
    assert cfg.distributed.grad_accum_dtype == want
    assert not _warnings(caplog), [r.getMessage() for r in _warnings(caplog)]
    with pytest.raises(ConfigError) as err:
        load_config(dict(ds, data_types={"grad_accum_dtype": "fp16"}))
    assert str(err.value).startswith("data_types.grad_accum_dtype: got 'fp16'; allowed: ")


def test_mixing_formats_is_an_error():
    with pytest.raises(ConfigError, match=r"^dtype: offload key in a DeepSpeed config"):
        load_config({"dtype": "bf16", "zero_optimization": {"stage": 3}})


def test_detection_and_forcing_the_format():
    assert is_deepspeed_config(ZERO_INFINITY)
    assert is_deepspeed_config({"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    assert not is_deepspeed_config({"optimizer": {"type": "adam", "lr": 1e-3}})
    assert not is_deepspeed_config(OffloadConfig().to_dict())
    with pytest.raises(ConfigError, match=r"^zero_optimization: unknown key"):
        load_config({"zero_optimization": {}}, deepspeed=False)
    # forced the other way, an offload-only key is refused, for what it is: the message named
    # "DeepSpeed keys such as 'optimizer.params'" that the dict did not have
    with pytest.raises(ConfigError, match=r"^prefetch: offload key in a DeepSpeed config") as e:
        load_config({"prefetch": {"depth": 1}}, deepspeed=True)
    assert "as asked (deepspeed=True, `--deepspeed`), and has no DeepSpeed key" in str(e.value)
    assert "optimizer.params" not in str(e.value)
    with pytest.raises(ConfigError, match=r"DeepSpeed keys such as 'optimizer\.params'"):
        load_config({"prefetch": {"depth": 1}, "optimizer": {"params": {"lr": 1e-3}}})


def test_input_dict_is_not_modified():
    ds = copy.deepcopy(ZERO_INFINITY)
    load_config(ds)
    assert ds == ZERO_INFINITY


def test_mapped_config_converts_to_offload_format():
    cfg = load_config(ZERO_INFINITY)
    assert load_config(cfg.to_dict()) == cfg


def test_gradient_accumulation_steps_semantics_are_said(caplog):
    """DeepSpeed's engine divides the loss by gradient_accumulation_steps and updates at every
    N-th engine.step(); offload's key does neither, so mapping it says so (a loop translated call
    for call stepped every micro-batch, silently) and the README's table lists the key."""
    with caplog.at_level(logging.INFO, logger="offload.config"):
        cfg = load_config({"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3}})
    assert cfg.gradient_accumulation_steps == 4
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("gradient_accumulation_steps=4" in m and "divide the loss by 4" in m for m in infos)
    assert _warnings(caplog) == []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="offload.config"):
        load_config({"gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}})
    assert not any("gradient_accumulation_steps" in r.getMessage() for r in caplog.records)
    from offload.config._reference import reference_markdown

    row = next(
        line
        for line in reference_markdown().splitlines()
        if line.startswith("| `gradient_accumulation_steps` (N)")
    )
    assert "divides the loss by N" in row and "`optimizer.step()`" in row
