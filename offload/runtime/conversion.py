"""A Hugging Face checkpoint read under the model's own names: ``transformers`` 5's conversion
mapping, applied lazily.

``transformers`` 5 keeps some models in memory under other names and shapes than their
checkpoints on disk (and than what its own ``save_pretrained`` writes): Mixtral's experts are
``experts.{e}.w1/w2/w3.weight`` on disk and two fused parameters ``experts.gate_up_proj`` and
``experts.down_proj`` in memory (Qwen2-MoE, OLMoE, Qwen3-MoE... alike), ViT's
``encoder.layer.{i}.attention.attention.query`` is ``layers.{i}.attention.q_proj``. Its
``from_pretrained`` converts with a list of transforms per architecture
(``transformers.conversion_mapping.get_model_conversion_mapping``): ``WeightRenaming`` (a key
renamed) and ``WeightConverter`` (keys gathered per target and combined by ``operations``).

Note: the same names, lazily combined
    :func:`convert_checkpoint` asks ``transformers`` for the model's transforms and renames each
    file key with ``transformers``' own ``rename_source_key`` (renamings, then at most one
    converter, the base model's prefix added or dropped), exactly as its loader does, keys in
    its natural order. A renamed key keeps its file tensor. A converter's keys are combined
    into one :class:`~offload.runtime.weights.LazyTensor` per target that reads only the
    elements asked for from its sources (:class:`Cat`, :class:`Narrow`), so a piece is still
    the most that is read at once (``offload.runtime.weights``' Note: streamed). The operations
    that combine this way are the ones that move whole blocks of elements:
    ``MergeModulelist`` (a stack: blocks one after another), ``Concatenate`` and ``Chunk``
    (cuts along a dimension). Any other (a transpose, a permutation for rope, a dequantization)
    is refused before anything is read, naming the keys and the operation, and the route that
    works: load with ``transformers`` and pass the model to ``offload.wrap``.

Note: a stack with a hole
    A stack (``MergeModulelist``: one tensor per expert, ``experts.{e}.w1.weight``) has as many
    parts as the model's parameter has along its dimension. Before any is combined, the expert
    numbers each source pattern found are checked against that count, and the keys the file
    lacks are named (an expert's ``w1`` lost in a hand-edited shard), instead of the parts
    failing to fit together or the stack coming out an expert short. Likewise a part whose
    shape differs from the other parts of its pattern is named with both shapes.
"""

from __future__ import annotations

import math
import re
import sys
from collections import Counter, defaultdict

import torch
import torch.nn as nn

from offload.runtime.weights import LazyTensor, WeightsError


def _read(t, lo: int, hi: int) -> torch.Tensor:
    return t.reshape(-1)[lo:hi] if isinstance(t, torch.Tensor) else t[lo:hi]


