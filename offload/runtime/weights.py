"""A model's weights from files or tensors by name: the source of values of ``wrap(..., weights=)``.

``weights`` is a ``.safetensors`` file, a directory holding ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (what Hugging Face writes; where it holds both, the single file,
which is what ``transformers`` loads from it), or a mapping of names to tensors
(torch tensors, or :class:`LazyTensor` s that produce their elements on demand). Names are those
of ``model.state_dict()``, or, for a ``transformers`` model, those of its checkpoints on disk, which
``offload.runtime.conversion`` renames and combines as ``transformers``' own loader does.

Note: streamed, checked first
    :class:`ModelWeights` is one more :class:`~offload.runtime.values.ParamValues`: the homes ask
    it for one piece at a time, and the gather (``FlatLayout.pairs``) asks each parameter's view
    only for the elements inside that piece, which a file tensor reads with ``pread``
    (``offload.runtime.safetensors``). So a piece is the most that is ever read at once, and the
    model's parameters are never read at all: they may be on the meta device. Everything that
    can be wrong with the names, shapes and dtypes is found from the files' headers before any
    home is built, and reported in one error.

Note: what the file must hold
    Every parameter under one of its names (tied weights are read once, from the first name the
    file has; Hugging Face saves only one of them), every persistent buffer, and nothing else,
    except keys the model declares ignorable the way ``transformers`` does
    (``_keys_to_ignore_on_load_unexpected``, old ``rotary_emb.inv_freq`` and ``position_ids``
    buffers). Dtypes convert within their kind (a bf16 file gives an fp32 master and bf16
    compute params, an fp32 file bf16 compute params); an integer tensor for a floating
    parameter is an error.

Note: tied weights the model forgot
    ``transformers`` 5 ties a model's declared weights (``lm_head.weight`` to
    ``model.embed_tokens.weight`` with ``tie_word_embeddings``) when it builds it, but a model
    built under ``accelerate.init_empty_weights()`` comes out with two untied meta parameters,
    and the file holds only one of them. Before the model is planned, :func:`tie_declared`
    ties them the way ``from_pretrained`` does: ``model.tie_weights(missing_keys=...)``, with
    the names the file lacks, so the one in the file is kept (either side). A pair the file
    holds both of is tied where the two hold the same values (torch's .bin conversions write
    both) and left untied, warned of, where not, as transformers does (until 2026-12-07 it was
    left untied either way, and ``from_pretrained``, which built the model tied, read one).

Note: buffers the model computes
    A non-persistent buffer is not in the file. On a model built on the meta device it has no
    value either; like ``from_pretrained``, it is given storage and the model's own
    ``_init_weights(module)`` (Hugging Face's, which computes rotary ``inv_freq`` and Gemma's
    ``embed_scale``) fills it. The module's parameters, and its submodules', are hidden behind
    meta stand-ins while it runs (``_parameters_hidden``), so a module that holds parameters
    too (Gemma's scaled embedding) has its buffers filled and its parameters untouched, whether
    they are on the meta device or hold values. A buffer still unfilled after that is an error
    naming it and the fix.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn as nn

from offload.plan import Segment
from offload.runtime.safetensors import NAMES, SafetensorsFile, TensorInfo
from offload.runtime.values import ParamValues

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

logger = logging.getLogger("offload.runtime")


class WeightsError(ValueError):
    """The weights do not fit the model; the message lists every problem found."""


class LazyTensor:
    """A tensor that produces its elements on demand: indexing is over the flattened elements
    and only takes a slice (``t[a:b]`` -> a new 1-D tensor of elements ``[a, b)``)."""

    shape: torch.Size
    dtype: torch.dtype

    def read(self, lo: int, hi: int) -> torch.Tensor:
        raise NotImplementedError

    def __getitem__(self, index: slice) -> torch.Tensor:
        lo, hi, step = index.indices(math.prod(self.shape))
        assert step == 1, "a LazyTensor is sliced with step 1"
        return self.read(lo, max(lo, hi))


class FileTensor(LazyTensor):
    """One tensor of a safetensors file, read by element ranges."""

    def __init__(self, file: SafetensorsFile, info: TensorInfo) -> None:
        self.file, self.info = file, info
        self.shape, self.dtype = torch.Size(info.shape), info.dtype

    def read(self, lo: int, hi: int) -> torch.Tensor:
        return self.file.read(self.info.name, lo, hi)

    def __repr__(self) -> str:
        return f"FileTensor({self.info.name!r} in {self.file.path})"


def open_weights(source) -> tuple[dict, list[SafetensorsFile], str]:
    """``(name -> tensor or LazyTensor, open files, a description for errors)`` of a
    ``weights=`` argument (see the module docstring)."""
    if isinstance(source, Mapping):
        tensors = dict(source)
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor | LazyTensor):
                raise WeightsError(
                    f"weights: '{name}' is a {type(t).__name__}; allowed: a torch.Tensor or an "
                    "offload.runtime.weights.LazyTensor"
                )
        return tensors, [], "the weights mapping"
    if not isinstance(source, str | os.PathLike):
        raise TypeError(
            f"weights: got a {type(source).__name__}; allowed: a .safetensors file, a directory "
            f"with {SINGLE} or {INDEX}, or a mapping of names to tensors"
        )
    path = Path(source)
    if path.is_dir():
        if (path / SINGLE).is_file():  # first, as transformers' from_pretrained looks
            if (path / INDEX).is_file():
                logger.info(
                    "weights: '%s' holds both %s and %s; reading %s, as transformers does",
                    path,
                    SINGLE,
                    INDEX,
                    SINGLE,
                )
            path = path / SINGLE
        elif (path / INDEX).is_file():
            return _open_index(path / INDEX)
        else:
            raise FileNotFoundError(
                f"weights: directory '{path}' holds neither {INDEX} nor {SINGLE}"
            )
    elif not path.is_file():
        raise FileNotFoundError(f"weights: '{path}' does not exist")
    elif path.name.endswith(".index.json"):
        return _open_index(path)
    file = SafetensorsFile(path)
    return {n: FileTensor(file, i) for n, i in file.tensors.items()}, [file], f"'{path}'"


def _open_index(index: Path) -> tuple[dict, list[SafetensorsFile], str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        assert isinstance(weight_map, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
        raise WeightsError(f"weights: '{index}' is not a safetensors index ({exc})") from None
    files: dict[str, SafetensorsFile] = {}
    tensors: dict = {}
    try:
        for name, shard in weight_map.items():
            if shard not in files:
                if not (index.parent / shard).is_file():
                    raise FileNotFoundError(
                        f"weights: '{index}' names shard '{shard}' (for '{name}'), which is missing"
                    )
                files[shard] = SafetensorsFile(index.parent / shard)
            info = files[shard].tensors.get(name)
            if info is None:
                raise WeightsError(
                    f"weights: '{index}' puts '{name}' in '{shard}', which does not hold it"
                )
            tensors[name] = FileTensor(files[shard], info)
    except BaseException:
        for f in files.values():
            f.close()
        raise
    return tensors, list(files.values()), f"'{index}'"


def _convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    if src.is_floating_point or dst.is_floating_point:
        return src.is_floating_point and dst.is_floating_point
    return (src == torch.bool) == (dst == torch.bool)


def _dtype_name(dtype: torch.dtype) -> str:
    return NAMES.get(dtype, str(dtype).removeprefix("torch."))


def _ignored_unexpected(model: nn.Module) -> re.Pattern | None:
    """Keys a file may hold that the model ignores (what ``transformers`` ignores)."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [name for name, _ in model.named_buffers()]
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None


