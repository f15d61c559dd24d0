"""Hugging Face models in and out of offload: ``from_pretrained`` and ``save_pretrained``.

``from_pretrained(path, config)`` builds the model of a local Hugging Face directory from its
``config.json``, its parameters on the meta device (buffers real, as transformers builds it),
and wraps it with ``weights=path``: every tensor streams from the
safetensors shards into its home (``offload.runtime.weights``). ``save_pretrained(model, dir)``
writes the layout ``from_pretrained`` and the Hub expect: ``model.safetensors``, or shards
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` when the model is
larger than ``max_shard_size``, plus ``config.json`` when the model has a Hugging Face config.

Note: streaming out
    Each tensor is written chunk by chunk as it is read from its owner (``Values.flat``: the
    fp32 master of a trainable parameter, the compute values of a frozen one), one piece of its
    unit at a time, the last piece kept for the next tensor that starts in it and dropped
    with its last chunk when none does. So host memory holds one piece (at most one swap
    buffer) and its conversion, whatever the size of the model or of its largest tensor (a
    128k-token embedding included). Shards are split the way ``huggingface_hub`` splits a
    state dict: in order, a new shard when the next tensor would go over ``max_shard_size``, a
    larger tensor alone in its shard; unlike it, the shard being filled is closed before such
    a tensor, so every tensor is written in unit order (each unit is read once, and with ranks
    every rank gathers the units in the same order).

With several ranks ``save_pretrained`` is collective, as ``export`` is: each unit is gathered
whole from the ranks' shares and rank 0 writes (host memory then holds one unit).

Note: what is written, and when
    One name per parameter: the first under which ``named_parameters`` finds it, so tied
    weights are written once, as Hugging Face does (``lm_head.weight`` tied to
    ``model.embed_tokens.weight`` is not written). Persistent buffers are written; computed
    (non-persistent) ones are not. Each file goes to a temporary name, is fsynced and renamed;
    the index and ``config.json`` come after every shard, then shards of an earlier save that
    the new index does not name are removed.

Note: all or nothing (``_staged``)
    A save over an existing directory (the next export of a run, a save in place over the
    model's own source) is written into a staging directory beside it, ``.NAME.offload-new``;
    the files of the old directory that the save does not write (a tokenizer, a README) are
    hard-linked into it, and then the two directories are exchanged in one atomic
    ``renameat2(RENAME_EXCHANGE)`` and the old one removed. Replacing the files one by one, a
    SIGKILL part way left the old index with some new shards, which ``transformers`` loaded
    without a word: neither model. Now a kill at any point leaves the old directory or the new
    one, and the next save removes a staging directory a killed one left. Python has no call
    for the exchange (``os.rename`` replaces only an empty directory), hence the one libc call
    through ``ctypes``; where the file system refuses it, the old directory is renamed aside
    first, a moment in which the directory is missing (logged); the next save puts it back
    if a kill came in that moment, and removes it if the kill came while it was being deleted
    (it kept every later save from moving its own old one aside). Where nothing can be written
    beside the directory (a mount point, a read-only parent, a directory that holds the
    process's working directory) it is written file by file as before, with a warning. A
    symbolic link is followed (its target is exchanged, the link kept), and the new directory
    takes the old one's mode, group and owner.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn as nn

from offload.api.checkpoint import UnitValues, check_float_dtype, path_given, written_by_rank0
from offload.config import parse_size
from offload.plan import Segment, Unit
from offload.runtime.safetensors import Entry, fsync_dir, write_file
from offload.runtime.values import FROZEN, Values
from offload.runtime.weights import INDEX, SINGLE

_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# the weight files a save writes, or drops as stale; every other file of the directory stays
_OWN = (SINGLE, INDEX)

logger = logging.getLogger("offload.api")

# from_pretrained's keyword arguments that the model class's from_config reads itself (the
# others that name config attributes override the config, as in transformers' from_pretrained)
_FROM_CONFIG_KWARGS = (
    "dtype",
    "torch_dtype",
    "attn_implementation",
    "experts_implementation",
    "trust_remote_code",
)


def _need_transformers(what: str):
    try:
        import transformers  # noqa: PLC0415
    except ImportError:
        raise ImportError(
            f"offload.{what} needs Hugging Face transformers: pip install 'offload[hf]'"
        ) from None
    return transformers


def from_pretrained(
    path: str | os.PathLike,
    config=None,
    *,
    before_wrap: Callable | None = None,
    model_class=None,
    **model_kwargs,
):
    """Builds the model of the local Hugging Face directory ``path`` on the meta device (the class
    its ``config.json`` names in ``architectures``: a causal LM, a seq2seq model, a classifier,
    a vision model; a causal LM where it names none) and wraps it with ``weights=path``;
    returns ``(model, optimizer)``. ``config`` is offload's
    config (as for :func:`offload.wrap`); ``model_kwargs`` are taken as ``transformers``'
    ``from_pretrained`` takes them: those that name attributes of the model's config override
    its values (``output_router_logits=True``, ``rope_scaling=...``), the rest go to
    the class's ``from_config`` (``dtype``, default the checkpoint's;
    ``attn_implementation``).
    ``before_wrap(model)`` runs on the model before it is wrapped (its parameters on the meta
    device): where to freeze parameters, which wrap fixes (``requires_grad`` changed after
    wrap is refused at the next backward). The model comes back in eval mode, as from
    ``transformers``' ``from_pretrained``: call ``model.train()`` to train with dropout.
    ``model_class`` (a ``transformers`` class or ``AutoModelFor...`` class) builds another
    head than the saved one, as that class's ``from_pretrained`` does: a classifier on a
    checkpoint saved as ``BertForMaskedLM`` (``AutoModelForSequenceClassification``,
    ``num_labels=3``); the parameters the file lacks (the new head) are initialised by the
    model's ``_init_weights`` and the file's tensors the model lacks (the old head) are left
    out, both named in a warning. ``ignore_mismatched_sizes=True``, as in ``transformers``,
    initialises a parameter whose shape differs from the file's too (a classifier of another
    ``num_labels``).
    Nothing is downloaded: ``path`` must be a directory."""
    transformers = _need_transformers("from_pretrained")
    from offload.api.wrap import wrap  # noqa: PLC0415

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"offload.from_pretrained: '{path}' is not a local model directory with a "
            "config.json (offload never downloads; use huggingface-cli download first)"
        )
    # as transformers' from_pretrained: kwargs that are config attributes override the config,
    # except those from_config itself reads; the rest go on to the model
    building = {k: model_kwargs.pop(k) for k in _FROM_CONFIG_KWARGS if k in model_kwargs}
    resized = bool(model_kwargs.pop("ignore_mismatched_sizes", False))
    hf_config, model_kwargs = transformers.AutoConfig.from_pretrained(
        path,
        local_files_only=True,
        return_unused_kwargs=True,
        trust_remote_code=building.get("trust_remote_code"),
        **model_kwargs,
    )
    model_kwargs.update(building)
    if "dtype" not in model_kwargs and "torch_dtype" not in model_kwargs:
        saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(saved, str):
            saved = getattr(torch, saved, None)
        model_kwargs["dtype"] = saved if isinstance(saved, torch.dtype) else torch.float32
    cls = _saved_architecture(transformers, hf_config)
    if model_class is not None:
        _check_model_class(transformers, model_class)
    # parameters on the meta device, buffers real, as transformers builds a model to load: under
    # torch.device("meta") a buffer made in __init__ and in no file (GPT-Neo's and GPTBigCode's
    # causal masks) had no value and the model was refused, and the tied pair came out tied
    # already, so a file holding both with other values lost its head (untied by transformers)
    from accelerate import init_empty_weights  # noqa: PLC0415 - the hf extra's, as transformers

    with init_empty_weights():
        if model_class is not None:
            if hasattr(model_class, "_model_mapping"):  # an AutoModelFor... class
                model = model_class.from_config(hf_config, **model_kwargs)
            else:
                model_kwargs.pop("trust_remote_code", None)
                model = model_class._from_config(hf_config, **model_kwargs)
        elif cls is None:
            model = _causal_lm(transformers, hf_config, path, model_kwargs)
        else:
            model_kwargs.pop("trust_remote_code", None)  # a class of transformers' own
            model = cls._from_config(hf_config, **model_kwargs)
    model.eval()  # as transformers' from_pretrained: dropout off until model.train()
    _read_generation_config(transformers, model, path)
    if before_wrap is not None:
        before_wrap(model)
    return wrap(model, config, weights=path, _new_head=model_class is not None, _resized=resized)


def _read_generation_config(transformers, model: nn.Module, path: Path) -> None:
    """As transformers' ``from_pretrained``: the directory's ``generation_config.json`` (an
    instruct model's stop tokens, its sampling defaults) replaces the one the model built from
    ``config.json``. It was never read: ``generate`` ran without them, and every
    ``save_pretrained`` wrote the defaults over the file. One that cannot be read is said, and
    the model's own kept (transformers says it too)."""
    file = path / "generation_config.json"
    if not file.is_file() or getattr(model, "generation_config", None) is None:
        return
    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        logger.warning(
            "offload.from_pretrained: cannot read '%s' (%s); generate uses the settings built "
            "from config.json",
            file,
            exc,
        )


def _check_model_class(transformers, model_class) -> None:
    auto = isinstance(model_class, type) and hasattr(model_class, "_model_mapping")
    concrete = isinstance(model_class, type) and issubclass(
        model_class, transformers.PreTrainedModel
    )
    if not (auto or concrete):
        raise TypeError(
            f"offload.from_pretrained: model_class={model_class!r}; allowed: None (the class "
            "config.json's architectures names), a transformers model class "
            "(BertForSequenceClassification) or an AutoModelFor... class "
            "(AutoModelForSequenceClassification)"
        )


def _saved_architecture(transformers, hf_config):
    """The class ``config.json``'s ``architectures`` names, where ``transformers`` has it for this
    config (``T5ForConditionalGeneration``, ``BertForSequenceClassification``,
    ``LlamaForCausalLM``): the head the weights were saved with, as ``transformers``' pipelines
    pick it. Else None (no ``architectures``, or remote code), for ``AutoModelForCausalLM``.

    ``AutoModelForCausalLM`` alone built the wrong model for every other head: the decoder-only
    ``BartForCausalLM`` / ``WhisperForCausalLM`` / ``BertLMHeadModel`` of a seq2seq or
    classifier directory (wrap then refused the encoder's keys as unexpected), and nothing at all
    for T5 or ViT."""
    names = getattr(hf_config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    base = transformers.PreTrainedModel
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return None
    config_class = getattr(cls, "config_class", None)
    if config_class is not None and not isinstance(hf_config, config_class):
        return None
    return cls


def check_causal_lm(path: str | os.PathLike, what: str) -> None:
    """Refuses the directory ``path`` where its ``config.json`` names a class that is not a
    causal LM (a seq2seq model, a masked LM, a classifier), which :func:`from_pretrained`
    builds as it is; for callers that train a causal LM (``offload finetune``)."""
    transformers = _need_transformers(what)
    from transformers.models.auto.modeling_auto import (  # noqa: PLC0415
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    )

    hf_config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    cls = _saved_architecture(transformers, hf_config)
    if cls is None:
        return  # AutoModelForCausalLM decides (and says what it cannot build)
    causal = set()
    for names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        causal.update([names] if isinstance(names, str) else names)
    if cls.__name__ not in causal:
        raise ValueError(
            f"{what}: '{path}' holds a {cls.__name__} (config.json's architectures), not a "
            "causal LM; allowed: a model of the AutoModelForCausalLM architectures (Llama, "
            "Qwen2, Mistral, GPT-2...), which this trains on next-token labels"
        )


def _causal_lm(transformers, hf_config, path: Path, model_kwargs: dict):
    try:
        return transformers.AutoModelForCausalLM.from_config(hf_config, **model_kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        names = getattr(hf_config, "architectures", None)
        raise ValueError(
            f"offload.from_pretrained: '{path}/config.json' has architectures={names!r} and "
            f"model_type={getattr(hf_config, 'model_type', None)!r}: no class of transformers "
            "by that name for this config, and no AutoModelForCausalLM for it; allowed: a "
            "directory whose config.json names its transformers class in 'architectures' (as "
            "save_pretrained writes it), or a causal LM; else build the model yourself and "
            "call offload.wrap(model, config, weights=path)"
        ) from None


def warn_kept_in_fp32(model: nn.Module, dtype: torch.dtype) -> None:
    """Says at wrap which parameters ``transformers`` would keep in fp32 at this compute dtype
    (the model's ``_keep_in_fp32_modules`` under fp16, ``_keep_in_fp32_modules_strict`` under
    fp16 and bf16: T5's ``wo``, whose activations overflow fp16) and offload computes in
    ``dtype`` as every other parameter (one compute dtype per model: the flat unit buffers hold
    one dtype). Nothing is said for a model that declares none, or at fp32."""
    plan = getattr(model, "_get_dtype_plan", None)
    if dtype not in (torch.float16, torch.bfloat16) or not callable(plan):
        return
    try:
        patterns = [k for k, v in plan(dtype).items() if v == torch.float32]
    except Exception:  # noqa: BLE001 (another transformers' signature: nothing to say)
        return
    if not patterns:
        return
    # transformers matches the module names as globs on the parameter names' dotted parts
    alt = "|".join(re.escape(k).replace(r"\*", r"[^.]+") for k in patterns)
    match = re.compile(rf"(^|\.)({alt})(\.|$)")
    names = [n for n, _ in model.named_parameters() if match.search(n)]
    if not names:
        return
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    logger.warning(
        "offload.wrap: %s declares _keep_in_fp32_modules %s, which transformers keeps in fp32 "
        "at %s; offload computes them in dtype=%s as every other parameter (%s): their "
        "activations may overflow it. Use dtype %s to compute them as transformers would",
        type(model).__name__,
        sorted(patterns),
        str(dtype).removeprefix("torch."),
        "fp16" if dtype == torch.float16 else "bf16",
        shown,
        "'bf16' or 'fp32'" if dtype == torch.float16 else "'fp32'",
    )


# ------------------------------------------------------------------------------------------ out
class _PieceReader:
    """One unit's tensors, chunk by chunk, from its owners (see the module Note)."""

    def __init__(self, values: Values, unit: Unit) -> None:
        self.values, self.unit = values, unit
        self._at: tuple[str, int] | None = None
        self._flat: torch.Tensor | None = None
        # the end of the last tensor of each kind: past it no tensor of the unit needs a piece
        self._last: dict[bool, int] = {}
        for s in unit.layout.segments:
            self._last[s.trainable] = max(self._last.get(s.trainable, 0), s.end)

    def chunks(self, seg: Segment) -> Iterator[torch.Tensor]:
        kind = "master" if seg.trainable else FROZEN
        for lo, hi in self.values.pieces(self.unit, kind):
            a, b = max(lo, seg.offset), min(hi, seg.end)
            if a >= b:
                continue
            if self._at != (kind, lo):
                self._flat = None  # the previous piece goes before the next is read
                self._flat = self.values.flat(self.unit, kind, lo, hi)
                self._at = (kind, lo)
            chunk = self._flat[a - lo : b - lo]
            if hi <= seg.end or seg.end >= self._last[seg.trainable]:
                # no later tensor starts in this piece: it goes with its last chunk (every
                # unit's reader lives until the last shard is written, and each one kept its
                # last piece: the whole model in fp32 with pieces of a unit, module Note)
                self._flat = self._at = None
            yield chunk
            del chunk


def model_entries(
    model: nn.Module, dtype: torch.dtype | None = None, whole: UnitValues | None = None
) -> list[Entry]:
    """``(name, dtype, shape, producer)`` of every tensor a wrapped model's state dict holds, one
    name per parameter, in unit order (each unit read once), then the persistent buffers. Each
    tensor streams piece by piece from its owners, or, with ``whole`` (several ranks), comes
    from its unit's gathered values."""
    from offload.api.wrap import engine_of  # noqa: PLC0415

    engine = engine_of(model)
    first: dict[nn.Parameter, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(p, name)
    entries: list[Entry] = []
    for unit in engine.units:
        reader = _PieceReader(engine.values, unit)
        for seg in sorted(unit.layout.segments, key=lambda s: s.offset):
            if whole is None:
                produce = lambda s=seg, r=reader: r.chunks(s)  # noqa: E731
            else:
                produce = lambda s=seg, u=unit: iter([whole.of(s.param, u).reshape(-1)])  # noqa: E731
            entries.append((first[seg.param], dtype or seg.dtype, list(seg.shape), produce))
    for mname, module in model.named_modules():
        for bname, buf in module._buffers.items():
            if buf is None or bname in module._non_persistent_buffers_set:
                continue
            before = engine.buffer_dtypes.get((module, bname), buf.dtype)
            bdt = (dtype or before) if buf.is_floating_point() else buf.dtype
            full = f"{mname}.{bname}" if mname else bname
            entries.append((full, bdt, list(buf.shape), lambda b=buf: iter([b])))
    return entries


def _nbytes(entry: Entry) -> int:
    return torch.Size(entry[2]).numel() * entry[1].itemsize


def split_shards(entries: list[Entry], max_shard_size: int) -> list[list[Entry]]:
    """Entries in shards of at most ``max_shard_size`` bytes (see the module Note)."""
    shards: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for entry in entries:
        n = _nbytes(entry)
        if n > max_shard_size:  # alone, after the shard being filled: tensors stay in order
            if current:
                shards.append(current)
                current, size = [], 0
            shards.append([entry])
            continue
        if current and size + n > max_shard_size:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += n
    if current:
        shards.append(current)
    return shards


def write_shards(
    directory: str | os.PathLike, entries: list[Entry], max_shard_size: int | str = "5GB"
) -> list[Path]:
    """Writes ``entries`` as ``model.safetensors`` or as shards with their index (the layout
    ``from_pretrained`` reads), streaming; removes what an earlier save left that the new files
    do not replace; returns the files written."""
    limit = parse_size(max_shard_size, key="max_shard_size")
    if limit <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r}; allowed: a size > 0")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards = split_shards(entries, limit)
    n = len(shards)
    names = [SINGLE] if n <= 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    written = []
    for name, shard in zip(names, shards or [[]]):
        written.append(write_file(directory / name, shard, metadata={"format": "pt"}))
    if n > 1:
        index = {
            "metadata": {"total_size": sum(_nbytes(e) for e in entries)},
            "weight_map": {e[0]: name for name, shard in zip(names, shards) for e in shard},
        }
        tmp = directory / f".{INDEX}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / INDEX)
        written.append(directory / INDEX)
    keep = {p.name for p in written}
    for old in directory.iterdir():
        stale = _SHARD.fullmatch(old.name) or old.name in (SINGLE, INDEX)
        if stale and old.name not in keep and old.is_file():
            old.unlink()
    return written


def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Writes a wrapped model as a Hugging Face directory (see the module Notes): its current
    values (the fp32 masters of trainable parameters, in ``dtype``, default each parameter's
    dtype before wrap), and ``config.json`` when the model has a Hugging Face config. Loadable
    with ``transformers``' ``from_pretrained(directory)`` of the model's class or
    :func:`from_pretrained`. Returns ``directory``."""
    from offload.api.wrap import engine_of  # noqa: PLC0415

    check_float_dtype("save_pretrained", dtype, none="each parameter's dtype before wrap")
    engine = engine_of(model)
    engine.check_readable("save_pretrained")
    engine.watch.check_in_model("save_pretrained", pieces=True)
    directory = path_given("save_pretrained", directory, ValueError, "nothing was written")

    def write(values: UnitValues) -> None:
        if directory.exists() and not directory.is_dir():  # found after every shard was written
            raise NotADirectoryError(
                errno.ENOTDIR,
                "is not a directory: save_pretrained writes a directory (created if missing); "
                "nothing was written",
                str(directory),
            )
        # one rank streams each tensor piece by piece; with several each holds a share, so
        # whole units are gathered (rank 0 writes, as export does)
        whole = values if engine.comm.world > 1 else None
        with _staged(directory) as stage:
            write_shards(stage, model_entries(model, dtype, whole), max_shard_size)
            _write_config(model, engine, stage, dtype)

    written_by_rank0(engine, "save_pretrained", write)
    return directory


def _write_config(model: nn.Module, engine, directory: Path, dtype: torch.dtype | None) -> None:
    hf_config = getattr(model, "config", None)
    if hf_config is not None and hasattr(hf_config, "to_json_file"):
        hf_config = copy.deepcopy(hf_config)
        # as transformers' save_pretrained: the class saved, not the checkpoint's it came from
        # (a classifier built on an MLM checkpoint), which from_pretrained builds again
        if callable(getattr(type(model), "_from_config", None)):  # a transformers model
            hf_config.architectures = [type(model).__name__]
        saved = dtype or next((s.dtype for u in engine.units for s in u.layout.segments), None)
        if saved is not None:
            hf_config.dtype = saved
        tmp = directory / ".config.json.tmp"
        hf_config.to_json_file(tmp)
        os.replace(tmp, directory / "config.json")
        generation = getattr(model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(directory)


@contextlib.contextmanager
def _staged(directory: Path):
    """Yields the directory to write a save of ``directory`` into; on a clean exit it becomes
    ``directory`` whole (the module Note: all or nothing), on an error it is removed and
    ``directory`` is as it was. A symbolic link is followed (its target is replaced, the
    link kept: the link was replaced by a real directory, the target left without the
    weights); the new directory gets the old one's mode, group and owner (where this process
    may set them); and a directory holding the working directory is written file by file (it
    was removed under the process, or refused as busy after every shard was written)."""
    directory = Path(os.path.realpath(directory))
    stage = directory.parent / f".{directory.name}.offload-new"
    aside = directory.parent / f".{directory.name}.offload-old"
    try:
        if os.path.ismount(directory):  # a volume mounted there is not renamed
            raise OSError(errno.EBUSY, "a mount point", str(directory))
        here = Path(os.path.realpath(os.getcwd()))
        if directory.exists() and (here == directory or directory in here.parents):
            raise OSError(errno.EBUSY, "it holds the working directory", str(directory))
        if stage.exists():  # left by a save that was killed
            shutil.rmtree(stage)
        _put_back(directory, aside)
        stage.mkdir(parents=True)
        if directory.exists():
            _same_owner_and_mode(directory, stage, writable=True)
    except OSError as exc:  # (a read-only parent, say): as before, file by file
        logger.warning(
            "save_pretrained: cannot write beside '%s' (%s); writing into it file by file, "
            "which a crash part way can leave mixed",
            directory,
            exc.strerror or exc,
        )
        directory.mkdir(parents=True, exist_ok=True)
        yield directory
        return
    try:
        yield stage
        if directory.exists():
            _keep_the_rest(directory, stage)
            _same_owner_and_mode(directory, stage, writable=False)
            fsync_dir(stage)
            if not _exchange(stage, directory):
                logger.info("save_pretrained: no atomic exchange here; '%s' moved aside", directory)
                os.rename(directory, aside)
                os.rename(stage, directory)
                stage = aside
        else:
            fsync_dir(stage)
            os.rename(stage, directory)
        fsync_dir(directory.parent)
    finally:
        if stage.exists():  # the old directory after the exchange, or a save that failed
            shutil.rmtree(stage, ignore_errors=True)


def _same_owner_and_mode(old: Path, new: Path, *, writable: bool) -> None:
    """``new`` gets ``old``'s permission bits (a shared directory's 2770 became 755: its
    set-group-ID bit gives the files written into it the group) and its group and owner where
    this process may give them (root, or the owner to a group of its); ``writable``: still
    writable by this process (the bits exactly once the files are in)."""
    st = old.stat()
    with contextlib.suppress(PermissionError):
        os.chown(new, st.st_uid, st.st_gid)
    with contextlib.suppress(PermissionError):
        os.chown(new, -1, st.st_gid)
    mode = stat.S_IMODE(st.st_mode)
    os.chmod(new, mode | stat.S_IRWXU if writable else mode)


def _put_back(directory: Path, aside: Path) -> None:
    """What a save killed where the exchange is refused left at ``aside`` (the old export,
    moved there before the new one took its place): put back whole where the kill came
    between the two renames (no ``directory``), removed where it came after them (the old
    export, perhaps half deleted, which also kept every later save from moving its own old
    one aside)."""
    if not aside.is_dir() or aside.is_symlink():
        return
    if not directory.exists():
        os.rename(aside, directory)
        logger.warning(
            "save_pretrained: '%s' was missing (a save killed while it was moved aside); put "
            "back from '%s'",
            directory,
            aside,
        )
    else:
        shutil.rmtree(aside)


def _keep_the_rest(old: Path, stage: Path) -> None:
    """Hard-links into ``stage`` what ``old`` holds that the save did not write (a config it
    wrote replaces the old one), but for weight files (stale, as ``write_shards`` has it)."""
    for entry in old.iterdir():
        target = stage / entry.name
        if target.exists() or entry.name in _OWN or _SHARD.fullmatch(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target, symlinks=True, copy_function=_link)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry), target)
        else:
            _link(entry, target)


def _link(src, dst) -> None:
    """A hard link, or a copy where there can be none (another file system)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _exchange(a: Path, b: Path) -> bool:
    """Swaps directories ``a`` and ``b`` atomically (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); False where that call or flag is not supported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))
