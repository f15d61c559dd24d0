"""Tiny random Hugging Face models and a tokenizer built in the test (nothing is downloaded),
shared by the tests of weights=, from_pretrained / save_pretrained, Trainer and finetune."""

from __future__ import annotations

import os
from pathlib import Path

import torch

VOCAB = 96


def hf_config(arch: str = "llama", *, tie: bool = False, layers: int = 2):
    import transformers  # noqa: PLC0415

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[arch]
    return cls(**common)


def write_model(
    directory: Path, arch: str = "llama", *, tie: bool = False, seed: int = 0,
    dtype: torch.dtype = torch.float32, max_shard_size: str | None = None,
) -> Path:  # fmt: skip
    """A random model written with ``save_pretrained`` (sharded when ``max_shard_size``)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, tie=tie), dtype=dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return Path(directory)


WORDS = (
    "the a cat dog sat ran on under mat log fast slow big small red blue question answer is what "
    "why how yes no and or but then"
).split()


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over ``WORDS`` (ids below ``VOCAB``), saved the way
    ``AutoTokenizer.from_pretrained(directory)`` reads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(directory)


def nvme_config(tmp_path: Path, param_dev: str, opt_dev: str, dtype: str = "fp32", **over):
    """A config for the tiny models: small buffers so units stream in several pieces."""
    cfg = {
        "device": "cpu",
        "dtype": dtype,
        "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1},
        "offload_param": {
            "device": param_dev,
            "buffer_count": 4,
            "buffer_size": "16KiB",
            "persistence_threshold": 0,
        },
        "offload_optimizer": {"device": opt_dev, "buffer_count": 8, "buffer_size": "16KiB"},
    }
    for section, dev in (("offload_param", param_dev), ("offload_optimizer", opt_dev)):
        if dev == "nvme":
            path = tmp_path / f"swap_{section}"
            os.makedirs(path, exist_ok=True)
            cfg[section]["nvme_path"] = str(path)
    cfg.update(over)
    return cfg