def _listing(what: str, items: list[str]) -> str:
    return f"{len(items)} {what}: " + ", ".join(items)


class ModelWeights(ParamValues):
    """The values of a model's parameters and persistent buffers from ``source`` (see the module
    Notes). Checked against the model when made; :meth:`close` closes its files."""

    def __init__(
        self,
        model: nn.Module,
        source,
        compute_dtype: torch.dtype,
        *,
        new_head: bool = False,
        resized: bool = False,
    ) -> None:
        super().__init__(compute_dtype)
        # a head other than the file's (from_pretrained's model_class): parameters the file
        # lacks are initialised, its tensors the model lacks left out (see _new_head_values);
        # resized (ignore_mismatched_sizes): a parameter of another shape than the file's is
        # initialised too (a classifier of another number of labels)
        self._new_head, self._resized = new_head or resized, resized
        self._resized_names: list[str] = []
        self.tensors, self.files, self.where = open_weights(source)
        try:
            # a Hugging Face model's checkpoint under its in-memory names (offload.runtime.conversion)
            from offload.runtime.conversion import convert_checkpoint  # noqa: PLC0415

            self.tensors = convert_checkpoint(model, self.tensors, self.where)
            self._name: dict[nn.Parameter, str] = {}
            self._buffers: dict[str, tuple[nn.Module, str]] = {}
            self._check(model)
        except BaseException:
            self.close()
            raise

    def _check(self, model: nn.Module) -> None:
        state = model.state_dict(keep_vars=True)
        names: dict[nn.Parameter, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(p, []).append(name)
        modules = dict(model.named_modules())
        missing, wrong = [], []
        for p, pnames in names.items():
            found = [n for n in pnames if n in self.tensors]
            if not found:
                tied = f" (tied: {', '.join(pnames[1:])})" if len(pnames) > 1 else ""
                missing.append(pnames[0] + tied)
                continue
            shape = tuple(self.tensors[found[0]].shape)
            if self._resized and shape != tuple(p.shape):
                self._resized_names.append(f"{found[0]} {list(shape)} -> {list(p.shape)}")
                missing.append(pnames[0])
                del self.tensors[found[0]]
                continue
            self._name[p] = found[0]
            wrong += self._mismatch(found[0], p.shape, p.dtype, "parameter")
        for name, value in state.items():
            if isinstance(value, nn.Parameter) and value in names:
                continue
            mname, _, bname = name.rpartition(".")
            module = modules.get(mname)
            if module is None or module._buffers.get(bname) is not value:
                continue  # extra state: not a tensor of ours
            if name not in self.tensors:
                missing.append(name)
                continue
            self._buffers[name] = (module, bname)
            wrong += self._mismatch(name, value.shape, value.dtype, "buffer")
        ignored = _ignored_unexpected(model)
        unexpected = [
            n
            for n in self.tensors
            if n not in state and not (ignored is not None and ignored.search(n))
        ]
        if self._new_head and (missing or unexpected):
            missing = self._new_head_values(model, names, missing, unexpected)
            unexpected = []
        problems = []
        if missing:
            problems.append(
                _listing("missing keys (in model.state_dict(), not in the file)", missing)
            )
        if unexpected:
            problems.append(_listing("unexpected keys (in the file, not in the model)", unexpected))
        problems += wrong
        if problems:
            raise WeightsError(
                f"offload.wrap: weights={self.where} do not fit {type(model).__name__}:\n  "
                + "\n  ".join(problems)
            )

    def _new_head_values(self, model, names, missing: list[str], unexpected: list[str]):
        """As ``transformers``' ``from_pretrained`` of another head: each missing parameter's
        value from the model's ``_init_weights`` run on a copy of the module that holds it (its
        own parameters given storage, filled with NaN first so that what it leaves alone is
        seen); the unexpected tensors are left out. Both are said in one warning. Returns what
        is still missing: buffers, and parameters ``_init_weights`` does not fill."""
        init = getattr(model, "_init_weights", None)
        by_name = {pnames[0]: p for p, pnames in names.items()}
        left, made = [], []
        for entry in missing:
            name = entry.split(" (tied: ")[0]
            p = by_name.get(name)
            value = None if p is None or init is None else _initialised(model, init, name)
            if value is None:
                left.append(entry)
                continue
            self.tensors[name] = value
            self._name[p] = name
            made.append(entry)
        if made or unexpected:
            resized = self._resized_names
            logger.warning(
                "offload.from_pretrained: %s on the weights of %s: %s%s; %s",
                type(model).__name__,
                self.where,
                _listing("parameters of another shape in the file", resized) + ", "
                if resized
                else "",
                _listing("parameters not in the file, newly initialised (train them)", made)
                if made
                else "no parameter newly initialised",
                _listing("tensors of the file the model has not, left out", unexpected)
                if unexpected
                else "every tensor of the file used",
            )
        return left

    def _mismatch(self, name: str, shape, dtype: torch.dtype, what: str) -> list[str]:
        t = self.tensors[name]
        out = []
        if tuple(t.shape) != tuple(shape):
            out.append(
                f"'{name}': shape {list(t.shape)} in the file, {list(shape)} in the model's {what}"
            )
        if not _convertible(t.dtype, dtype):
            out.append(
                f"'{name}': dtype {_dtype_name(t.dtype)} in the file cannot be converted to the "
                f"model's {what} dtype {_dtype_name(dtype)}"
            )
        return out

    def view_of(self, seg: Segment):
        t = self.tensors[self._name[seg.param]]
        return t.reshape(-1) if isinstance(t, torch.Tensor) else t

    def fill_buffers(self, model: nn.Module) -> None:
        """Persistent buffers from the weights (in each buffer's dtype); non-persistent ones on
        the meta device computed by the model (:func:`fill_computed_buffers`)."""
        for name, (module, bname) in self._buffers.items():
            t = self.tensors[name]
            value = t if isinstance(t, torch.Tensor) else t[:]
            old = module._buffers[bname]
            device = "cpu" if old.is_meta else old.device
            module._buffers[bname] = value.reshape(old.shape).to(device, old.dtype, copy=True)
        fill_computed_buffers(model)

    def close(self) -> None:
        for f in self.files:
            f.close()


def _initialised(model: nn.Module, init, name: str) -> torch.Tensor | None:
    """The value the model's ``_init_weights`` gives parameter ``name``: run on a shallow copy
    of its module whose own parameters have storage (NaN until written) and whose children
    and buffers are left out; None where it leaves the parameter unwritten or fails."""
    mname, _, leaf = name.rpartition(".")
    module = model.get_submodule(mname)
    clone = copy.copy(module)
    clone._modules, clone._buffers = {}, {}
    clone._parameters = {
        n: nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype), p.requires_grad)
        for n, p in module._parameters.items()
        if p is not None
    }
    with torch.no_grad():
        try:
            init(clone)
        except Exception:  # noqa: BLE001 - reported by the caller as a missing key
            return None
    value = clone._parameters[leaf].detach()
    return None if torch.isnan(value).any() else value