class _Blocks(LazyTensor):
    """A tensor whose flat elements are, for each index of its dimensions before ``dim`` (a
    row), one block from each part: the shape of a concatenation or of a cut along ``dim``.
    ``blocks`` is ``(part, length per row, offset of the block within the part's row, the
    part's row length)``."""

    def __init__(self, shape, dtype, rows: int, blocks: list[tuple]) -> None:
        self.shape, self.dtype = torch.Size(shape), dtype
        self.rows, self.blocks = rows, blocks
        self.row = sum(b[1] for b in blocks)

    def read(self, lo: int, hi: int) -> torch.Tensor:
        out = []
        for r in range(lo // self.row, -(-hi // self.row) if hi > lo else lo // self.row):
            at = r * self.row
            for part, length, offset, stride in self.blocks:
                a, b = max(lo, at), min(hi, at + length)
                if a < b:
                    base = r * stride + offset - at
                    out.append(_read(part, base + a, base + b))
                at += length
        return torch.cat(out) if out else torch.empty(0, dtype=self.dtype)


class Cat(_Blocks):
    """``torch.cat(parts, dim)`` of tensors or lazy tensors, read lazily."""

    def __init__(self, parts: list, dim: int) -> None:
        first = parts[0]
        dtypes = {p.dtype for p in parts}
        if len(dtypes) != 1:
            raise ValueError(f"parts of dtypes {sorted(map(str, dtypes))}")
        if any(len(p.shape) != len(first.shape) for p in parts) or any(
            tuple(p.shape[:dim]) != tuple(first.shape[:dim])
            or tuple(p.shape[dim + 1 :]) != tuple(first.shape[dim + 1 :])
            for p in parts
        ):
            raise ValueError(f"parts of shapes {[list(p.shape) for p in parts]} along dim {dim}")
        shape = list(first.shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        rows = math.prod(first.shape[:dim])
        blocks = [(p, math.prod(p.shape[dim:]), 0, math.prod(p.shape[dim:])) for p in parts]
        super().__init__(shape, first.dtype, rows, blocks)


class Narrow(_Blocks):
    """``source.narrow(dim, start, length)``, read lazily."""

    def __init__(self, source, dim: int, start: int, length: int) -> None:
        inner = math.prod(source.shape[dim + 1 :])
        shape = list(source.shape)
        shape[dim] = length
        rows = math.prod(source.shape[:dim])
        block = (source, length * inner, start * inner, math.prod(source.shape[dim:]))
        super().__init__(shape, source.dtype, rows, [block])


class _Unsqueezed(LazyTensor):
    """``source.unsqueeze(dim)``: the same elements."""

    def __init__(self, source, dim: int) -> None:
        shape = list(source.shape)
        shape.insert(dim, 1)
        self.shape, self.dtype, self.source = torch.Size(shape), source.dtype, source

    def read(self, lo: int, hi: int) -> torch.Tensor:
        return _read(self.source, lo, hi)


class _Unsupported(Exception):
    """An operation that does not combine by blocks (see the module Note)."""


def _run(operations, inputs: dict[str, list], sources: list[str], targets: list[str]) -> dict:
    """What ``operations`` make of ``inputs`` (source pattern -> tensors, in order), lazily:
    ``transformers``' ``MergeModulelist``, ``Concatenate`` and ``Chunk``, same names out."""
    from transformers.core_model_loading import (  # noqa: PLC0415
        Chunk,
        Concatenate,
        MergeModulelist,
    )

    values: dict = dict(inputs)
    for op in operations:
        if type(op) is MergeModulelist:
            n = len(values)
            if n == 1 and len(targets) != 1:
                raise _Unsupported(op)
            values = {
                (targets[0] if n == 1 else k): (
                    v
                    if not isinstance(v, list)
                    else Cat([_Unsqueezed(t, op.dim) for t in v], op.dim)
                )
                for k, v in values.items()
            }
        elif type(op) is Concatenate and len(targets) == 1:
            parts = []
            for pattern in sources:
                v = values.pop(pattern, None)
                if v is not None:
                    parts += v if isinstance(v, list) else [v]
            values = {targets[0]: Cat(parts, op.dim)}
        elif type(op) is Chunk and op.num_shards_attribute is None and len(values) == 1:
            (v,) = values.values()
            t = v[0] if isinstance(v, list) else v
            n, dim = len(targets), op.dim
            size = -(-t.shape[dim] // n)  # torch.chunk's sizes
            starts = range(0, t.shape[dim], size)
            values = {
                k: Narrow(t, dim, s, min(size, t.shape[dim] - s)) for k, s in zip(targets, starts)
            }
        else:
            raise _Unsupported(op)
    return values


def _short(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _missing_parts(conv, count_of, pattern_keys: dict[str, list[str]]) -> list[str]:
    """The file keys a stack lacks (the module Note: a stack with a hole): for each source
    pattern with one ``*`` (the expert number), the numbers below the model's count that no key
    has, named as the keys the other experts have. ``count_of(dim)`` is the parameter's size."""
    from transformers.core_model_loading import MergeModulelist  # noqa: PLC0415

    stack = next((op for op in conv.operations if type(op) is MergeModulelist), None)
    if stack is None:
        return []
    count = count_of(stack.dim)
    found: dict[str, dict[int, tuple[str, re.Match]]] = {}
    for pattern in conv.source_patterns:
        if pattern.count("*") != 1:
            return []
        rx = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
        found[pattern] = {}
        for key in pattern_keys.get(pattern, []):
            m = rx.search(key)
            if m is None:
                return []
            found[pattern][int(m.group(1))] = (key, m)
    template = next((v for seen in found.values() for v in seen.values()), None)
    if template is None:
        return []
    missing = []
    for pattern, seen in found.items():
        key, m = next(iter(seen.values()), template)
        for e in range(count):
            if e not in seen:
                missing.append(key[: m.start()] + pattern.replace("*", str(e)) + key[m.end() :])
    return missing


def _odd_parts(conv, pattern_keys: dict[str, list[str]], tensors: dict, target: str) -> list[str]:
    """The parts of a stack whose shape differs from the most common one of their pattern
    (the module Note: a stack with a hole), each with both shapes."""
    from transformers.core_model_loading import MergeModulelist  # noqa: PLC0415

    if not any(type(op) is MergeModulelist for op in conv.operations):
        return []
    odd = []
    for pattern, keys in pattern_keys.items():
        shapes = Counter(tuple(tensors[k].shape) for k in keys)
        common, others = shapes.most_common(1)[0]
        for k in keys:
            if tuple(tensors[k].shape) != common:
                odd.append(
                    f"'{k}': shape {list(tensors[k].shape)} in the file, {list(common)} in the "
                    f"{others} other tensors of '{pattern}' stacked into '{target}'"
                )
    return odd


def _full_names(target: str, made: dict) -> dict:
    """The converter's outputs (named by target pattern) under full names: the prefix and
    suffix around the pattern in ``target``, the key it was renamed to (as ``transformers``'
    ``WeightConverter.convert`` names them)."""
    for pattern in made:
        if pattern in target:
            head, _, tail = target.partition(pattern)
            return {head + k + tail: v for k, v in made.items()}
    return made


def _transforms(model: nn.Module):
    """``(renamings, converters)`` that ``transformers`` loads ``model`` with, or None when it
    is not a ``transformers`` model. A model of transformers' has imported it: for any other,
    importing it here (tens of MB of host memory, seconds) would cost a wrap that needs none
    (``tests/test_memory.py``'s budget caught it)."""
    loaded = sys.modules.get("transformers")
    if loaded is None or not isinstance(model, loaded.PreTrainedModel):
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: PLC0415
    from transformers.core_model_loading import WeightConverter, WeightRenaming  # noqa: PLC0415

    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    return renamings, converters


def convert_checkpoint(model: nn.Module, tensors: dict, where: str) -> dict:
    """``tensors`` (file key -> tensor or lazy tensor) under ``model``'s state-dict names, as
    ``transformers`` converts them at load (the module Note); keys that map to nothing keep
    their name (and are then reported unexpected). Unchanged for a model that is not a
    ``transformers`` one."""
    transforms = _transforms(model)
    if transforms is None:
        return tensors
    from transformers.core_model_loading import dot_natural_key, rename_source_key  # noqa: PLC0415

    renamings, converters = transforms
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    state = model.state_dict()
    prefix = model.base_model_prefix
    out: dict = {}
    groups: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    group_converter: dict = {}
    group_keys: dict[str, list[str]] = defaultdict(list)
    pattern_keys: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for key in sorted(tensors, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if renamed not in state and key in state:  # as transformers: keep a name already right
            renamed, pattern = rename_source_key(key, [], [], prefix, state)
        if renamed not in state:
            out[key] = tensors[key]  # unexpected, under the file's name
        elif pattern is None:
            out[renamed] = tensors[key]
        else:
            groups[renamed][pattern].append(tensors[key])
            group_converter[renamed] = by_pattern[pattern]
            group_keys[renamed].append(key)
            pattern_keys[renamed][pattern].append(key)
    refused, missing, wrong = [], [], []
    for target, inputs in groups.items():
        conv = group_converter[target]
        keys = _short(group_keys[target])
        lacking = _missing_parts(conv, lambda d, t=target: state[t].shape[d], pattern_keys[target])
        odd = _odd_parts(conv, pattern_keys[target], tensors, target)
        if lacking or odd:
            missing += [f"{k} (for '{target}')" for k in lacking]
            wrong += odd
            continue
        try:
            made = _run(conv.operations, inputs, conv.source_patterns, conv.target_patterns)
        except _Unsupported as exc:
            refused.append(
                f"'{target}' (from {keys}): offload cannot stream {type(exc.args[0]).__name__} yet"
            )
            continue
        except ValueError as exc:
            refused.append(f"'{target}' (from {keys}): {exc}")
            continue
        out.update(_full_names(target, made))
    if missing or wrong:
        problems = wrong
        if missing:
            problems = [
                f"{len(missing)} missing keys (per-expert tensors, each followed by the model's "
                "parameter that transformers stacks them into; not in the file): "
                + ", ".join(missing),
                *wrong,
            ]
        raise WeightsError(
            f"offload.wrap: weights={where} do not fit {type(model).__name__}:\n  "
            + "\n  ".join(problems)
        )
    if refused:
        raise WeightsError(
            f"offload.wrap: weights={where} store {type(model).__name__}'s tensors in a layout "
            "that transformers converts at load, and offload cannot convert it yet:\n  "
            + "\n  ".join(refused)
            + "\nLoad the model with transformers (from_pretrained) and pass it to offload.wrap "
            "without weights="
        )
    return out
