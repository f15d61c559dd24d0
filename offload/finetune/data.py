"""``offload finetune``'s data: a file read into packed sequences of token ids and labels.

Note: formats
    - JSONL with ``text``: each line's text is tokenized, followed by the end-of-sequence token;
      the loss covers every token.
    - JSONL with ``prompt`` and ``completion``: the two are tokenized one after the other
      (the completion's tokens, then end-of-sequence); the labels of the prompt's tokens are
      ``-100``, so the loss covers the completion only.
    - plain text (anything whose first non-empty line is not a JSON object): blank-line
      separated paragraphs are the documents. A file named ``.jsonl`` / ``.json``, or whose
      first line begins a record (``{``), must be JSONL: its first line's error is raised
      (also for a JSON array on one line).

    The format is that of the first non-empty line; every other line must have the same keys
    (an error names the file, the line and what it has).

Note: packing
    All documents are concatenated (in file order) and cut into sequences of exactly
    ``seq_len`` tokens; the tail shorter than one sequence is dropped (or, when the whole file
    is shorter than one sequence, padded with ``-100`` labels). The beginning-of-sequence token
    is not added (the end-of-sequence token separates documents), as in the usual packed
    fine-tuning recipes. The recipe trains on ``Packed.trained()``: a sequence inside a long
    prompt, with no token the loss covers, is left out (its loss would be 0/0, NaN).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

IGNORE = -100


@dataclass(frozen=True, slots=True)
class Packed:
    """``input_ids`` and ``labels`` of shape ``(sequences, seq_len)`` (int64)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    format: str
    documents: int

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def trained_tokens(self) -> int:
        """Tokens the loss covers (labels that are not ``-100``)."""
        return int((self.labels != IGNORE).sum())

    def trained(self) -> Packed:
        """The sequences with a token the loss covers past their first (the model predicts
        position ``i + 1`` from ``i``): one inside a long prompt has none, and a micro-batch of
        such sequences has the loss 0/0, NaN. What the recipe trains on."""
        keep = (self.labels[:, 1:] != IGNORE).any(dim=1)
        if bool(keep.all()):
            return self
        return Packed(self.input_ids[keep], self.labels[keep], self.format, self.documents)


def _documents(path: Path) -> tuple[str, list[tuple[str, str | None]]]:
    """``(format, [(text or prompt, completion or None), ...])``."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not the first line's
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--data: cannot read '{path}': {exc}") from None
    # JSONL's lines end at "\n" alone (read_text made "\r\n" and "\r" that); str.splitlines()
    # also ended them at U+2028, U+2029 and U+0085, which JSON allows raw inside a string: a
    # file written with ensure_ascii=False was refused as "not JSON"
    lines = text.split("\n")
    first = next((ln for ln in lines if ln.strip()), None)
    if first is None:
        raise ValueError(f"--data: '{path}' is empty")
    # a file meant as JSONL (its name, or a record begun) would be trained on as plain text,
    # its JSON syntax the data, without a word: its first line must be a JSON object
    meant = path.suffix in (".jsonl", ".json") or first.lstrip().startswith("{")
    try:
        head = json.loads(first)
    except json.JSONDecodeError as exc:
        if meant:
            raise ValueError(f"--data: '{path}' line 1 is not JSON ({exc})") from None
        head = None
    if meant and not isinstance(head, dict):
        raise ValueError(
            f"--data: '{path}' line 1 is a JSON {type(head).__name__}, not an object; allowed: "
            "JSONL, one object per line with 'text', or 'prompt' and 'completion'"
        )
    if not isinstance(head, dict):
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        return "text", [(p, None) for p in paragraphs]
    if "prompt" in head and "completion" in head:
        fmt, keys = "prompt/completion", ("prompt", "completion")
    elif "text" in head:
        fmt, keys = "jsonl text", ("text",)
    else:
        raise ValueError(
            f"--data: '{path}' line 1 has keys {sorted(head)}; allowed: 'text', or 'prompt' and "
            "'completion'"
        )
    docs = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--data: '{path}' line {lineno} is not JSON ({exc})") from None
        if not isinstance(rec, dict) or any(not isinstance(rec.get(k), str) for k in keys):
            raise ValueError(
                f"--data: '{path}' line {lineno}: expected string values for "
                f"{', '.join(repr(k) for k in keys)} (the format of line 1, {fmt})"
            )
        docs.append((rec[keys[0]], rec[keys[1]] if len(keys) > 1 else None))
    return fmt, docs


def load_data(path: str | os.PathLike, tokenizer, seq_len: int) -> Packed:
    """Reads, tokenizes and packs ``path`` (see the module Notes)."""
    if seq_len < 2:
        raise ValueError(f"--seq-len={seq_len}; allowed: >= 2")
    fmt, docs = _documents(Path(path))
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    labels: list[int] = []

    def encode(s: str) -> list[int]:
        return list(tokenizer(s, add_special_tokens=False)["input_ids"])

    for first, completion in docs:
        if completion is None:
            toks = encode(first) + eos
            ids += toks
            labels += toks
        else:
            prompt, answer = encode(first), encode(completion) + eos
            ids += prompt + answer
            labels += [IGNORE] * len(prompt) + answer
    if not ids:
        raise ValueError(f"--data: '{path}' has no tokens")
    n = len(ids) // seq_len
    if n == 0:  # shorter than one sequence: pad it
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ids[-1]
        ids += [pad] * (seq_len - len(ids))
        labels += [IGNORE] * (seq_len - len(labels))
        n = 1
    input_ids = torch.tensor(ids[: n * seq_len], dtype=torch.int64).view(n, seq_len)
    label_t = torch.tensor(labels[: n * seq_len], dtype=torch.int64).view(n, seq_len)
    return Packed(input_ids, label_t, fmt, len(docs))


class Order:
    """Which sequences each micro-batch takes: epoch ``e`` is a permutation drawn from
    ``(seed, e)``, so any step's batch is known without replaying the run (resume)."""

    def __init__(self, n: int, batch: int, seed: int) -> None:
        self.n, self.batch, self.seed = n, batch, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g)}
        return self._perms[epoch]

    def indices(self, micro: int) -> torch.Tensor:
        """Sequence indices of global micro-batch ``micro``."""
        out = []
        for i in range(micro * self.batch, (micro + 1) * self.batch):
            out.append(int(self._perm(i // self.n)[i % self.n]))
        return torch.tensor(out)
