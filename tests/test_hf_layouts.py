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


def _logits_match(directory, model, opt, cls=None, x=None):
    """The wrapped ``model``'s logits on ``x`` (token ids by default) equal those of
    ``directory`` loaded by transformers; closes ``opt``."""
    cls = cls or transformers.AutoModelForCausalLM
    ref = cls.from_pretrained(directory, dtype=torch.float32).eval()
    x = _ids() if x is None else x
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


# ------------------------------------------------------------- transformers' conversion mapping
def _moe_config(arch):
    if arch == "mixtral":
        return transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
        )  # fmt: skip
    return transformers.OlmoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2)


def _file_keys(directory):
    from safetensors import safe_open  # noqa: PLC0415

    keys = []
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(f, "pt") as sf:
            keys += list(sf.keys())
    return keys


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "olmoe"])
def test_moe_experts_saved_per_expert_load_into_the_fused_parameters(tmp_path, arch, monkeypatch):
    from offload.api import engine_of  # noqa: PLC0415
    from offload.runtime import conversion  # noqa: PLC0415

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_moe_config(arch))
    d = tmp_path / "m"
    model.save_pretrained(d, max_shard_size="40KB")  # several shards and an index
    keys = _file_keys(d)
    assert (d / "model.safetensors.index.json").is_file()
    assert any(".experts.1." in k for k in keys) and not any("gate_up_proj" in k for k in keys)
    reads = []  # elements asked of the fused experts at once
    real_read = conversion.Cat.read
    monkeypatch.setattr(
        conversion.Cat,
        "read",
        lambda self, lo, hi: reads.append(hi - lo) or real_read(self, lo, hi),
    )
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path, "nvme", "nvme"))
    piece = engine_of(model).plan.placement.piece_numel
    experts = model.model.layers[0].mlp.experts
    assert piece < experts.gate_up_proj.numel() and reads and max(reads) <= piece
    _logits_match(d, model, opt)


def test_vit_checkpoint_keys_are_renamed_as_transformers_does(tmp_path):
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5,
    )  # fmt: skip
    torch.manual_seed(0)
    d = _save(tmp_path / "m", transformers.ViTForImageClassification(config))
    assert any("attention.attention.query" in k for k in _file_keys(d))
    with torch.device("meta"):
        meta = transformers.ViTForImageClassification(config)
    model, opt = offload.wrap(meta, nvme_config(tmp_path, "cpu", "cpu"), weights=d)
    images = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    _logits_match(d, model, opt, transformers.ViTForImageClassification, images)


def test_save_pretrained_of_a_converted_model_round_trips(tmp_path):
    torch.manual_seed(0)
    d = _save(tmp_path / "m", transformers.AutoModelForCausalLM.from_config(_moe_config("mixtral")))
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path, "cpu", "cpu"))
    try:
        offload.save_pretrained(model, tmp_path / "out")
    finally:
        opt.close()
    # written under the in-memory names, which both loaders take as they are
    assert any("experts.gate_up_proj" in k for k in _file_keys(tmp_path / "out"))
    model, opt = offload.from_pretrained(tmp_path / "out", nvme_config(tmp_path, "cpu", "cpu"))
    _logits_match(d, model, opt)
    _logits_match(d, *offload.wrap(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out"),
        nvme_config(tmp_path, "cpu", "cpu"),
    ))  # fmt: skip


