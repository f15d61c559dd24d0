"""Shared by beyond_ram.py and gpu_7b.py: Llama-shaped models with random weights that never
exist whole in RAM, and a peak-RSS sampler."""

from __future__ import annotations

import hashlib
import math
import threading
import time

import psutil
import torch

from offload.runtime.weights import LazyTensor

BLOCK = 1 << 20  # elements generated per seeded block


class RandomTensor(LazyTensor):
    """A tensor of N(0, std) values (or a constant) produced on demand: element ``i`` comes from
    block ``i // BLOCK``, seeded by (seed, name, block), so any slicing gives the same values."""

    def __init__(self, name: str, shape, dtype: torch.dtype, seed: int, std: float | None) -> None:
        self.shape, self.dtype, self.std = torch.Size(shape), dtype, std
        digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=6).digest()
        self._seed = int.from_bytes(digest, "little")

    def read(self, lo: int, hi: int) -> torch.Tensor:
        if self.std is None:
            return torch.ones(hi - lo, dtype=self.dtype)
        out = torch.empty(hi - lo, dtype=self.dtype)
        gen = torch.Generator()
        for block in range(lo // BLOCK, (hi - 1) // BLOCK + 1 if hi > lo else lo // BLOCK):
            b0 = block * BLOCK
            b1 = min(b0 + BLOCK, math.prod(self.shape))
            gen.manual_seed(self._seed + block)
            values = torch.randn(b1 - b0, generator=gen).mul_(self.std)
            a, b = max(lo, b0), min(hi, b1)
            out[a - lo : b - lo].copy_(values[a - b0 : b - b0])
        return out

    def chunks(self, size: int = 16 * BLOCK):
        n = math.prod(self.shape)
        for lo in range(0, n, size):
            yield self.read(lo, min(n, lo + size))


def llama_config(
    *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
    tie: bool = False, seq_len: int = 4096,
):  # fmt: skip
    from transformers import LlamaConfig  # noqa: PLC0415

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=tie,
    )


def meta_model(config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def random_weights(model, dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> dict:
    """``{state_dict name: RandomTensor}`` for every parameter and persistent buffer (norm
    weights are ones; tied parameters appear once, under their first name)."""
    seen, out = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        is_norm = name.endswith("norm.weight")
        out[name] = RandomTensor(name, t.shape, dtype, seed, None if is_norm else std)
    return out


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


class PeakRss:
    """Samples this process's RSS every few ms between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def rss(self) -> int:
        return self.proc.memory_info().rss

    def start(self) -> PeakRss:
        self.peak = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.005)

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.rss())
        return self.peak
