"""Checkpoint files: safetensors streamed out of tensor pieces with a running checksum, a sealed
``meta.json``, the commit of a checkpoint directory, and the reader that verifies one before
anything is loaded from it. This module knows files, tensors and bytes, nothing of models.

Note: what a checkpoint directory holds
    ``meta.json`` and the data files it lists under ``"files"``. For each file it records the
    ``size`` in bytes, the ``sha256`` of the file's exact bytes and its ``tensors`` (name ->
    ``{"dtype", "shape"}``), and ``blocks``: ``{"size": BLOCK, "sha256": [...]}``, the
    SHA-256 of each ``BLOCK``-byte block of the file in order (the last one shorter), so a
    reader that needs only some byte ranges of a file (a rank loading its share of another
    world size's checkpoint) verifies only the blocks it reads. ``meta_sha256`` is the SHA-256
    of the canonical JSON of every other key of ``meta.json`` (sorted keys, no spaces, ASCII):
    a flipped byte in ``meta.json`` itself is caught too. ``format`` and ``version`` (3;
    version 2 had no block checksums and is still read, version 1 had no checksums) say what
    the directory is. The caller's own keys are sealed with the rest; :func:`check_layout` and
    :func:`check_counters` check the ones a load of units uses (``units``, ``step_count``,
    ``skipped_steps``, ``loss_scaler``, ``param_group(s)``, ``extra``) against what the caller
    passes in, so that a load can be refused before anything changes.

    A data file's checksums are computed while the file is written, over the same bytes,
    piece by piece: a save never holds a file in RAM and never reads one back.

Note: commit
    :class:`CheckpointWriter` writes into ``root/.<name>.tmp``, fsyncs every file and the
    directory, renames it to ``root/<name>``, then replaces the pointer ``root/latest`` (temp
    name, fsync, rename, fsync of ``root``) and only then deletes the checkpoints written
    before the last ``keep_last``, each renamed to ``.<name>.removing`` first (a kill while
    deleting it leaves no half checkpoint under a checkpoint's name). The temp directories and
    ``.removing`` directories of saves that were killed are deleted before a save writes
    anything, so that the space they hold is free for it (on a disk that holds two
    checkpoints, what a killed save left made every later save fail with ENOSPC). Only
    directories named as a save names them are deleted: anything else in ``root`` stays. A crash at any point leaves ``latest`` naming a complete checkpoint. One
    process saves into a given ``root`` at a time.

Note: verification before use
    :func:`open_checkpoint` checks everything a load relies on before its caller changes
    anything: ``meta.json`` parses, is sealed and has the schema above; the directory holds
    exactly the listed files; each file's size, its safetensors header (8-byte length, JSON,
    dtypes, shapes, data offsets that tile the data region) and the header's tensors agree
    with ``meta.json``; and the SHA-256 of each whole file, read in ``CHUNK``-sized reads into
    one reused buffer per file or block range (an anonymous mapping: ``_sha256_of``), matches.
    Nothing checkpoint-sized is held in RAM.

    A reader that needs only parts of some files (``need``: file -> byte ranges) opens and
    checks only those files (size, header) and verifies the blocks covering the header and its
    ranges; a file it reads whole is verified whole. What it does not read it does not verify
    (another rank that reads it does).

    The files stay open from verification until the reader is closed and tensor slices are
    read from those same descriptors, so renaming or replacing a file after verification
    cannot feed unverified bytes (rewriting a verified file in place still could). Slices are
    read with ``preadv`` into one reused buffer (no mmap: a file truncated under an mmap
    kills the process with SIGBUS; a short read is an error).

Every failure is a :class:`CheckpointError` whose message names the file and what is wrong.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import mmap
import os
import re
import shutil
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from offload._interrupts import map_in_threads
from offload.runtime.safetensors import fsync_dir, naming_write_errors, write_stream

logger = logging.getLogger("offload.checkpoint")

FORMAT = "offload-checkpoint"
VERSION = 3
READS = (2, 3)  # versions this reader accepts
BLOCK = 4 << 20  # bytes per block checksum
META = "meta.json"
LATEST = "latest"
CHUNK = 8 << 20  # bytes per read while checksumming
MAX_HEADER = 100 << 20  # bytes; safetensors' own limit
MAX_META = 256 << 20  # bytes
MAX_INT = 2**63 - 1  # counts, sizes and shapes beyond this are corrupt

ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",  # buffers (a float64 buffer, an int8 one were refused by the save)
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES = {code: dt for dt, code in ST_DTYPES.items()}
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,254}")
_CKPT_NAME = re.compile(r"ckpt-(\d+)-(\d+)")  # checkpoint_name's: the step, when (ns)
_TMP_NAME = re.compile(r"\.ckpt-\d+-\d+\.tmp")  # CheckpointWriter's temp directory of one
_GONE_NAME = re.compile(r"\.ckpt-\d+-\d+\.removing")  # a checkpoint the pruning deletes
_HEX64 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one was asked for (no ``latest``, or it names nothing complete)."""