def test_a_conversion_offload_cannot_stream_is_named_with_the_route_that_works(
    tmp_path, monkeypatch
):
    from transformers import conversion_mapping  # noqa: PLC0415
    from transformers.core_model_loading import (  # noqa: PLC0415
        MergeModulelist,
        Transpose,
        WeightConverter,
    )

    from offload.runtime.weights import WeightsError  # noqa: PLC0415

    torch.manual_seed(0)
    d = _save(tmp_path / "m", transformers.AutoModelForCausalLM.from_config(_moe_config("mixtral")))
    real = conversion_mapping.get_model_conversion_mapping

    def with_a_transpose(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        down = next(t for t in out if ".experts.*.w2.weight" in t.source_patterns)
        out[out.index(down)] = WeightConverter(
            ".experts.*.w2.weight", ".experts.down_proj", [MergeModulelist(0), Transpose(1, 2)]
        )
        return out

    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", with_a_transpose)
    with pytest.raises(WeightsError) as err:
        offload.from_pretrained(d, nvme_config(tmp_path, "cpu", "cpu"))
    msg = str(err.value)
    assert "'model.layers.0.mlp.experts.down_proj' (from model.layers.0.block_sparse_moe" in msg
    assert "cannot stream Transpose yet" in msg and "gate_up_proj" not in msg
    assert "Load the model with transformers (from_pretrained) and pass it to offload.wrap" in msg


def _drop_keys(directory, keys):
    """Removes ``keys`` from the sharded checkpoint in ``directory`` (shards and index)."""
    import json  # noqa: PLC0415

    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in {index["weight_map"][k] for k in keys}:
        tensors = load_file(directory / shard)
        save_file({k: v for k, v in tensors.items() if k not in keys}, directory / shard)
    for k in keys:
        del index["weight_map"][k]
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    "arch,drop",
    [
        ("mixtral", ["model.layers.1.block_sparse_moe.experts.3.w1.weight"]),
        ("qwen2_moe", [f"model.layers.1.mlp.experts.3.{p}_proj.weight" for p in ("gate", "up", "down")]),
    ],
)  # fmt: skip
def test_an_expert_missing_from_the_checkpoint_is_named(tmp_path, arch, drop):
    """A per-expert checkpoint that lacks an expert's tensor was reported as a layout offload
    "cannot convert yet", with the advice to load it with transformers (which fails on it too),
    or as a shape [3, ...] "in the file" of a fused name the file does not hold; the error
    names the missing keys of the file."""
    from offload.runtime.weights import WeightsError  # noqa: PLC0415

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_moe_config(arch))
    d = tmp_path / "m"
    model.save_pretrained(d, max_shard_size="40KB")
    _drop_keys(d, drop)
    with pytest.raises(WeightsError) as err:
        offload.from_pretrained(d, nvme_config(tmp_path, "cpu", "cpu"))
    msg = str(err.value)
    assert f"{len(drop)} missing keys" in msg and all(f"{k} (for " in msg for k in drop), msg
    assert "cannot convert" not in msg and "in the file, [4," not in msg, msg


def test_an_expert_of_another_shape_is_named(tmp_path):
    """One expert's tensor of another shape than the others' was reported as a layout offload
    "cannot convert yet" (advising transformers, which refuses it too), with the shapes of the
    parts but not the key; the error names the key and both shapes."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    from offload.runtime.weights import WeightsError  # noqa: PLC0415

    torch.manual_seed(0)
    d = _save(tmp_path / "m", transformers.AutoModelForCausalLM.from_config(_moe_config("mixtral")))
    key = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    tensors = load_file(d / "model.safetensors")
    tensors[key] = tensors[key][:-1].clone()
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(WeightsError) as err:
        offload.from_pretrained(d, nvme_config(tmp_path, "cpu", "cpu"))
    msg = str(err.value)
    assert f"'{key}': shape [63, 32] in the file, [64, 32] in the 3 other" in msg, msg
    assert "cannot convert" not in msg, msg


def test_from_pretrained_takes_config_overrides_as_transformers_does(tmp_path):
    """``from_pretrained(path, output_router_logits=True)`` sets the config attribute in
    transformers (the MoE router's load-balancing loss joins the loss); offload passed it to
    the model's ``__init__``: TypeError, so the auxiliary loss could not be turned on."""
    torch.manual_seed(0)
    d = _save(tmp_path / "m", transformers.AutoModelForCausalLM.from_config(_moe_config("mixtral")))
    over = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **over)
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path, "cpu", "cpu"), **over)
    try:
        assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.5
        x = _ids()
        with torch.no_grad():
            got, want = model(input_ids=x, labels=x), ref(input_ids=x, labels=x)
        assert want.aux_loss is not None and got.aux_loss is not None
        torch.testing.assert_close(got.loss, want.loss)
    finally:
        opt.close()


# ------------------------------------------------------------- tied weights init_empty_weights untied
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_init_empty_weights_with_tied_embeddings_loads_tied(tmp_path, arch):
    accelerate = pytest.importorskip("accelerate")
    from hf_models import hf_config  # noqa: PLC0415

    config = (
        hf_config(tie=True) if arch == "llama" else transformers.GemmaConfig(**SMALL, head_dim=8)
    )
    torch.manual_seed(0)
    d = _save(tmp_path / "m", transformers.AutoModelForCausalLM.from_config(config))
    with accelerate.init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model, opt = offload.wrap(model, nvme_config(tmp_path, "nvme", "nvme"), weights=d)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _logits_match(d, model, opt)
