"""The safetensors file format, read by element ranges and written as a stream.

A file is an 8-byte little-endian header length, a JSON header (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}}`` with offsets relative to the end of the header, and an optional
``"__metadata__"`` of strings), then the tensors' raw bytes.

Note: why not safetensors' own reader
    ``safetensors.safe_open`` maps the whole file, and every page a read touches stays resident
    in this process (file-backed pages count in its RSS) until the file is closed: streaming a
    model's shards through it would show the whole shard in RSS. :class:`SafetensorsFile` reads
    the elements asked for with ``pread`` into a new host tensor instead; the pages go through
    the page cache, which the kernel reclaims, and RSS holds only what the caller keeps.

Note: writing
    :func:`write_file` computes the header from the shapes and dtypes given, then appends each
    tensor's bytes as its producer yields them (any number of chunks), so a tensor larger than
    RAM can be written. The file is written under a temporary name, fsynced and renamed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # bytes; safetensors' own limit


class SafetensorsError(ValueError):
    """A file that is not valid safetensors (the message names the file and what is wrong)."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor's bytes are in its file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class SafetensorsFile:
    """One safetensors file: its header, and reads of element ranges of its tensors."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd: int | None = None
        self.tensors, self.metadata = self._parse()

    def _parse(self) -> tuple[dict[str, TensorInfo], dict]:
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise self._error(f"{size} bytes, shorter than the 8-byte header length")
                (n,) = struct.unpack("<Q", head)
                if n > min(_MAX_HEADER, size - 8):
                    raise self._error(f"header length {n} exceeds the file ({size} bytes)")
                raw = f.read(n)
        except OSError as exc:
            raise SafetensorsError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._error(f"header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._error("header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        base = 8 + n
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            try:
                dtype = DTYPES[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise self._error(f"tensor '{name}' has a malformed entry {entry!r}") from None
            info = TensorInfo(name, dtype, shape, base + begin, base + end)
            if min(shape, default=0) < 0 or end - begin != info.numel * dtype.itemsize:
                raise self._error(
                    f"tensor '{name}': {end - begin} bytes for shape {list(shape)} of "
                    f"{entry['dtype']}"
                )
            if begin < 0 or base + end > size:
                raise self._error(f"tensor '{name}' lies outside the file ({size} bytes)")
            tensors[name] = info
        return tensors, metadata

    def _error(self, what: str) -> SafetensorsError:
        return SafetensorsError(f"{self.path}: not a valid safetensors file: {what}")

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of tensor ``name`` (flattened), as a new 1-D host tensor in
        the file's dtype."""
        info = self.tensors[name]
        size = info.dtype.itemsize
        out = torch.empty((hi - lo) * size, dtype=torch.uint8)
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        view = memoryview(out.numpy())
        offset, done = info.begin + lo * size, 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise SafetensorsError(f"{self.path}: tensor '{name}' is cut short")
            done += got
        return out.view(info.dtype)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


Produce = Callable[[], Iterable[torch.Tensor]]
"""Yields a tensor's values in order, in chunks of any size (converted to the entry's dtype)."""


def fsync_dir(path: Path) -> None:
    """Makes a rename or a new file in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Entry = tuple[str, torch.dtype, list[int], Produce]


def write_stream(
    f: BinaryIO,
    entries: list[Entry],
    metadata: dict[str, str] | None = None,
    *,
    sink: Callable[[memoryview | bytes], None] | None = None,
    names: dict[torch.dtype, str] = NAMES,
    what: str = "safetensors",
) -> dict:
    """Writes ``entries`` (name, dtype, shape, producer) as a safetensors stream into the open
    binary file ``f`` (see the module Note); every byte written also goes to ``sink`` (a
    checksum, say). ``names``: the dtypes allowed and their codes. Returns the header."""
    header: dict = {}
    offset = 0
    for name, dtype, shape, _ in entries:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {
            "dtype": names[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    for head in (struct.pack("<Q", len(raw)), raw):
        f.write(head)
        if sink is not None:
            sink(head)
    for name, dtype, _shape, produce in entries:
        written = 0
        for chunk in produce():
            chunk = chunk.detach().to("cpu", dtype).contiguous().reshape(-1)
            data = memoryview(chunk.view(torch.uint8).numpy())
            f.write(data)
            if sink is not None:
                sink(data)
            written += len(data)
            # before the producer reads its next chunk: one chunk in memory, not two
            del chunk, data
        begin, end = header[name]["data_offsets"]
        if written != end - begin:
            raise RuntimeError(
                f"{what}: tensor '{name}' produced {written} bytes, expected {end - begin}"
            )
    return header


@contextlib.contextmanager
def naming_write_errors(path: str | os.PathLike, what: str):
    """An OSError of a write to ``path`` names it (a full disk said only "[Errno 28] No space
    left on device", with no file: a checkpoint's, an export's or a shard's)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        hint = "; free space there or save elsewhere" if exc.errno == errno.ENOSPC else ""
        raise type(exc)(exc.errno, f"{exc.strerror} (writing {what}{hint})", str(path)) from exc


def write_file(
    path: str | os.PathLike, entries: list[Entry], metadata: dict[str, str] | None = None
) -> Path:
    """Writes ``entries`` (name, dtype, shape, producer) as one safetensors file, streaming
    (see the module Note); returns its path."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with naming_write_errors(path, "a safetensors file"), open(tmp, "wb") as f:
            write_stream(f, entries, metadata, what=str(path))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path
