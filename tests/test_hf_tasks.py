"""Hugging Face models beyond the causal LM: encoder-decoders (T5, BART, Whisper), encoder-only
classifiers (BERT) and vision models (ViT), through ``offload.from_pretrained`` /
``save_pretrained`` and ``generate``, each compared with the same directory loaded by
``transformers``."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import VOCAB, nvme_config  # noqa: E402

import offload  # noqa: E402
from offload.runtime.weights import WeightsError  # noqa: E402

TINY = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4)
TINY.update(decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _t5():
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _bart():
    config = transformers.BartConfig(
        vocab_size=VOCAB, max_position_embeddings=64, decoder_start_token_id=2, **TINY, **TOKENS
    )
    return transformers.BartForConditionalGeneration(config)


def _whisper():
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, max_source_positions=16, max_target_positions=32,
        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None, **TINY,
        **TOKENS,
    )  # fmt: skip
    return transformers.WhisperForConditionalGeneration(config)


def _bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def _vit():
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=3,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


def _inputs(name):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 8), generator=g)
    if name == "whisper":
        return {"input_features": torch.randn(2, 8, 32, generator=g)}
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g)}
    return {"input_ids": ids}


MODELS = {"t5": _t5, "bart": _bart, "whisper": _whisper, "bert": _bert, "vit": _vit}
SEQ2SEQ = ("t5", "bart", "whisper")


@pytest.mark.parametrize("name", list(MODELS))
def test_from_pretrained_builds_the_saved_architecture(tmp_path, name):
    """config.json's ``architectures`` says which head the weights are for: a BART or Whisper
    directory is a ``...ForConditionalGeneration`` (not the decoder-only ``...ForCausalLM``
    that ``AutoModelForCausalLM`` maps their configs to, which then fit no key of the encoder),
    a BERT classifier keeps its classifier, T5 and ViT have no causal LM at all. Logits,
    ``generate`` and a ``save_pretrained`` round trip equal ``transformers``'."""
    torch.manual_seed(0)
    src = MODELS[name]()
    src.save_pretrained(tmp_path / "src")
    cls = type(src)
    ref = cls.from_pretrained(tmp_path / "src").eval()
    x = _inputs(name)
    if name in SEQ2SEQ:
        x["decoder_input_ids"] = torch.tensor([[0, 5, 6, 7], [0, 8, 9, 10]])
    model, opt = offload.from_pretrained(tmp_path / "src", nvme_config(tmp_path, "nvme", "nvme"))
    try:
        assert type(model) is cls
        with torch.no_grad():
            want = ref(**x).logits
            torch.testing.assert_close(model(**x).logits, want, rtol=1e-5, atol=1e-5)
            if name in SEQ2SEQ:
                gen = {k: v for k, v in x.items() if k != "decoder_input_ids"}
                kw = dict(max_new_tokens=5, do_sample=False)
                assert torch.equal(model.generate(**gen, **kw), ref.generate(**gen, **kw))
        out = offload.save_pretrained(model, tmp_path / "out")
    finally:
        opt.close()
    back = cls.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(**x).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,warned", [("fp16", True), ("bf16", False), ("fp32", False)])
def test_wrap_says_which_modules_transformers_keeps_in_fp32(tmp_path, caplog, dtype, warned):
    """T5 declares ``_keep_in_fp32_modules = ["wo"]``: transformers loads those layers in fp32
    under fp16 (their activations overflow fp16), offload computes every parameter in its one
    compute dtype. That difference is said at wrap, naming the layers and what to use."""
    torch.manual_seed(0)
    model = _t5()
    with caplog.at_level(logging.WARNING, logger="offload"):
        _, opt = offload.wrap(model, nvme_config(tmp_path, "none", "cpu", dtype=dtype))
    opt.close()
    said = [r.getMessage() for r in caplog.records if "_keep_in_fp32_modules" in r.getMessage()]
    assert bool(said) == warned, said
    if warned:
        assert "encoder.block.0.layer.1.DenseReluDense.wo.weight" in said[0]
        assert "dtype" in said[0] and "bf16" in said[0]