def tie_declared(model: nn.Module, source) -> None:
    """Ties the parameters a ``transformers`` model declares tied (``tie_word_embeddings``) but
    holds as two meta parameters, with ``model.tie_weights(missing_keys=...)`` as its
    ``from_pretrained`` does (the module Note: tied weights the model forgot). Call before the
    model is planned: tying replaces a parameter."""
    declared = getattr(model, "get_expanded_tied_weights_keys", None)
    if declared is None or not hasattr(model, "tie_weights"):
        return
    untied = False
    for target, tied_to in declared(all_submodels=True).items():
        try:
            a, b = model.get_parameter(target), model.get_parameter(tied_to)
        except AttributeError:
            continue
        untied |= a is not b and (a.is_meta or b.is_meta)
    if not untied:
        return
    from offload.runtime.conversion import convert_checkpoint  # noqa: PLC0415

    tensors, files, where = open_weights(source)
    try:
        found = convert_checkpoint(model, tensors, where)
        names = set(found)
        for target, tied_to in declared(all_submodels=True).items():
            if target not in found or tied_to not in found:
                continue
            if _same_values(found[target], found[tied_to]):
                names.discard(target)  # one value twice (torch's .bin files): tied, as transformers
                continue
            logger.warning(  # (tie_weights leaves a pair it finds both of untied)
                "weights: the config ties '%s' to '%s' (tie_word_embeddings), but %s holds both "
                "with different values: they are not tied, as transformers does (set "
                "tie_word_embeddings false in config.json to silence this)",
                target,
                tied_to,
                where,
            )
            getattr(model, "all_tied_weights_keys", {}).pop(target, None)  # (saved untied too)
    finally:
        for f in files:
            f.close()
    model.tie_weights(missing_keys={n for n in model.state_dict() if n not in names})


