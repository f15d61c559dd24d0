"""The demo's GPT: a plain decoder-only transformer over bytes (vocabulary 256, no tokenizer).

Note: why this shape
    Each transformer block is one ``Block`` module, so the engine's default wrap policy (repeated
    classes whose names end in "Block") makes every block one offload unit without any
    configuration. Everything else (token and position embeddings, final norm, head) is the
    root unit. The model is ordinary PyTorch: nothing in it knows about offloading.

Note: sizing
    ``--size 50M`` picks the width (a multiple of 64, heads of 64 channels) and depth whose
    parameter count is within 5 % of the target and whose width/depth ratio is closest to 64
    (GPT-2 small has 768/12). A block has 12 d^2 + 13 d parameters (q/k/v/o with biases,
    MLP d -> 4d -> d with biases, two LayerNorms); embeddings add (256 + seq_len) d, the untied
    head 256 d and the final norm 2 d. ``--size tiny`` is a fixed 2-layer, 64-wide model for
    tests (about 0.14 M parameters).

Note: initialisation
    GPT-2's N(0, 0.02) for every weight, except the embeddings: with a 0.02 residual stream, the
    first sign-like Adam steps (every weight moves by about the learning rate) make the blocks'
    outputs dwarf the embeddings, and the 50M model's loss jumped from 4.4 to 8.6 at step 3 even
    with warm-up. Token embeddings drawn from N(0, 1) (PyTorch's own default) and positions from
    N(0, 0.3) keep the stream wide from the start; the loss then falls 5.6 -> 2.8 in 7 steps
    without the jump. With tied embeddings the table is also the output head, so it keeps 0.02
    (large logits at step 0 otherwise).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 256


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """Shape of the demo GPT."""

    d_model: int  # width (channels)
    n_layer: int  # transformer blocks
    n_head: int  # attention heads (d_model must be a multiple)
    seq_len: int = 256  # longest sequence (learned position embeddings), tokens
    vocab_size: int = VOCAB_SIZE  # bytes
    mlp_ratio: int = 4  # MLP hidden width / d_model
    tie_embeddings: bool = False  # output head shares the token embedding matrix

    def __post_init__(self) -> None:
        for key in ("d_model", "n_layer", "n_head", "seq_len", "vocab_size", "mlp_ratio"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{key} must be an integer >= 1, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})"
            )


def block_params(d: int, mlp_ratio: int = 4) -> int:
    """Parameters of one :class:`Block` of width ``d``."""
    hidden = mlp_ratio * d
    attn = 3 * d * d + 3 * d + d * d + d
    mlp = d * hidden + hidden + hidden * d + d
    return attn + mlp + 4 * d


def param_count(cfg: GPTConfig) -> int:
    """Exact parameter count of ``GPT(cfg)`` (shared weights counted once)."""
    d = cfg.d_model
    emb = cfg.vocab_size * d + cfg.seq_len * d + 2 * d
    if not cfg.tie_embeddings:
        emb += cfg.vocab_size * d
    return cfg.n_layer * block_params(d, cfg.mlp_ratio) + emb


def largest_unit_params(cfg: GPTConfig) -> int:
    """Parameters of the largest offload unit of ``GPT(cfg)``: one :class:`Block`, or the root
    unit (embeddings, final norm, head) when that is larger (see the Note on why this shape)."""
    block = block_params(cfg.d_model, cfg.mlp_ratio)
    return max(block, param_count(cfg) - cfg.n_layer * block)


def parse_size(size: str | int) -> int:
    """``"50M"`` -> 50_000_000; also ``"1.5M"``, ``"800K"``, ``"1B"`` or a plain integer."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = float(size)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbB]?)\s*", str(size))
        if m is None:
            raise ValueError(
                f"--size: expected 'tiny' or a parameter count such as 5M, 50M, 125M or 1B, "
                f"got {size!r}"
            )
        value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}[m.group(2).lower()]
    if not math.isfinite(value) or value < 1e5:
        raise ValueError(f"--size: must be at least 100K parameters (or 'tiny'), got {size!r}")
    return int(value)


def config_for_size(
    size: str | int, *, seq_len: int | None = None, tie_embeddings: bool = False
) -> GPTConfig:
    """The shape for ``--size`` (see the module Note); ``"tiny"`` is the test model."""
    if isinstance(size, str) and size.strip().lower() == "tiny":
        return GPTConfig(
            d_model=64, n_layer=2, n_head=2, seq_len=seq_len or 64, tie_embeddings=tie_embeddings
        )
    target = parse_size(size)
    seq = seq_len or 256
    best: tuple[float, GPTConfig] | None = None
    fallback: tuple[float, GPTConfig] | None = None
    for d in range(64, 8192 + 1, 64):
        for n_layer in range(1, 97):
            cfg = GPTConfig(
                d_model=d,
                n_layer=n_layer,
                n_head=max(1, d // 64),
                seq_len=seq,
                tie_embeddings=tie_embeddings,
            )
            err = abs(math.log(param_count(cfg) / target))
            aspect = abs(math.log((d / n_layer) / 64))
            if fallback is None or err < fallback[0]:
                fallback = (err, cfg)
            if err <= math.log(1.05) and (best is None or aspect < best[0]):
                best = (aspect, cfg)
    assert fallback is not None
    return (best or fallback)[1]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (fused qkv projection, PyTorch's SDPA kernel)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """d -> mlp_ratio * d -> d with GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """One pre-norm transformer block: the unit of offload."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level GPT: ``forward(idx[B, T] int64) -> logits[B, T, 256]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        if not cfg.tie_embeddings:
            # See the Note on initialisation: a wide residual stream next to the blocks' outputs.
            nn.init.normal_(self.tok_emb.weight, mean=0.0, std=1.0)
            nn.init.normal_(self.pos_emb.weight, mean=0.0, std=0.3)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance
        # independent of depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in fp32 (nats; ln 256 = 5.55 for a uniform guess)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def describe(cfg: GPTConfig) -> str:
    """One line: size and shape."""
    return (
        f"GPT {param_count(cfg) / 1e6:.1f} M params ({cfg.n_layer} blocks x {cfg.d_model} wide, "
        f"{cfg.n_head} heads, seq {cfg.seq_len}, byte vocab"
        f"{', tied embeddings' if cfg.tie_embeddings else ''})"
    )