def test_from_pretrained_puts_a_new_head_on_a_pretrained_body(tmp_path, caplog):
    """Fine-tuning a classifier starts from a checkpoint saved with another head (BERT's is
    ``BertForMaskedLM``): ``model_class=AutoModelForSequenceClassification`` builds the
    classifier as ``transformers`` does, the body read from the file, the head (and pooler)
    the file lacks initialised by the model's ``_init_weights``, the MLM head's keys left
    out, both said in a warning; it then trains."""
    torch.manual_seed(0)
    config = _bert().config
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "mlm")
    auto = transformers.AutoModelForSequenceClassification
    ref = auto.from_pretrained(tmp_path / "mlm", num_labels=3)
    cfg = nvme_config(tmp_path, "nvme", "nvme")
    with caplog.at_level(logging.WARNING, logger="offload"):
        model, opt = offload.from_pretrained(tmp_path / "mlm", cfg, model_class=auto, num_labels=3)
    try:
        assert type(model) is transformers.BertForSequenceClassification
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "classifier.weight" in said and "cls.predictions" in said
        state = model.state_dict()
        for name, want in ref.state_dict().items():
            if not name.startswith(("classifier", "bert.pooler")):
                assert torch.equal(state[name], want), name
        head = state["classifier.weight"]
        assert head.shape == (3, 32) and 0 < head.std() < 0.1  # initializer_range 0.02
        torch.testing.assert_close(state["classifier.bias"], torch.zeros(3))
        x, y = _inputs("bert")["input_ids"], torch.tensor([0, 2])
        model.train()
        losses = []
        for _ in range(4):
            loss = model(input_ids=x, labels=y).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
    finally:
        opt.close()


def test_from_pretrained_model_class_is_checked(tmp_path):
    _bert().save_pretrained(tmp_path / "m")
    with pytest.raises(TypeError, match="model_class=.*allowed"):
        offload.from_pretrained(tmp_path / "m", nvme_config(tmp_path, "cpu", "cpu"), model_class=3)


def test_save_pretrained_names_the_class_it_saves(tmp_path):
    """A model built with another head than its checkpoint's (``model_class``, or a
    transformers ``AutoModelForSequenceClassification.from_pretrained`` of an MLM checkpoint
    wrapped) still has the checkpoint's ``architectures`` in its config: written as it was,
    the saved classifier came back from ``offload.from_pretrained`` as ``BertForMaskedLM``
    (refusing the classifier's keys). As ``transformers``' ``save_pretrained``, the config
    written names the model's class."""
    torch.manual_seed(0)
    transformers.BertForMaskedLM(_bert().config).save_pretrained(tmp_path / "mlm")
    auto = transformers.AutoModelForSequenceClassification
    cfg = nvme_config(tmp_path / "a", "cpu", "cpu")
    model, opt = offload.from_pretrained(tmp_path / "mlm", cfg, model_class=auto, num_labels=3)
    x = _inputs("bert")
    try:
        with torch.no_grad():
            want = model(**x).logits
        out = offload.save_pretrained(model, tmp_path / "out")
    finally:
        opt.close()
    again, opt = offload.from_pretrained(out, nvme_config(tmp_path / "b", "cpu", "cpu"))
    try:
        assert type(again) is transformers.BertForSequenceClassification
        with torch.no_grad():
            torch.testing.assert_close(again(**x).logits, want, rtol=1e-5, atol=1e-5)
    finally:
        opt.close()


def test_from_pretrained_resizes_a_classifier_with_ignore_mismatched_sizes(tmp_path, caplog):
    """A vision classifier fine-tuned to other labels: a ``num_labels`` other than the file's
    is an error naming the classifier's shapes, as in ``transformers``; with
    ``ignore_mismatched_sizes=True`` the classifier is initialised anew and said so."""
    torch.manual_seed(0)
    _vit().save_pretrained(tmp_path / "v")
    cfg = lambda sub: nvme_config(tmp_path / sub, "cpu", "cpu")  # noqa: E731
    with pytest.raises(WeightsError, match=r"classifier.weight.*\[3, 32\].*\[10, 32\]"):
        offload.from_pretrained(tmp_path / "v", cfg("a"), num_labels=10)
    with caplog.at_level(logging.WARNING, logger="offload"):
        model, opt = offload.from_pretrained(
            tmp_path / "v", cfg("b"), num_labels=10, ignore_mismatched_sizes=True
        )
    try:
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "classifier.weight [3, 32] -> [10, 32]" in said
        ref = transformers.ViTForImageClassification.from_pretrained(tmp_path / "v")
        state = model.state_dict()
        assert state["classifier.weight"].shape == (10, 32)
        for name, want in ref.state_dict().items():
            if not name.startswith("classifier"):
                assert torch.equal(state[name], want), name
        with torch.no_grad():
            assert model(**_inputs("vit")).logits.shape == (2, 10)
    finally:
        opt.close()
