"""Hugging Face checkpoints whose loading needs more than names matched verbatim: buffers the
model computes on modules that hold parameters too (Gemma's scaled embedding), checkpoints
saved under other names than the model's modules (transformers 5's conversion mapping), and
tied embeddings on a model built under ``accelerate.init_empty_weights()``. Each is loaded by
offload and compared with the same directory loaded by ``transformers``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import VOCAB, nvme_config  # noqa: E402

import offload  # noqa: E402

SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _save(directory, model):
    model.save_pretrained(directory)
    return directory


def _ids(seed=1):
    return torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(seed))


def _logits_match(directory, model, opt, cls=None):
    """The wrapped ``model``'s logits equal those of ``directory`` loaded by transformers."""
    cls = cls or transformers.AutoModelForCausalLM
    ref = cls.from_pretrained(directory, dtype=torch.float32).eval()
    x = _ids()
    try:
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=1e-5, atol=1e-5)
    finally:
        opt.close()


# ------------------------------------------------------------- computed buffers beside params
@pytest.mark.parametrize("arch", ["gemma", "gemma2"])
def test_gemma_embed_scale_is_computed_on_the_embedding_that_holds_the_weight(tmp_path, arch):
    cfg_cls = {"gemma": transformers.GemmaConfig, "gemma2": transformers.Gemma2Config}[arch]
    torch.manual_seed(0)
    config = cfg_cls(**SMALL, head_dim=8)
    d = _save(tmp_path / "m", transformers.AutoModelForCausalLM.from_config(config))
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path, "cpu", "cpu"))
    assert model.model.embed_tokens.embed_scale.item() == pytest.approx(32**0.5)
    _logits_match(d, model, opt)