def _same_values(a, b, chunk: int = 1 << 24) -> bool:
    """Whether two tensors or lazy tensors hold the same elements, read ``chunk`` at a time."""
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    n = math.prod(a.shape)
    a, b = (t.reshape(-1) if isinstance(t, torch.Tensor) else t for t in (a, b))
    return all(torch.equal(a[lo : lo + chunk], b[lo : lo + chunk]) for lo in range(0, n, chunk))


def _sentinel(buf: torch.Tensor) -> torch.Tensor:
    """Storage for a meta buffer, filled with a value no computed buffer holds."""
    if buf.is_floating_point():
        return torch.full_like(buf, math.nan, device="cpu")
    if buf.dtype == torch.bool:
        return torch.zeros_like(buf, device="cpu")  # cannot be told apart: never "filled"
    return torch.full_like(buf, torch.iinfo(buf.dtype).min, device="cpu")


def _unfilled(buf: torch.Tensor) -> bool:
    if buf.is_meta or buf.dtype == torch.bool:
        return True
    if buf.is_floating_point():
        return bool(torch.isnan(buf).any())
    return bool((buf == torch.iinfo(buf.dtype).min).any())


@contextlib.contextmanager
def _parameters_hidden(module: nn.Module):
    """Every parameter of ``module`` and of its submodules replaced by a meta stand-in of its
    shape and dtype for the block: an ``_init_weights`` run inside writes nothing to them."""
    saved = [(m, dict(m._parameters)) for m in module.modules()]
    try:
        for m, params in saved:
            for name, p in params.items():
                if p is not None:
                    m._parameters[name] = nn.Parameter(
                        torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
                    )
        yield
    finally:
        for m, params in saved:
            m._parameters.clear()
            m._parameters.update(params)


