"""The README's config reference, generated from the dataclasses (``python -m
offload.config._reference`` prints it). ``tests/test_config.py`` checks the README holds exactly
this text, so the reference cannot drift from the code.

Note: field docs
    Each field's documentation is the attribute docstring right under it in the class body
    (the string after ``name: type = default``); :func:`field_docs` reads them with ``ast``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
from typing import Any

from offload.config.errors import ConfigError
from offload.config.offload_config import DTYPES, OffloadConfig
from offload.config.sections import SECTIONS
from offload.config.sizes import AutoSize, format_size


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its attribute docstring (one line), for a dataclass defined in source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _type_text(name: str, annotation: str) -> str:
    if name.endswith("_size"):
        return 'size (bytes) or "auto"' if "str" in annotation else "size (bytes)"
    return annotation.replace("|", "or")


def _default_text(name: str, value: Any) -> str:
    if isinstance(value, AutoSize):
        return f'`"auto"` (at most {format_size(value).replace(" ", "")})'
    if name.endswith("_size"):
        return f"`{format_size(value).replace(' ', '')}` ({value})"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{json.dumps(value)}`"


def _table(cls: type, prefix: str) -> list[str]:
    docs = field_docs(cls)
    default = cls()
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name in {s.KEY for s in SECTIONS}:
            continue
        value = getattr(default, f.name)
        ftype = _type_text(f.name, str(f.type))
        lines.append(
            f"| `{prefix}{f.name}` | {ftype} | {_default_text(f.name, value)} | "
            f"{docs.get(f.name, '')} |"
        )
    return lines


_DEEPSPEED_TABLE = """\
| DeepSpeed key | offload key | conversion |
|---|---|---|
| `bf16.enabled` / `bfloat16.enabled`, `fp16.enabled` | `dtype` | `bf16` / `fp16`; neither enabled: `fp32`; both: error |
| `fp16.initial_scale_power` (p) | `loss_scale.initial` | `2**p` |
| `fp16.loss_scale` (S > 0, static) | `loss_scale.initial`, `growth_factor`, `backoff_factor` | `S`, `1`, `1` (0 = dynamic, the default) |
| `fp16.loss_scale_window` | `loss_scale.growth_interval` | steps |
| `fp16.min_loss_scale` | `loss_scale.min_scale` | as is |
| `optimizer.type` | `optimizer.type` | `Adam` -> `adamw` (`adam` when `params.adam_w_mode` is false), `AdamW` -> `adamw`; others: error |
| `optimizer.params.{lr, betas, eps, weight_decay, bias_correction}` | `optimizer.*` | as is |
| `gradient_clipping` | `gradient_clipping` | as is |
| `gradient_accumulation_steps` (N) | `gradient_accumulation_steps` | as is; it only says which backward is a step's last. Unlike DeepSpeed's engine (`engine.backward` divides the loss by N, `engine.step()` updates at every N-th call), offload does neither: divide the loss by N and call `optimizer.step()` once every N backwards (a `step()` after fewer updates at once; logged at INFO) |
| `zero_optimization.offload_param.{device, nvme_path, pin_memory, buffer_count}` | `offload_param.*` | as is |
| `zero_optimization.offload_param.buffer_size` | `offload_param.buffer_size` | ELEMENTS x element size of the mapped dtype (2 for bf16/fp16, 4 for fp32), rounded up to a multiple of 4096 bytes |
| `zero_optimization.stage3_param_persistence_threshold` | `offload_param.persistence_threshold` | elements |
| `zero_optimization.offload_optimizer.{device, nvme_path, pin_memory, buffer_count}` | `offload_optimizer.*` | `device: none` -> `cpu` (warned: the step always runs on the CPU) |
| `aio.{block_size, queue_depth}` | `aio.*` | bytes / count |
| `aio.thread_count` or `aio.intra_op_parallelism` | `aio.thread_count` | count (`intra_op_parallelism` wins) |
| `zero_optimization.stage` | `distributed.stage` | as is; `0` runs as `1` (logged at INFO: offload always shards the optimizer state across ranks) |
| `communication_data_type` | `distributed.reduce_dtype` | `fp32`, `bf16` (or `bfp16`), `fp16`; absent: offload's default, `fp32` |
| `data_types.grad_accum_dtype` | `distributed.grad_accum_dtype` | `fp32`, `bf16` (or `bfp16`), `fp16`; absent: offload's default, `fp32` (DeepSpeed's with ZeRO is the compute dtype) |
| `offload_optimizer.pipeline_read/pipeline_write` | none | accepted without warning: offload's step is always pipelined |
| `aio.single_submit: false`, `aio.overlap_events: true`, `aio.use_gds: false`, `fp16.hysteresis: 1`, `fp16.consecutive_hysteresis: false`, `optimizer.params.amsgrad: false`, `optimizer.params.torch_adam`, `offload_optimizer.ratio: 1` | none | offload behaves this way; any other value is listed in the warning |
| anything else (`train_batch_size`, `zero_optimization.overlap_comm`, `stage3_prefetch_bucket_size`, `sub_group_size`, `scheduler`, ...) | none | listed in ONE warning on the `offload.config` logger |
"""

_UNITS = """\
Byte sizes (`*_size` keys) are an integer number of bytes or a string `<number><unit>`
(case-insensitive, spaces allowed): no unit or `B` = bytes; `KB MB GB TB` = 10^3, 10^6, 10^9,
10^12; `KiB MiB GiB TiB` = 2^10, 2^20, 2^30, 2^40; bare `K M G T` are binary as in `dd` and
`fio` (`"4k"` = 4096). A fraction or an exponent is allowed when the result is whole bytes
(`"1.5GiB"`, `"1e8"`, `1e8`). `buffer_size` and `aio.block_size` are rounded UP to a multiple
of 4096 bytes (the O_DIRECT alignment; `"16MB"` becomes 16003072, logged at INFO, and
`offload config` prints the rounded value); zero, negative, NaN, infinite and non-numeric sizes
are errors. `offload_param.buffer_size` and `offload_optimizer.buffer_size` default to `"auto"`:
the model's largest unit (in the compute dtype for params, in fp32 for the optimizer state),
rounded up to 4096 and at least one `aio.block_size`, but at most 256 MiB; it is decided by
`offload.wrap`, which sees the model (`offload.config.resolve_auto_buffer_size`). Integers may be
written as integral floats (`1e5` in JSON); booleans must be `true`/`false`, never strings like
`"yes"`; a string where a number is needed is an error (offload's YAML reader takes `1e-4` as a
float, unlike plain YAML 1.1).
"""


def _example_error(config: dict[str, Any]) -> str:
    """The message ``load_config(config)`` raises (so the README shows the real text)."""
    try:
        OffloadConfig.from_dict(config)
    except ConfigError as exc:
        return str(exc)
    raise AssertionError(f"{config} is valid")  # pragma: no cover


def reference_markdown() -> str:
    """The README section body (between the config-reference markers)."""
    out = [
        "## Config reference",
        "",
        "`offload.load_config(src)` takes a dict, a `.json` / `.yaml` / `.yml` file, an "
        "`OffloadConfig` or `None` (all defaults), in offload's format or DeepSpeed's (detected "
        "by keys such as `zero_optimization`; see the mapping below). Every key is checked: an "
        "unknown key, a wrong type or an out-of-range value is a `ConfigError` with one line "
        "naming the dotted key, the value and what is allowed, e.g.",
        "",
        "```",
        _example_error({"offload_optimizer": {"buffer_size": "-1GB"}}),
        "offload_optimzer: unknown key; did you mean 'offload_optimizer'? allowed: device, ...",
        "```",
        "",
        "`offload config FILE` validates a file and prints it normalized with defaults filled "
        "in (YAML that loads back to the same config; `--json` for JSON), so it also converts a "
        "DeepSpeed config. The defaults suit one 24 GB GPU with 64 GB of RAM.",
        "",
        "### Top level",
        "",
        *_table(OffloadConfig, ""),
        "",
        f"`dtype` aliases: {', '.join(f'`{a}`' for v in DTYPES.values() for a in v)}.",
        "",
    ]
    for section in SECTIONS:
        doc = " ".join((section.__doc__ or "").split()).replace("``", "`")
        out += [f"### `{section.KEY}`", "", doc, "", *_table(section, section.KEY + "."), ""]
    out += [
        "### Size units",
        "",
        _UNITS,
        "### DeepSpeed configs",
        "",
        "Keys absent from a DeepSpeed file take offload's defaults (not DeepSpeed's), "
        'except the dtype (fp32 unless `bf16` or `fp16` is enabled). `"auto"` values '
        "(Hugging Face Trainer templates) take offload's defaults and are listed in one INFO "
        'log line. In `zero_optimization` an integer written as a string (`"stage": "3"`, '
        '`"buffer_count": " 6 "`) is the integer, as DeepSpeed\'s own validation takes it (not '
        "in `nvme_path`; elsewhere strings stay strings, as DeepSpeed hands them on). Errors "
        "name the DeepSpeed key.",
        "",
        _DEEPSPEED_TABLE,
    ]
    return "\n".join(out)


if __name__ == "__main__":
    print(reference_markdown(), end="")
