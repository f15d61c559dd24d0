"""Real local text for the demo: the Python standard library's own ``.py`` sources.

Note: why the standard library
    Every machine that runs this already has a few tens of megabytes of real, varied text in
    its Python installation, so the demo needs no download and no tokenizer (the model reads
    bytes). The files are found at run time (``sysconfig``'s ``stdlib`` path, else the
    directory of ``os.__file__``), walked in sorted order and concatenated, so the corpus is
    the same on every run of the same Python. Third-party packages (``site-packages``,
    ``dist-packages``), ``__pycache__`` and ``encodings`` (generated charmap tables whose
    rows of hex codes make the loss jump whenever a batch lands in them) are skipped. The last
    ``val_fraction`` of the bytes (whole files at the end of the walk, mostly) is the
    validation split.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 8_000_000  # corpus cap: plenty for a few minutes of training, reads in < 1 s
# third-party code, bytecode, and the generated codec tables (hex charmaps, not prose or code)
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "encodings"}
FILE_SEPARATOR = b"\n\n"


def stdlib_dir() -> Path:
    """Where this Python's standard library lives."""
    path = sysconfig.get_paths().get("stdlib")
    if path and Path(path, "os.py").is_file():
        return Path(path)
    return Path(os.__file__).resolve().parent


def stdlib_source_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """All ``.py`` files under ``root`` (default: :func:`stdlib_dir`), in a deterministic order."""
    base = Path(root) if root is not None else stdlib_dir()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found.extend(Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return found


def load_corpus(
    max_bytes: int = DEFAULT_MAX_BYTES, root: str | os.PathLike[str] | None = None
) -> bytes:
    """The first ``max_bytes`` of the concatenated sources (files joined by a blank line)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes!r}")
    parts: list[bytes] = []
    total = 0
    files = stdlib_source_files(root)
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:  # unreadable file in an odd installation: skip it, stay deterministic
            continue
        parts.append(data + FILE_SEPARATOR)
        total += len(data) + len(FILE_SEPARATOR)
        if total >= max_bytes:
            break
    corpus = b"".join(parts)[:max_bytes]
    if not corpus:
        where = root if root is not None else stdlib_dir()
        raise FileNotFoundError(f"no .py source files found under {os.fspath(where)!r}")
    return corpus


@dataclass(slots=True)
class ByteCorpus:
    """Train and validation byte tensors (uint8) cut from one corpus."""

    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def from_bytes(cls, data: bytes, val_fraction: float = 0.1) -> ByteCorpus:
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        cut = int(len(tensor) * (1.0 - val_fraction))
        return cls(train=tensor[:cut].clone(), val=tensor[cut:].clone())

    @classmethod
    def from_stdlib(
        cls, max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.1
    ) -> ByteCorpus:
        return cls.from_bytes(load_corpus(max_bytes), val_fraction)


def get_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs ``[batch_size, seq_len]`` int64 and the next-byte targets."""
    if len(data) < seq_len + 1:
        raise ValueError(f"split has {len(data)} bytes, fewer than seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    windows = data[starts[:, None] + offsets].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def batches(
    data: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless, seeded stream of batches (same seed -> same batches)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield get_batch(data, batch_size, seq_len, gen)