def _init_buffers_only(init, module: nn.Module) -> None:
    """Runs the model's ``_init_weights(module)`` for its buffers alone (the module Note): its
    parameters, on the meta device or holding values, are hidden behind meta stand-ins."""
    with _parameters_hidden(module), torch.no_grad():
        try:
            init(module)
        except Exception:  # noqa: BLE001 - reported by the caller as a buffer it cannot fill
            pass


def fill_computed_buffers(model: nn.Module) -> None:
    """Gives every non-persistent buffer on the meta device storage and its value from the
    model's own ``_init_weights`` (see the module Note); raises naming those it cannot fill."""
    init = getattr(model, "_init_weights", None)
    unfilled: list[str] = []
    for mname, module in model.named_modules():
        metas = [
            b
            for b in module._non_persistent_buffers_set
            if module._buffers.get(b) is not None and module._buffers[b].is_meta
        ]
        if not metas:
            continue
        for b in metas:
            module._buffers[b] = _sentinel(module._buffers[b])
        if init is not None:
            _init_buffers_only(init, module)
        unfilled += [f"{mname}.{b}" if mname else b for b in metas if _unfilled(module._buffers[b])]
    if unfilled:
        raise WeightsError(
            f"offload.wrap: non-persistent buffer(s) {', '.join(unfilled)} are on the meta device, "
            "are not in the weights, and the model does not compute them (no _init_weights that "
            "fills them); build the model with accelerate.init_empty_weights() (which leaves "
            "buffers real), or give these buffers their values before wrap"
        )