def _fail(path: Path | str, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file '{path}': {what}")


def short_repr(value, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


# ------------------------------------------------------------------------ writing
Producer = Callable[[], Iterable[torch.Tensor]]
Entry = tuple[str, torch.dtype, Sequence[int], Producer]


@dataclass(frozen=True, slots=True)
class FileRecord:
    """What ``meta.json`` records about one data file."""

    size: int  # bytes
    sha256: str  # hex digest of the file's bytes
    tensors: dict  # name -> {"dtype": code, "shape": [...]}, in file order
    blocks: tuple[str, ...] = ()  # hex digest of each BLOCK bytes

    def to_json(self) -> dict:
        out = {"size": self.size, "sha256": self.sha256, "tensors": self.tensors}
        out["blocks"] = {"size": BLOCK, "sha256": list(self.blocks)}
        return out

    @staticmethod
    def from_json(rec: dict) -> FileRecord:
        return FileRecord(
            rec["size"], rec["sha256"], rec["tensors"], tuple(rec["blocks"]["sha256"])
        )


class _Hasher:
    """The SHA-256 of a stream of bytes and of each ``BLOCK`` of it, fed in any pieces."""

    def __init__(self) -> None:
        self.whole, self.block, self.filled = hashlib.sha256(), hashlib.sha256(), 0
        self.blocks: list[str] = []

    def update(self, data) -> None:
        self.whole.update(data)
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), BLOCK - self.filled)
            self.block.update(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled == BLOCK:
                self.blocks.append(self.block.hexdigest())
                self.block, self.filled = hashlib.sha256(), 0

    def done(self) -> tuple[str, tuple[str, ...]]:
        if self.filled:
            self.blocks.append(self.block.hexdigest())
        return self.whole.hexdigest(), tuple(self.blocks)


def write_safetensors(
    path: Path, entries: list[Entry], metadata: dict[str, str] | None = None
) -> FileRecord:
    """Writes a safetensors file whose tensors are produced piece by piece (in order), hashing
    the bytes as they go out; fsyncs it. Returns its size, checksum and tensors."""
    digest = _Hasher()
    size = 0

    def sink(data) -> None:
        nonlocal size
        digest.update(data)
        size += len(data)

    with naming_write_errors(path, "a checkpoint file"), open(path, "wb") as f:
        header = write_stream(f, entries, metadata, sink=sink, names=ST_DTYPES, what="checkpoint")
        f.flush()
        os.fsync(f.fileno())
    tensors = {
        n: {"dtype": h["dtype"], "shape": h["shape"]} for n, h in header.items() if n[:2] != "__"
    }
    whole, blocks = digest.done()
    return FileRecord(size, whole, tensors, blocks)


def _canonical(meta: dict) -> bytes:
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def seal_meta(meta: dict) -> dict:
    """``meta`` with its ``meta_sha256`` (over everything else) set."""
    return dict(meta, meta_sha256=hashlib.sha256(_canonical(meta)).hexdigest())


def _write_text(path: Path, text: str) -> None:
    with naming_write_errors(path, "a checkpoint file"), open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _check_pointer(pointer: Path) -> None:
    """``pointer`` (``root/latest``) is absent or offload's, which the commit replaces: one
    that names a directory without ``meta.json`` under another naming (DeepSpeed's "latest"
    holds its tag, "global_step100") is another tool's, and replacing it loses that tool's
    way to its checkpoint. A directory there (a link to one too) is refused as well: the
    commit's rename onto it failed only after the whole checkpoint was written."""
    if pointer.is_dir():
        what = "a directory"
        if pointer.is_symlink():
            what = f"a symbolic link to the directory '{os.readlink(pointer)}'"
        raise IsADirectoryError(
            errno.EISDIR,
            f"is {what}, where save_checkpoint keeps its pointer to the newest checkpoint (a "
            "file holding its name); move it aside or save into another directory (nothing "
            "was written)",
            str(pointer),
        )
    if not pointer.is_file():
        return
    try:
        with open(pointer, "rb") as f:
            name = f.read(4096).decode().strip()
    except (OSError, UnicodeDecodeError):
        name = None
    ours = name is not None and (
        _CKPT_NAME.fullmatch(name) is not None
        or (_FILE_NAME.fullmatch(name) is not None and (pointer.parent / name / META).is_file())
    )
    if not ours:
        raise FileExistsError(
            errno.EEXIST,
            f"'{pointer}' names {short_repr(name)}, which is not an offload checkpoint (another "
            "tool's pointer, DeepSpeed's say); save into another directory (nothing was "
            "written)",
        )


def checkpoint_name(step: int, root: Path | None = None) -> str:
    """A new checkpoint's directory name: its step and when it is written (ns since the
    epoch), by which ``keep_last`` orders a directory's checkpoints; after every checkpoint
    already in ``root``, so that a run resumed on a machine whose clock is behind the one that
    wrote them (a preempted job on another node) does not name its saves "older" (keep_last
    then kept the other machine's and removed this run's own)."""
    stamp = time.time_ns()
    try:
        names = os.listdir(root) if root is not None else []
    except OSError:  # no directory yet (or not on this rank's machine): nothing to come after
        names = []
    for name in names:
        if m := _CKPT_NAME.fullmatch(name):
            stamp = max(stamp, int(m[2]) + 1)
    return f"ckpt-{step:08d}-{stamp}"


def _check_root(root: Path) -> None:
    """``root`` is a directory, or can be made one: mkdir said only "File exists" for a file
    there and for a symbolic link whose target is missing (a scratch disk not mounted), at
    ``root`` or at a directory above it; the link is not followed to make its target."""
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(
            errno.ENOTDIR,
            "is not a directory: a checkpoint goes into a directory (created if missing), "
            "beside the others saved there; nothing was written",
            str(root),
        )
    for path in (root, *root.parents):
        if path.exists():
            return
        if path.is_symlink():
            why = "No such file or directory"
            try:
                path.stat()  # ENOENT for a missing target, ELOOP for a loop of links
            except OSError as exc:
                why = exc.strerror or why
            raise FileNotFoundError(
                errno.ENOENT,
                f"is a symbolic link to '{os.readlink(path)}', which cannot be reached "
                f"({why}; a disk not mounted?): a checkpoint goes into a directory (created "
                "if missing), not through a broken link; mount or create its target, or save "
                "elsewhere; nothing was written",
                str(path),
            )


class CheckpointWriter:
    """Writes one checkpoint directory ``root/name`` (see Note: commit). Use as a context
    manager: leaving it with an exception before :meth:`commit` removes the temp directory.

    Several processes can write one checkpoint (one per rank): the owner creates the temp
    directory and commits; the others (``owner=False``) add their files to the existing temp
    directory and never commit or remove it. The owner commits only once every writer's files
    are durable (each is fsynced by :meth:`add_file` before its record is handed to the owner,
    ``offload.api.checkpoint``)."""

    def __init__(self, root: Path, name: str, *, owner: bool = True) -> None:
        self.root, self.name, self.owner = root, name, owner
        self.tmp = root / f".{name}.tmp"
        if owner:
            _check_root(root)
            _check_pointer(root / LATEST)
            root.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()
            self.tmp.mkdir()
        elif not self.tmp.is_dir():
            raise CheckpointError(f"checkpoint directory '{self.tmp}' does not exist here")
        self.files: dict[str, FileRecord] = {}
        self._committed = False

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if self.owner and not self._committed:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def add_file(self, name: str, entries: list[Entry]) -> None:
        self.files[name] = write_safetensors(self.tmp / name, entries)

    def sync(self) -> None:
        """The directory entries of the files added are durable too."""
        fsync_dir(self.tmp)

    def commit(self, meta: dict, keep_last: int = 1) -> Path:
        """Seals ``meta`` (plus format, version and the file records) into ``meta.json``,
        publishes the directory and points ``latest`` at it; returns its path."""
        body = dict(meta, format=FORMAT, version=VERSION)
        body["files"] = {n: r.to_json() for n, r in self.files.items()}
        body = json.loads(json.dumps(body))  # as a load will see it: tuples as lists, str keys
        _write_text(self.tmp / META, json.dumps(seal_meta(body), indent=1))
        fsync_dir(self.tmp)
        final = self.root / self.name
        os.rename(self.tmp, final)
        self._committed = True
        fsync_dir(self.root)
        pointer = self.root / f"{LATEST}.tmp"
        _write_text(pointer, self.name + "\n")
        os.replace(pointer, self.root / LATEST)
        fsync_dir(self.root)
        self._prune(keep_last)
        return final

    def _prune(self, keep_last: int) -> None:
        """Removes the checkpoints beyond the ``keep_last`` written last (this one included),
        by when they were written, not by step (a resume from an earlier step saves lower
        steps after higher ones). Only directories named as :func:`checkpoint_name` names them
        are touched: a user's ``ckpt-best`` beside them stays."""
        old = [
            (int(m[2]), p)
            for p in self.root.iterdir()
            if (m := _CKPT_NAME.fullmatch(p.name)) and p.name != self.name and p.is_dir()
        ]
        old.sort()
        for _, p in old[: max(0, len(old) - (keep_last - 1))]:
            # renamed first: a kill while deleting leaves a directory that is garbage by its
            # name (removed by the next save), never half a checkpoint under a checkpoint's
            gone = p.with_name(f".{p.name}.removing")
            try:
                os.rename(p, gone)
            except OSError:
                continue
            shutil.rmtree(gone, ignore_errors=True)

    def _remove_leftovers(self) -> None:
        """Removes what killed saves left in ``root``: their temp directories and the
        checkpoints their pruning was deleting (named as the writer names them; one process
        saves into a ``root`` at a time, so none of them is being written), before this save
        writes, so that their space is free for it."""
        for p in self.root.iterdir():
            if _TMP_NAME.fullmatch(p.name) and p.name != self.tmp.name and p.is_dir():
                what = "the temp directory of a save that did not finish"
            elif _GONE_NAME.fullmatch(p.name) and p.is_dir():
                what = "a checkpoint whose removal (keep_last) did not finish"
            else:
                continue
            nbytes = _disk_bytes(p)
            shutil.rmtree(p, ignore_errors=True)
            logger.warning("offload: removed '%s' (%d bytes on disk), %s", p, nbytes, what)


def _disk_bytes(directory: Path) -> int:
    """Bytes the files under ``directory`` occupy on disk (allocated blocks)."""
    total = 0
    for top, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
    return total


# ------------------------------------------------------------------------ reading
def resolve(directory: Path) -> Path:
    """The checkpoint directory ``directory`` is, or the one its ``latest`` names."""
    if (directory / META).exists():
        return directory
    pointer = directory / LATEST
    if not pointer.exists():
        raise CheckpointNotFoundError(
            f"load_checkpoint: no checkpoint in '{directory}' (no 'latest' file or meta.json)"
        )
    try:
        with open(pointer, "rb") as f:
            raw = f.read(4096).decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(pointer, f"cannot be read ({exc})") from None
    name = raw.strip()
    if not _FILE_NAME.fullmatch(name):
        raise _fail(pointer, f"names {short_repr(name)}, which is not a checkpoint directory name")
    ckpt = directory / name
    if not (ckpt / META).exists():
        raise CheckpointNotFoundError(
            f"load_checkpoint: '{pointer}' names '{name}', which is incomplete or missing "
            f"(no '{ckpt / META}')"
        )
    return ckpt


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a verified file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    numel: int


def _parse_json(path: Path, raw: bytes, what: str):
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _fail(path, f"{what} is not valid JSON ({short_repr(str(exc), 120)})") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_code(v) -> bool:
    return isinstance(v, str) and v in DTYPES


def _check_tensor_record(path: Path, name, rec) -> None:
    if not isinstance(name, str) or not isinstance(rec, dict) or set(rec) != {"dtype", "shape"}:
        raise _fail(path, f"meta.json's record of tensor {short_repr(name)} is malformed")
    if not _is_code(rec["dtype"]) or not isinstance(rec["shape"], list):
        raise _fail(path, f"meta.json's record of tensor '{name}' has a bad dtype or shape")
    if not all(_is_int(d) and 0 <= d <= MAX_INT for d in rec["shape"]):
        raise _fail(path, f"meta.json's shape of tensor '{name}' is {short_repr(rec['shape'])}")


def _read_meta(ckpt: Path) -> dict:
    path = ckpt / META
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_META:
                raise _fail(path, f"is over {MAX_META} bytes; it is not a checkpoint's meta.json")
            raw = f.read()
    except OSError as exc:
        raise _fail(path, f"cannot be read ({exc.strerror or exc})") from None
    meta = _parse_json(path, raw, "the file")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _fail(path, f'is not an offload checkpoint (no "format": "{FORMAT}")')
    version = meta.get("version")
    if version == 1:
        raise _fail(
            path,
            "has format version 1 (written before checkpoints carried checksums); this offload "
            f"reads version {VERSION}: load it with the offload that wrote it and save it again",
        )
    if version not in READS:
        raise _fail(
            path,
            f"has format version {short_repr(version)}; this offload reads {READS[0]}-{VERSION}",
        )
    sealed = meta.get("meta_sha256")
    if not isinstance(sealed, str) or not _HEX64.fullmatch(sealed):
        raise _fail(path, f"has no valid 'meta_sha256' (got {short_repr(sealed)})")
    actual = hashlib.sha256(_canonical(meta)).hexdigest()
    if actual != sealed:
        raise _fail(
            path,
            f"its contents hash to {actual[:16]}..., its 'meta_sha256' says {sealed[:16]}... "
            "(meta.json was modified or is corrupt)",
        )
    files = meta.get("files")
    if not isinstance(files, dict):
        raise _fail(path, f"'files' must be an object of file records, got {short_repr(files)}")
    for name, rec in files.items():
        if not _FILE_NAME.fullmatch(name) or name in (META, LATEST):
            raise _fail(path, f"'files' lists {short_repr(name)}, which is not a data file name")
        keys = {"size", "sha256", "tensors"} | ({"blocks"} if version >= 3 else set())
        if not isinstance(rec, dict) or set(rec) != keys:
            raise _fail(path, f"'files'.'{name}' must have exactly {', '.join(sorted(keys))}")
        if not _is_int(rec["size"]) or not 0 <= rec["size"] <= MAX_INT:
            raise _fail(path, f"'files'.'{name}'.size is {short_repr(rec['size'])}")
        if not isinstance(rec["sha256"], str) or not _HEX64.fullmatch(rec["sha256"]):
            raise _fail(path, f"'files'.'{name}'.sha256 is {short_repr(rec['sha256'])}")
        if not isinstance(rec["tensors"], dict):
            raise _fail(path, f"'files'.'{name}'.tensors is {short_repr(rec['tensors'])}")
        if "blocks" in rec:
            _check_blocks(path, name, rec)
        for tname, trec in rec["tensors"].items():
            _check_tensor_record(ckpt / name, tname, trec)
    return meta


def _check_blocks(path: Path, name: str, rec: dict) -> None:
    blocks = rec["blocks"]
    ok = isinstance(blocks, dict) and set(blocks) == {"size", "sha256"}
    ok = ok and _is_int(blocks["size"]) and 0 < blocks["size"] <= MAX_INT
    ok = ok and isinstance(blocks["sha256"], list)
    ok = ok and len(blocks["sha256"]) == -(-rec["size"] // blocks["size"])
    ok = ok and all(isinstance(h, str) and _HEX64.fullmatch(h) for h in blocks["sha256"])
    if not ok:
        raise _fail(path, f"'files'.'{name}'.blocks is malformed (one SHA-256 per block)")


def _parse_header(path: Path, fd: int, size: int) -> tuple[dict[str, TensorInfo], int]:
    """Reads and checks a safetensors header; returns its tensors and the header's length."""
    if size < 8:
        raise _fail(path, f"is {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n < 2 or n > min(size - 8, MAX_HEADER):
        raise _fail(path, f"corrupt safetensors header: length {n} does not fit the file")
    raw = os.pread(fd, n, 8)
    if len(raw) != n:
        raise _fail(path, "corrupt safetensors header: the file ended inside it")
    header = _parse_json(path, raw, "the safetensors header")
    if not isinstance(header, dict):
        raise _fail(path, "corrupt safetensors header: not a JSON object")
    data0, spans = 8 + n, []
    tensors: dict[str, TensorInfo] = {}
    for name, rec in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(rec, dict) and set(rec) == {"dtype", "shape", "data_offsets"}
        ok = ok and _is_code(rec["dtype"]) and isinstance(rec["shape"], list)
        ok = ok and all(_is_int(d) and 0 <= d <= MAX_INT for d in rec["shape"])
        offs = rec.get("data_offsets") if ok else None
        ok = ok and isinstance(offs, list) and len(offs) == 2 and all(map(_is_int, offs))
        if not ok:
            raise _fail(path, f"corrupt safetensors header: entry {short_repr(name)} is malformed")
        dtype, shape = DTYPES[rec["dtype"]], tuple(rec["shape"])
        numel = math.prod(shape)
        begin, end = offs
        if not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
            raise _fail(
                path,
                f"corrupt safetensors header: tensor '{name}' spans bytes {offs}, but its "
                f"dtype and shape need {numel * dtype.itemsize}",
            )
        spans.append((begin, end, name))
        tensors[name] = TensorInfo(dtype, shape, data0 + begin, numel)
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise _fail(path, f"corrupt safetensors header: tensor '{name}' starts at {begin}")
        at = end
    if data0 + at != size:
        raise _fail(
            path,
            f"corrupt safetensors header: its tensors end at byte {data0 + at}, the file has "
            f"{size} bytes",
        )
    return tensors, n


def _sha256_of(fd: int, size: int, begin: int = 0, stop: threading.Event | None = None) -> str:
    """The SHA-256 of bytes ``[begin, size)`` of the file (``stop``, once set: given up
    between two chunks, ``"<stopped>"``).

    The buffer is an anonymous mapping, unmapped when it returns: the verifying threads'
    ``bytearray`` of ``CHUNK`` came from each thread's own malloc arena, whose top glibc does
    not give back (neither ``free`` under its trim threshold, up to 64 MiB, nor
    ``malloc_trim``): every load kept 8 MiB per thread resident for good (16 MiB on two cores,
    up to 64 MiB with the 8 threads, over the host budget of a resumed run)."""
    digest = hashlib.sha256()
    at = begin
    with mmap.mmap(-1, min(CHUNK, max(size - begin, 1))) as buf, memoryview(buf) as view:
        while at < size:
            if stop is not None and stop.is_set():
                return "<stopped>"
            got = os.preadv(fd, [view[: min(CHUNK, size - at)]], at)
            if got == 0:
                break
            digest.update(view[:got])
            at += got
    return digest.hexdigest() if at == size else f"<file ended at byte {at}>"


def _blocks_of(ranges: list[tuple[int, int]], block: int, size: int) -> list[int]:
    """Indices of the blocks that cover byte ranges ``ranges`` of a ``size``-byte file."""
    out: set[int] = set()
    for lo, hi in ranges:
        lo, hi = max(0, lo), min(size, hi)
        if hi > lo:
            out.update(range(lo // block, (hi - 1) // block + 1))
    return sorted(out)


class VerifiedCheckpoint:
    """A checkpoint directory that passed every check of Note: verification before use, with
    its files held open. Read tensor slices with :meth:`read`; close it when done."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path, self.meta = path, meta
        self._fds: dict[str, int] = {}
        self._tensors: dict[str, dict[str, TensorInfo]] = {}
        self._data_begin: dict[str, int] = {}
        self._scratch = torch.empty(0, dtype=torch.uint8)  # see read()

    def __enter__(self) -> VerifiedCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def file_path(self, name: str) -> Path:
        return self.path / name

    def tensors(self, name: str) -> dict[str, TensorInfo]:
        """The tensors of data file ``name`` (as its verified header has them)."""
        return self._tensors[name]

    def data_begin(self, name: str) -> int:
        """Where the data of file ``name`` begins (the header's 8-byte length and JSON before)."""
        return self._data_begin[name]

    def read(self, name: str, tensor: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened ``tensor`` of file ``name``, in a buffer that
        is BORROWED: it is valid until the next ``read`` from this checkpoint (the buffer is
        reused, so a load's reads cost no page faults; copy it to keep it)."""
        info = self._tensors[name][tensor]
        if not 0 <= lo <= hi <= info.numel:
            raise IndexError(f"{name}:{tensor}: [{lo}, {hi}) outside [0, {info.numel})")
        n = (hi - lo) * info.dtype.itemsize
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.uint8)
        out = self._scratch[:n]
        view = memoryview(out.numpy())
        at, pos = 0, info.begin + lo * info.dtype.itemsize
        while at < n:
            got = os.preadv(self._fds[name], [view[at:]], pos + at)
            if got == 0:
                raise _fail(self.path / name, "ended early (was it changed after verification?)")
            at += got
        return out.view(info.dtype)

    def _open(self, name: str, rec: dict) -> int:
        """Opens and checks one file up to (not including) its checksum; returns its size."""
        path = self.path / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise _fail(path, "is missing (meta.json lists it)") from None
        except OSError as exc:
            raise _fail(path, f"cannot be opened ({exc.strerror or exc})") from None
        self._fds[name] = fd
        size = os.fstat(fd).st_size
        if size != rec["size"]:
            raise _fail(
                path,
                f"is {size} bytes, meta.json records {rec['size']} (truncated or replaced)",
            )
        tensors, n = _parse_header(path, fd, size)
        self._data_begin[name] = 8 + n
        have = {t: {"dtype": _code(i.dtype), "shape": list(i.shape)} for t, i in tensors.items()}
        if have != rec["tensors"]:
            raise _fail(
                path,
                f"its header holds {_describe(have)}, meta.json records "
                f"{_describe(rec['tensors'])}",
            )
        self._tensors[name] = tensors
        return size


def _code(dtype: torch.dtype) -> str:
    return ST_DTYPES[dtype]


def _describe(tensors: dict) -> str:
    return ", ".join(f"{n} {r['dtype']}{r['shape']}" for n, r in tensors.items()) or "nothing"


def read_meta(ckpt: Path) -> dict:
    """``ckpt``'s ``meta.json``, parsed, sealed and checked against the schema (nothing else
    of the directory is read)."""
    return _read_meta(ckpt)


NeedRanges = Callable[[str, dict[str, "TensorInfo"]], list[tuple[int, int]]]


def open_checkpoint(
    ckpt: Path, threads: int | None = None, need: dict[str, NeedRanges] | None = None
) -> VerifiedCheckpoint:
    """Verifies the checkpoint directory ``ckpt`` (Note: verification before use) and returns
    it open; raises :class:`CheckpointError` naming the file and what is wrong. ``need``: only
    these files, and of each only the byte ranges its function gives (from the file's verified
    header); None: every file, whole."""
    meta = _read_meta(ckpt)
    files: dict = meta["files"]
    try:
        present = set(os.listdir(ckpt))
    except OSError as exc:
        raise _fail(ckpt, f"cannot be listed ({exc.strerror or exc})") from None
    extra = sorted(present - set(files) - {META})
    if extra:
        raise _fail(ckpt / extra[0], "is not listed in meta.json (an extra file)")
    wanted = sorted(files) if need is None else sorted(need)
    for name in wanted:
        if name not in files:
            raise meta_error(ckpt, f"does not list '{name}', which this load needs")
    out = VerifiedCheckpoint(ckpt, meta)
    try:
        sizes = {name: out._open(name, files[name]) for name in wanted}
        jobs = []  # (name, begin, end, recorded digest)
        for name in wanted:
            rec, size = files[name], sizes[name]
            blocks = _blocks_of(
                [(0, out.data_begin(name))] + (need[name](name, out.tensors(name)) if need else []),
                rec["blocks"]["size"] if "blocks" in rec else size or 1,
                size,
            )
            whole = "blocks" not in rec or len(blocks) == len(rec["blocks"]["sha256"])
            if need is None or whole:
                jobs.append((name, 0, size, rec["sha256"]))
                continue
            bsize = rec["blocks"]["size"]
            for b in blocks:
                jobs.append(
                    (name, b * bsize, min(size, (b + 1) * bsize), rec["blocks"]["sha256"][b])
                )
        jobs.sort(key=lambda j: j[1] - j[2])  # largest first
        workers = max(1, min(threads or os.cpu_count() or 1, 8, len(jobs) or 1))
        digests = map_in_threads(
            lambda j, stop: _sha256_of(out._fds[j[0]], j[2], j[1], stop),
            jobs,
            workers,
            "offload-ckpt-verify",
        )
        for (name, begin, end, want), got in sorted(zip(jobs, digests), key=lambda x: x[0][:2]):
            if got != want:
                where = "" if (begin, end) == (0, sizes[name]) else f" of bytes [{begin}, {end})"
                raise _fail(
                    ckpt / name,
                    f"its SHA-256{where} is {got[:16]}..., meta.json records {want[:16]}...: "
                    "the file is corrupt or not the one saved",
                )
    except BaseException:
        out.close()
        raise
    return out


# ------------------------------------------------------------------------ the caller's keys
def meta_error(ckpt: Path, what: str) -> CheckpointError:
    """An error about ``ckpt``'s meta.json."""
    return _fail(ckpt / META, what)


def meta_int(ckpt: Path, value, key: str) -> int:
    if not _is_int(value) or not 0 <= value <= MAX_INT:
        raise meta_error(ckpt, f"{key} must be an integer in [0, 2**63), got {short_repr(value)}")
    return value


def meta_number(ckpt: Path, value, key: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        ok = ok and math.isfinite(float(value))
    except OverflowError:
        ok = False
    if not ok:
        raise meta_error(ckpt, f"{key} must be a finite number, got {short_repr(value)}")
    return value


_TAG = "__offload_extra__"  # marks a container plain JSON has no form for
_TAGGED = {"tuple": tuple, "dict": dict, "Counter": Counter}


def encode_extra(value):
    """The caller's extra values as JSON that :func:`decode_extra` turns back into them: a
    tuple, a dict with a key that is not a string (MultiStepLR's milestones: a Counter of int
    steps) and a Counter are written as ``{TAG: kind, "items": [...]}``, which plain JSON
    would turn into a list and a dict of string keys. Anything else JSON cannot hold is a
    ``TypeError`` from ``json.dumps``."""
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [encode_extra(v) for v in value]}
    if isinstance(value, list):
        return [encode_extra(v) for v in value]
    if isinstance(value, dict):
        kind = "Counter" if isinstance(value, Counter) else "dict"
        if kind == "dict" and _TAG not in value and all(isinstance(k, str) for k in value):
            return {k: encode_extra(v) for k, v in value.items()}
        return {_TAG: kind, "items": [[encode_extra(k), encode_extra(v)] for k, v in value.items()]}
    return value


def decode_extra(ckpt: Path, value):
    """The values :func:`encode_extra` wrote (a checkpoint written before it: the same)."""
    if isinstance(value, list):
        return [decode_extra(ckpt, v) for v in value]
    if not isinstance(value, dict):
        return value
    if _TAG not in value:
        return {k: decode_extra(ckpt, v) for k, v in value.items()}
    kind, items = value.get(_TAG), value.get("items")
    ok = kind in _TAGGED and set(value) == {_TAG, "items"} and isinstance(items, list)
    if ok and kind == "tuple":
        return tuple(decode_extra(ckpt, v) for v in items)
    ok = ok and all(isinstance(kv, list) and len(kv) == 2 for kv in items)
    try:
        if ok:
            pairs = dict((decode_extra(ckpt, k), decode_extra(ckpt, v)) for k, v in items)
            return _TAGGED[kind](pairs)
    except TypeError:  # an unhashable key
        pass
    raise meta_error(ckpt, f"'extra' holds a malformed {_TAG} value: {short_repr(value)}")


def check_layout(ckpt: VerifiedCheckpoint, units: list[dict], tensors: dict[str, dict]) -> None:
    """The saved ``units`` records are ``units`` (the model's, in order), parameter by
    parameter, and each data file holds exactly ``tensors[file]``: name -> (allowed dtype
    codes, shape). A unit record is ``{"name", "trainable", "total", "params": [[name, offset,
    numel, shape, trainable], ...]}``."""
    path = ckpt.path
    saved_units = ckpt.meta.get("units")
    if not isinstance(saved_units, list):
        raise meta_error(path, f"'units' must be a list, got {short_repr(saved_units)}")
    if len(saved_units) != len(units):
        raise meta_error(
            path,
            f"the checkpoint has {len(saved_units)} units, the model has {len(units)}; "
            "wrap the same model with the same wrap config",
        )
    for i, (mine, saved) in enumerate(zip(units, saved_units)):
        if saved != mine:
            _unit_difference(path, i, mine, saved, saved_units)
    listed = ckpt.meta["files"]
    for name in sorted(set(listed) | set(tensors)):
        if name not in tensors:
            raise meta_error(path, f"lists '{name}', which is not a data file of this model")
        if name not in listed:
            raise meta_error(path, f"does not list '{name}', which this model needs")
        have = {t: (ST_DTYPES[i.dtype], list(i.shape)) for t, i in ckpt.tensors(name).items()}
        want = tensors[name]
        if set(have) != set(want) or any(
            have[t][1] != want[t][1] or have[t][0] not in want[t][0] for t in want
        ):
            held = {t: {"dtype": d, "shape": s} for t, (d, s) in have.items()}
            needed = {t: {"dtype": "|".join(d), "shape": s} for t, (d, s) in want.items()}
            raise _fail(
                path / name, f"holds {_describe(held)}; the model needs {_describe(needed)}"
            )


def _unit_difference(path: Path, index: int, mine: dict, saved, saved_units: list) -> None:
    """Raises the error that says how the saved unit record differs from the model's (a
    parameter the checkpoint holds in another unit: the units were cut otherwise)."""
    label = f"unit {index} ('{mine['name'] or '<root>'}')"
    if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
        raise meta_error(path, f"the record of {label} is malformed")
    if saved.get("name") != mine["name"]:
        raise meta_error(path, f"{label} is {short_repr(saved.get('name'))} in the checkpoint")
    theirs = {}
    for rec in saved["params"]:
        if not (isinstance(rec, list) and len(rec) == 5 and isinstance(rec[0], str)):
            raise meta_error(path, f"a parameter record of {label} is malformed")
        theirs[rec[0]] = rec
    state = {True: "trainable", False: "frozen"}
    for name, _offset, _numel, shape, trainable in mine["params"]:
        rec = theirs.get(name)
        if rec is None:
            elsewhere = next(
                (
                    j
                    for j, u in enumerate(saved_units)
                    if isinstance(u, dict)
                    and isinstance(u.get("params"), list)
                    and any(isinstance(r, list) and r[:1] == [name] for r in u["params"])
                ),
                None,
            )
            if elsewhere is not None:
                raise meta_error(
                    path,
                    f"parameter '{name}' is in {label} in the model and in unit {elsewhere} in "
                    "the checkpoint: the units are cut otherwise (wrap the model with the "
                    "wrap config it was saved with: wrap.module_classes, the unit sizes)",
                )
            raise meta_error(path, f"parameter '{name}' of {label} is not in the checkpoint")
        if rec[3] != shape:
            raise meta_error(
                path,
                f"parameter '{name}' has shape {short_repr(rec[3])} in the checkpoint and "
                f"{shape} in the model",
            )
        if rec[4] is not trainable:
            saved = state[rec[4]] if isinstance(rec[4], bool) else short_repr(rec[4])
            raise meta_error(
                path,
                f"parameter '{name}' is {saved} in the checkpoint and {state[trainable]} in the "
                "model",
            )
    extra = sorted(set(theirs) - {p[0] for p in mine["params"]})
    if extra:
        raise meta_error(path, f"parameter '{extra[0]}' of {label} is not in the model")
    raise meta_error(
        path, f"{label} lays out its parameters differently from the model (order or padding)"
    )


def _hyper(path: Path, where: str, key: str, saved, now):
    """A saved hyperparameter, checked against the kind of value the group holds now (any
    JSON scalar, or a list of numbers, for a key the group does not have)."""
    what = f"{where}.'{key}'"
    if isinstance(now, torch.Tensor) and now.numel() == 1:  # a tensor lr: saved as its number
        now = now.item()
    if isinstance(saved, list):
        if now is not None and not (isinstance(now, (tuple, list)) and len(now) == len(saved)):
            raise meta_error(path, f"{what} is {short_repr(saved)}, not like {now!r}")
        return tuple(meta_number(path, x, what) for x in saved)
    number = isinstance(saved, (int, float)) and not isinstance(saved, bool)
    now_number = isinstance(now, (int, float)) and not isinstance(now, bool)
    same = (number and now_number) or (number == now_number and type(saved) is type(now))
    if isinstance(saved, dict) or (now is not None and not same):
        raise meta_error(path, f"{what} is {short_repr(saved)}, not like {now!r}")
    return meta_number(path, saved, what) if number else saved


def check_counters(ckpt: VerifiedCheckpoint, groups: list[dict], loss_scale: bool) -> dict:
    """The saved counters, hyperparameters (checked against ``groups``, the optimizer's current
    param groups: as many), loss scale (when ``loss_scale``) and extra values, checked:
    ``{"step_count", "skipped_steps", "loss_scaler" (None or a state dict), "param_groups"
    (each group's, lists as tuples), "extra"}``. Which parameters each group holds is the
    caller's to check (it knows their names)."""
    meta, path = ckpt.meta, ckpt.path
    out = {
        "step_count": meta_int(path, meta.get("step_count"), "'step_count'"),
        "skipped_steps": meta_int(path, meta.get("skipped_steps"), "'skipped_steps'"),
        "loss_scaler": None,
    }
    saved = meta.get("loss_scaler")
    if loss_scale and saved is not None:
        if not isinstance(saved, dict):
            raise meta_error(path, f"'loss_scaler' is {short_repr(saved)}")
        scale = meta_number(path, saved.get("scale"), "'loss_scaler'.'scale'")
        good = meta_int(path, saved.get("good_steps"), "'loss_scaler'.'good_steps'")
        if scale <= 0:
            raise meta_error(path, f"'loss_scaler'.'scale' must be > 0, got {scale}")
        out["loss_scaler"] = {"scale": scale, "good_steps": good}
    hyper = meta.get("param_group")
    if not isinstance(hyper, dict) or "params" in hyper:
        raise meta_error(path, f"'param_group' is {short_repr(hyper)}")
    several = meta.get("param_groups")
    if several is None:
        saved_groups, where = [hyper], ["'param_group'"]
    elif not isinstance(several, list) or not all(isinstance(g, dict) for g in several):
        raise meta_error(path, f"'param_groups' is {short_repr(several)}")
    else:
        saved_groups = [{k: v for k, v in g.items() if k != "params"} for g in several]
        where = [f"'param_groups'[{i}]" for i in range(len(several))]
    if len(saved_groups) != len(groups):
        raise meta_error(
            path,
            f"it holds {len(saved_groups)} param group(s), this optimizer {len(groups)} (wrap's "
            "param_groups): load it into an optimizer wrapped with the same param_groups",
        )
    out["param_groups"] = [
        {k: _hyper(path, w, k, v, g.get(k)) for k, v in h.items()}
        for h, g, w in zip(saved_groups, groups, where, strict=True)
    ]
    if not isinstance(meta.get("extra"), dict):
        raise meta_error(path, f"'extra' is {short_repr(meta.get('extra'))}")
    out["extra"] = decode_extra(path, meta["extra"])
    return out
