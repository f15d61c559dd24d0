"""Hugging Face models through offload: ``from_pretrained`` (built on meta, streamed from the
shards) against the same model loaded normally and trained with ``torch.optim.AdamW``;
``save_pretrained`` back and ``transformers`` loading it; Trainer and Accelerate clipping."""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import VOCAB, hf_config, nvme_config, write_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import offload  # noqa: E402
from offload.api.clipping import ClipError  # noqa: E402
from offload.runtime.phase import PhaseError  # noqa: E402
from offload.runtime.weights import WeightsError  # noqa: E402

STEPS, ACCUM, CLIP, LR, WD = 5, 2, 0.5, 1e-2, 0.1


def _batches(n=STEPS * ACCUM, seed=1):
    """``n`` batches cycling over two (so that five steps learn something)."""
    g = torch.Generator().manual_seed(seed)
    two = [torch.randint(3, VOCAB, (2, 12), generator=g) for _ in range(2)]
    return [two[i % 2] for i in range(n)]


def _loss(model, x):
    return model(input_ids=x, labels=x).loss


def _reference(directory, dtype=None):
    """The model loaded normally, trained with torch.optim.AdamW (mixed precision: an fp32
    master, a low-precision compute copy, fp32 gradients)."""
    master = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    compute = master if dtype is None else copy.deepcopy(master).to(dtype)
    mparams, cparams = list(master.parameters()), list(compute.parameters())
    opt = torch.optim.AdamW(mparams, lr=LR, weight_decay=WD, foreach=False)
    data, losses = _batches(), []
    for s in range(STEPS):
        total = 0.0
        for m in range(ACCUM):
            loss = _loss(compute, data[s * ACCUM + m]) / ACCUM
            loss.backward()
            total += loss.item()
            if compute is not master:
                for mp, cp in zip(mparams, cparams):
                    g = cp.grad.float()
                    mp.grad = g if mp.grad is None else mp.grad + g
                    cp.grad = None
        torch.nn.utils.clip_grad_norm_(mparams, CLIP)
        opt.step()
        opt.zero_grad()
        if compute is not master:
            with torch.no_grad():
                for mp, cp in zip(mparams, cparams):
                    cp.copy_(mp)
        losses.append(total)
    return losses


def _offload(model, opt):
    data, losses = _batches(), []
    for s in range(STEPS):
        total = 0.0
        for m in range(ACCUM):
            loss = _loss(model, data[s * ACCUM + m]) / ACCUM
            loss.backward()
            total += loss.item()
        opt.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize(
    "arch,tie", [("llama", False), ("llama", True), ("qwen2", True), ("mistral", False)]
)
def test_fp32_parity_with_the_model_loaded_normally(tmp_path, arch, tie):
    d = write_model(tmp_path / "m", arch, tie=tie, max_shard_size="40KB")
    assert (d / "model.safetensors.index.json").exists()  # streamed from several shards
    ref = _reference(d)
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path, "nvme", "nvme"))
    try:
        assert model.config.tie_word_embeddings == tie
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
        got = _offload(model, opt)
    finally:
        opt.close()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)
    assert got[-1] < got[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_parity_with_a_mixed_precision_reference(tmp_path, arch):
    d = write_model(tmp_path / "m", arch, dtype=torch.bfloat16)
    ref = _reference(d, torch.bfloat16)
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path, "nvme", "nvme", dtype="bf16"))
    try:
        got = _offload(model, opt)
    finally:
        opt.close()
    # bf16 compute: the tolerance of bf16 (8 bits of mantissa)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1.6e-2, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_save_pretrained_round_trip(tmp_path, arch):
    d = write_model(tmp_path / "m", arch, tie=arch == "llama")
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path / "a", "nvme", "nvme"))
    x = _batches(1, seed=7)[0]
    try:
        _offload(model, opt)  # values differ from the file's now
        with torch.no_grad():
            logits = model(input_ids=x).logits
        state = model.state_dict()
        out = offload.save_pretrained(model, tmp_path / "out", max_shard_size="40KB")
        offload.save_pretrained(model, tmp_path / "bf16", dtype=torch.bfloat16)
    finally:
        opt.close()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / s).exists() for s in shards)
    assert not (out / "model.safetensors").exists()
    assert ("lm_head.weight" in index["weight_map"]) == (arch != "llama")  # tied: written once
    assert json.loads((out / "config.json").read_text())["model_type"] == arch
    back = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=x).logits, logits, rtol=1e-5, atol=1e-5)
    for k, v in back.state_dict().items():
        assert torch.equal(v, state[k]), k
    back16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert back16.dtype == torch.bfloat16 and (tmp_path / "bf16" / "model.safetensors").exists()
    with torch.no_grad():
        torch.testing.assert_close(
            back16(input_ids=x).logits.float(), logits, rtol=1.6e-2, atol=5e-2
        )
    # and offload reads its own export back
    again, opt = offload.from_pretrained(out, nvme_config(tmp_path / "b", "cpu", "cpu"))
    try:
        for k, v in again.state_dict().items():
            assert torch.equal(v, state[k]), k
    finally:
        opt.close()


def _files(directory) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize("exchange", ["atomic", "aside"])
def test_save_pretrained_over_an_earlier_one_is_all_or_nothing(tmp_path, monkeypatch, exchange):
    """A save over an earlier export that fails part way (here the third shard's write; a
    SIGKILL there did the same) left the old index with some new shards, which transformers
    loaded without a word. Now the directory is the old one, byte for byte, until the new one
    is whole; a completed save keeps the files it does not write (a tokenizer) and leaves no
    staging directory. ``aside``: where the atomic exchange is refused."""
    import offload.api.pretrained as pretrained  # noqa: PLC0415

    if exchange == "aside":
        monkeypatch.setattr(pretrained, "_exchange", lambda a, b: False)
    d = write_model(tmp_path / "m")
    out = tmp_path / "out"
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path / "a", "nvme", "nvme"))
    try:
        offload.save_pretrained(model, out, max_shard_size="40KB")
        (out / "tokenizer.json").write_text("{}")
        (out / "extra").mkdir()
        (out / "extra" / "notes.txt").write_text("kept")
        before = _files(out)
        _offload(model, opt)  # new values
        real, calls = pretrained.write_file, []

        def dying(path, *args, **kwargs):
            calls.append(path)
            if len(calls) == 3:
                raise OSError(28, "No space left on device (injected)")
            return real(path, *args, **kwargs)

        monkeypatch.setattr(pretrained, "write_file", dying)
        with pytest.raises(OSError, match="No space left"):
            offload.save_pretrained(model, out, max_shard_size="40KB")
        assert _files(out) == before
        monkeypatch.setattr(pretrained, "write_file", real)
        (tmp_path / ".out.offload-new").mkdir()  # as a killed save leaves it
        offload.save_pretrained(model, out, max_shard_size="40KB")
        state = model.state_dict()
    finally:
        opt.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []
    assert (out / "tokenizer.json").read_text() == "{}"
    assert (out / "extra" / "notes.txt").read_text() == "kept"
    back = AutoModelForCausalLM.from_pretrained(out)
    for k, v in back.state_dict().items():
        assert torch.equal(v, state[k]), k


class _Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs."""


@pytest.mark.parametrize("where", ["deleting the old one", "between the renames"])
def test_a_save_pretrained_killed_after_moving_the_old_export_aside_leaves_nothing(
    tmp_path, monkeypatch, where
):
    """Where the atomic exchange is refused (NFS), the old export is renamed aside to
    ``.NAME.offload-old`` and deleted once the new one is in place. A kill while deleting it
    (a large export's unlinks take seconds) left it, half deleted, beside every later save for
    good; a kill between the two renames left no export under the name and the old one only
    aside, which the next save left there too. The next save now puts back an old export that
    lost its place and removes what is left aside."""
    import offload.api.pretrained as pretrained  # noqa: PLC0415

    monkeypatch.setattr(pretrained, "_exchange", lambda a, b: False)
    d = write_model(tmp_path / "m")
    out, aside = tmp_path / "out", tmp_path / ".out.offload-old"
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path / "a", "nvme", "nvme"))
    try:
        offload.save_pretrained(model, out, max_shard_size="40KB")
        old = _files(out)
        real_rmtree, real_rename = pretrained.shutil.rmtree, pretrained.os.rename

        def rmtree(path, ignore_errors=False):
            if path == aside:
                next(aside.glob("*.safetensors")).unlink()
                raise _Killed
            real_rmtree(path, ignore_errors=ignore_errors)

        def rename(src, dst):
            if dst == out:
                raise _Killed
            real_rename(src, dst)

        if where == "deleting the old one":
            monkeypatch.setattr(pretrained.shutil, "rmtree", rmtree)
        else:
            monkeypatch.setattr(pretrained.os, "rename", rename)
        with pytest.raises(_Killed):
            offload.save_pretrained(model, out, max_shard_size="40KB")
        monkeypatch.setattr(pretrained.shutil, "rmtree", real_rmtree)
        monkeypatch.setattr(pretrained.os, "rename", real_rename)
        assert aside.exists()
        if where == "between the renames":
            assert not out.exists()
            offload.save_pretrained(model, out, max_shard_size="40KB")  # put back, then replaced
        else:
            offload.save_pretrained(model, out, max_shard_size="40KB")
        state = model.state_dict()
    finally:
        opt.close()
    assert old and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []
    back = AutoModelForCausalLM.from_pretrained(out)
    for k, v in back.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_save_pretrained_where_nothing_can_be_staged_writes_in_place(tmp_path, caplog):
    """A directory that is a mount point, or whose parent is read-only, cannot be exchanged:
    written file by file as before (said in a warning), not refused."""
    d = write_model(tmp_path / "m")
    out = tmp_path / "out"
    (tmp_path / ".out.offload-new").write_text("a file where the staging directory goes")
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path / "a", "cpu", "cpu"))
    try:
        with caplog.at_level("WARNING", logger="offload.api"):
            offload.save_pretrained(model, out)
        state = model.state_dict()
    finally:
        opt.close()
    assert "writing into it file by file" in caplog.text
    back = AutoModelForCausalLM.from_pretrained(out)
    for k, v in back.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_save_pretrained_over_a_link_a_shared_directory_or_the_working_one(tmp_path, monkeypatch):
    """The save replaced the directory it was given: a symbolic link (a cluster's ``out ->
    /scratch/out``) became a real directory, its target left without the weights and a link
    left as the staging directory; a shared directory's mode (2770) and group came back as
    755 and the process's; the working directory was removed under the process (and ``.``
    refused as busy after every shard was written). Now the link's target is replaced, the
    mode kept, and a directory holding the working directory written file by file."""
    d = write_model(tmp_path / "m")
    real, link = tmp_path / "scratch" / "out", tmp_path / "out"
    real.mkdir(parents=True)
    os.chmod(real, 0o2770)
    link.symlink_to(real, target_is_directory=True)
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path / "a", "cpu", "cpu"))
    try:
        for _ in range(2):  # (the second over the first's export)
            offload.save_pretrained(model, link)
            assert link.is_symlink() and (real / "model.safetensors").is_file()
            assert oct(os.stat(real).st_mode & 0o7777) == oct(0o2770)
            assert sorted(p.name for p in real.parent.iterdir()) == ["out"]
            assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
        (real / "tokenizer.json").write_text("{}")
        monkeypatch.chdir(real)
        offload.save_pretrained(model, ".")
        assert Path.cwd() == real and (Path(".") / "tokenizer.json").read_text() == "{}"
        state = model.state_dict()
    finally:
        opt.close()
    back = AutoModelForCausalLM.from_pretrained(real)
    for k, v in back.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_loading_errors_name_the_keys(tmp_path):
    d = write_model(tmp_path / "m")
    state = load_file(d / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # old HF: ignored
    state["model.extra.weight"] = torch.ones(2)
    state["model.norm.weight"] = torch.ones(5)
    save_file(state, d / "model.safetensors")
    with pytest.raises(WeightsError) as err:
        offload.from_pretrained(d, nvme_config(tmp_path, "nvme", "nvme"))
    msg = str(err.value)
    assert "1 missing key" in msg and "model.layers.1.mlp.up_proj.weight" in msg
    assert "1 unexpected key" in msg and "model.extra.weight" in msg and "inv_freq" not in msg
    assert "'model.norm.weight': shape [5] in the file, [32] in the model's parameter" in msg
    with pytest.raises(FileNotFoundError, match="not a local model directory"):
        offload.from_pretrained(tmp_path / "nowhere", nvme_config(tmp_path, "nvme", "nvme"))


def test_a_directory_with_both_a_single_file_and_an_index_loads_as_transformers(tmp_path, caplog):
    """A directory holding ``model.safetensors`` and a sharded index (a repository that ships
    both, a sharded save by a tool that left the single file): transformers loads the single
    file; offload read the index, so the same directory gave other weights without a word."""
    d = write_model(tmp_path / "m", seed=0, max_shard_size="40KB")
    other = write_model(tmp_path / "other", seed=1)
    (other / "model.safetensors").rename(d / "model.safetensors")
    x = _batches(1)[0]
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(d)(input_ids=x).logits
    with caplog.at_level(logging.INFO, logger="offload"):
        model, opt = offload.from_pretrained(d, nvme_config(tmp_path, "cpu", "cpu"))
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=x).logits, want, rtol=1e-5, atol=1e-5)
    finally:
        opt.close()
    assert any("model.safetensors.index.json" in r.getMessage() for r in caplog.records)


def test_init_empty_weights_and_a_meta_context_both_load(tmp_path):
    from accelerate import init_empty_weights  # noqa: PLC0415

    d = write_model(tmp_path / "m")
    ref = AutoModelForCausalLM.from_pretrained(d)
    x = _batches(1)[0]
    with torch.no_grad():
        want = ref(input_ids=x).logits
    with init_empty_weights():  # parameters on meta, buffers real
        a = AutoModelForCausalLM.from_config(hf_config())
    with torch.device("meta"):  # buffers on meta too: inv_freq is computed by the model
        b = AutoModelForCausalLM.from_config(hf_config())
    assert a.model.rotary_emb.inv_freq.device.type == "cpu" and b.model.rotary_emb.inv_freq.is_meta
    for i, model in enumerate((a, b)):
        model, opt = offload.wrap(model, nvme_config(tmp_path / str(i), "nvme", "nvme"), weights=d)
        try:
            torch.testing.assert_close(
                model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq
            )
            with torch.no_grad():
                assert torch.equal(model(input_ids=x).logits, want)
        finally:
            opt.close()


@pytest.mark.parametrize("head", ["other values", "the same values"])
def test_a_tied_file_holding_both_names_is_tied_as_transformers_ties_it(tmp_path, head, caplog):
    """A ``tie_word_embeddings`` model whose file holds ``lm_head.weight`` beside the embedding
    (torch's .bin conversions write both): transformers ties the pair where the values are the
    same and leaves it untied, warning, where not. ``offload.from_pretrained`` built the model
    tied already and read one of the two (logits 18.45 off with other values, no word), and
    ``wrap(weights=)`` of a model built empty left the pair untied also with the same values
    (trained apart where transformers trains one tensor). Both follow transformers now, and
    training matches it."""
    from accelerate import init_empty_weights  # noqa: PLC0415

    d = write_model(tmp_path / "m", tie=True)
    sd = load_file(d / "model.safetensors")
    emb = sd["model.embed_tokens.weight"]
    sd["lm_head.weight"] = emb.clone() if head == "the same values" else torch.randn_like(emb)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    ref = AutoModelForCausalLM.from_pretrained(d)
    tied = ref.lm_head.weight is ref.model.embed_tokens.weight
    assert tied == (head == "the same values")
    want = _reference(d)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(hf_config(tie=True))
    for i, load in enumerate(
        (
            lambda cfg: offload.from_pretrained(d, cfg),
            lambda cfg: offload.wrap(empty, cfg, weights=d),
        )
    ):
        caplog.clear()
        model, opt = load(nvme_config(tmp_path / str(i), "cpu", "cpu"))
        try:
            assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
            assert any("different values" in r.getMessage() for r in caplog.records) != tied
            model.train()
            assert _offload(model, opt) == pytest.approx(want, rel=1e-5)
        finally:
            opt.close()


def test_a_model_with_buffers_made_in_init_loads(tmp_path):
    """GPT-Neo's and GPTBigCode's causal masks are buffers made in ``__init__``, in no file:
    ``offload.from_pretrained`` built the model under ``torch.device("meta")``, which left
    them without values, and refused the directory. It builds as transformers does now
    (parameters on meta, buffers real)."""
    import transformers  # noqa: PLC0415

    cfg = transformers.GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
        attention_types=[[["global", "local"], 1]], window_size=8,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "neo")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "neo")
    model, opt = offload.from_pretrained(tmp_path / "neo", nvme_config(tmp_path, "nvme", "nvme"))
    try:
        x = _batches(1)[0]
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, ref(input_ids=x).logits)
    finally:
        opt.close()


def test_the_directory_s_generation_config_is_read_and_saved_again(tmp_path):
    """An instruct model's ``generation_config.json`` (its stop tokens, its sampling defaults)
    was never read: ``generate`` ran without them (20 tokens instead of 77, no repetition
    penalty, one stop token of two), and ``save_pretrained`` wrote the defaults built from
    ``config.json`` over the file. Read as transformers reads it now, and written back."""
    from transformers import GenerationConfig  # noqa: PLC0415

    d = write_model(tmp_path / "m")
    settings = {"eos_token_id": [2, 5], "max_new_tokens": 7, "repetition_penalty": 1.5}
    gen = GenerationConfig.from_pretrained(d)
    gen.update(**settings)
    gen.save_pretrained(d)
    ref = AutoModelForCausalLM.from_pretrained(d)
    ids = torch.tensor([[4, 5, 6]])
    want = ref.generate(ids, do_sample=False)
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path / "a", "cpu", "cpu"))
    try:
        for key, value in settings.items():
            assert getattr(model.generation_config, key) == value, key
        assert torch.equal(model.generate(ids, do_sample=False), want)
        offload.save_pretrained(model, tmp_path / "out")
    finally:
        opt.close()
    saved = GenerationConfig.from_pretrained(tmp_path / "out")
    assert {k: getattr(saved, k) for k in settings} == settings


@pytest.mark.parametrize("param_dev", ["cpu", "nvme"])
def test_an_encoder_decoder_generates_as_transformers(tmp_path, param_dev):
    """``generate`` on a wrapped T5 raised: it runs the encoder by itself
    (``model.get_encoder()(...)``), whose embedding is the root unit's, released outside the
    model's forward. Under ``no_grad`` such a part gathers its unit for the call now; the
    tokens are transformers' own, and a training step follows."""
    from transformers import T5Config, T5ForConditionalGeneration  # noqa: PLC0415

    cfg = T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = T5ForConditionalGeneration(cfg).eval()
    ids = torch.randint(3, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    want = ref.generate(ids, max_new_tokens=6, do_sample=False)
    model, opt = offload.wrap(copy.deepcopy(ref), nvme_config(tmp_path, param_dev, "cpu"))
    try:
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want)
        model.train()
        model(input_ids=ids, labels=want[:, 1:].contiguous()).loss.backward()
        opt.step()
    finally:
        opt.close()


# ------------------------------------------------------------------------------- clipping
PLACEMENTS = [(p, o) for p in ("none", "cpu", "nvme") for o in ("cpu", "nvme")]


def _trainer_args(out, **over):
    from transformers import TrainingArguments  # noqa: PLC0415

    kw = dict(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUM,
        learning_rate=LR,
        weight_decay=WD,
        max_grad_norm=CLIP,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        lr_scheduler_type="cosine",
        warmup_steps=2,
        seed=0,
        disable_tqdm=True,
    )
    kw.update(over)
    return TrainingArguments(**kw)


def _dataset():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS * ACCUM * 2):
        t = torch.randint(3, VOCAB, (12,), generator=g)
        out.append({"input_ids": t, "labels": t})
    return out


def _history(trainer):
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory):
    """Plain Trainer, the model loaded normally, torch AdamW, torch's clipping; and offload's
    CPU placement (gradients in .grad, where torch's clipping works too)."""
    from transformers import Trainer  # noqa: PLC0415

    tmp = tmp_path_factory.mktemp("trainer")
    d = write_model(tmp / "m")
    ref = AutoModelForCausalLM.from_pretrained(d)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    trainer = Trainer(
        model=ref, args=_trainer_args(tmp / "r"), train_dataset=_dataset(), optimizers=(opt, None)
    )
    trainer.train()
    return d, _history(trainer)


def test_trainer_checkpoints_stream_the_optimizer_state_and_resume_bitwise(tmp_path, monkeypatch):
    """The Trainer saved its checkpoints with ``optimizer.state_dict()`` and
    ``model.state_dict()``, which gather the fp32 master and moments (12 bytes a parameter)
    and every weight into host RAM: 84 + 28 GB for a 7B model, past the host budget the tiers
    keep. The optimizer's state is an offload checkpoint now (``offload_state/``) and the
    weights offload's ``save_pretrained``, both streamed from the tiers (neither state dict is
    called), and a resume ends at the uninterrupted run's weights bitwise."""
    from offload.api.optimizer import OffloadOptimizer  # noqa: PLC0415

    d = write_model(tmp_path / "m")

    def gathered(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__}.state_dict() gathered into host RAM")

    def train(out, resume=None):
        model, opt = offload.from_pretrained(d, nvme_config(tmp_path / out, "nvme", "nvme"))
        try:
            trainer = offload.OffloadTrainer(
                model=model, args=_trainer_args(tmp_path / out, save_strategy="steps", save_steps=2),
                train_dataset=_dataset(), optimizers=(opt, None),
            )  # fmt: skip
            with monkeypatch.context() as m:
                if resume is None:
                    m.setattr(OffloadOptimizer, "state_dict", gathered)
                    m.setattr(type(model), "state_dict", gathered)
                trainer.train(resume_from_checkpoint=resume)
            return {k: v.clone() for k, v in model.state_dict().items()}
        finally:
            opt.close()

    whole = train("a")
    saved = tmp_path / "a" / "checkpoint-2"
    assert (saved / "offload_state" / "latest").is_file() and (saved / "scheduler.pt").is_file()
    assert not (saved / "optimizer.pt").exists()
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "a" / f"checkpoint-{STEPS}"
    ).state_dict()
    for name, want in loaded.items():  # (the weights the Trainer's checkpoint holds)
        assert name not in whole or torch.equal(whole[name], want), name
    resumed = train("b", resume=str(saved))
    for name, want in whole.items():
        assert torch.equal(resumed[name], want), name


@pytest.mark.parametrize("param_dev,opt_dev", PLACEMENTS)
def test_trainer_clips_through_offload_for_every_placement(
    tmp_path, trainer_reference, param_dev, opt_dev
):
    d, (ref_losses, ref_norms) = trainer_reference
    assert max(ref_norms) > CLIP  # clipping changes the run
    cfg = nvme_config(tmp_path, param_dev, opt_dev)
    cfg["optimizer"]["lr"] = LR
    model, opt = offload.from_pretrained(d, cfg)
    try:
        trainer = offload.OffloadTrainer(
            model=model,
            args=_trainer_args(tmp_path / "o"),
            train_dataset=_dataset(),
            optimizers=(opt, None),
        )
        trainer.train()
        losses, norms = _history(trainer)
    finally:
        opt.close()
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)


def test_trainer_s_max_grad_norm_decides_the_clipping_over_the_config_s(tmp_path, caplog):
    """``max_grad_norm=0`` (no clipping, in a plain Trainer) beside a config's
    ``gradient_clipping`` (a DeepSpeed user's 1.0): the optimizer clipped in ``step()`` anyway,
    silently (1.4e-2 off the Trainer's weights in 5 steps). The Trainer's setting decides now,
    the difference said once; the optimizer's own is back after ``train()``."""
    from transformers import Trainer  # noqa: PLC0415

    d = write_model(tmp_path / "m")
    ref = AutoModelForCausalLM.from_pretrained(d)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    args = dict(max_grad_norm=0.0)
    plain = Trainer(
        model=ref, args=_trainer_args(tmp_path / "r", **args), train_dataset=_dataset(),
        optimizers=(opt, None),
    )  # fmt: skip
    plain.train()
    cfg = nvme_config(tmp_path, "cpu", "cpu")
    cfg["optimizer"]["lr"] = LR
    cfg["gradient_clipping"] = CLIP
    model, oopt = offload.from_pretrained(d, cfg)
    try:
        trainer = offload.OffloadTrainer(
            model=model, args=_trainer_args(tmp_path / "o", **args), train_dataset=_dataset(),
            optimizers=(oopt, None),
        )  # fmt: skip
        with caplog.at_level("WARNING", logger="offload.api"):
            trainer.train()
        assert oopt.gradient_clipping == CLIP
        got = model.state_dict()
    finally:
        oopt.close()
    assert "max_grad_norm=0.0 decides the clipping (none)" in caplog.text
    losses, ref_losses = _history(trainer)[0], _history(plain)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5, msg=name)


def test_trainer_with_the_configs_param_groups_matches_the_plain_trainer_over_them(tmp_path):
    """A Hugging Face model's param groups come by name in the config (``from_pretrained``
    builds the model: there are no tensors to list before it): the second layer at a larger
    LR and no decay. Through ``OffloadTrainer`` (its cosine schedule with warm-up, per group;
    clipping; accumulation) the run equals the plain Trainer over torch's AdamW with the same
    two groups."""
    from transformers import Trainer  # noqa: PLC0415

    d = write_model(tmp_path / "m")
    second = r"layers\.1\."
    ref = AutoModelForCausalLM.from_pretrained(d)
    named = list(ref.named_parameters())
    groups = [
        {"params": [p for n, p in named if not re.search(second, n)]},
        {
            "params": [p for n, p in named if re.search(second, n)],
            "lr": 3 * LR,
            "weight_decay": 0.0,
        },
    ]
    opt = torch.optim.AdamW(groups, lr=LR, weight_decay=WD, foreach=False)
    plain = Trainer(
        model=ref,
        args=_trainer_args(tmp_path / "r"),
        train_dataset=_dataset(),
        optimizers=(opt, None),
    )
    plain.train()
    cfg = nvme_config(tmp_path, "cpu", "nvme")
    cfg["optimizer"].update(
        lr=LR, weight_decay=WD, param_groups=[{"params": [second], "lr": 3 * LR, "weight_decay": 0}]
    )
    model, oopt = offload.from_pretrained(d, cfg)
    try:
        assert [len(g["params"]) for g in oopt.param_groups] == [len(g["params"]) for g in groups]
        trainer = offload.OffloadTrainer(
            model=model, args=_trainer_args(tmp_path / "o"), train_dataset=_dataset(),
            optimizers=(oopt, None),
        )  # fmt: skip
        trainer.train()
        assert [g["lr"] for g in oopt.param_groups] == [g["lr"] for g in opt.param_groups]
        got = model.state_dict()
    finally:
        oopt.close()
    losses, ref_losses = _history(trainer)[0], _history(plain)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5, msg=name)


def test_trainer_bf16_on_an_fp32_model_keeps_no_copy_of_the_weights(tmp_path):
    """``bf16=True`` over offload's fp32 compute: Accelerate wraps ``model.forward`` in
    autocast, whose matmuls saved a bf16 copy of every weight from the forward to the
    backward (offload's hooks ran before that region opened; ``offload/runtime/autocast.py``).
    Now at most two at a time, and the Trainer's losses and norms are plain Trainer's."""
    from engine_models import LiveCasts  # noqa: PLC0415
    from transformers import Trainer  # noqa: PLC0415

    d = write_model(tmp_path / "m")
    ref = AutoModelForCausalLM.from_pretrained(d)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    args = dict(bf16=True, max_steps=3)
    plain = Trainer(
        model=ref,
        args=_trainer_args(tmp_path / "r", **args),
        train_dataset=_dataset(),
        optimizers=(opt, None),
    )
    shapes = {tuple(p.shape) for p in ref.parameters() if p.dim() == 2}
    torch_casts = LiveCasts(shapes)
    with torch_casts:
        plain.train()
    cfg = nvme_config(tmp_path, "nvme", "nvme")
    cfg["optimizer"]["lr"] = LR
    model, opt = offload.from_pretrained(d, cfg)
    try:
        trainer = offload.OffloadTrainer(
            model=model,
            args=_trainer_args(tmp_path / "o", **args),
            train_dataset=_dataset(),
            optimizers=(opt, None),
        )
        casts = LiveCasts(shapes)
        with casts:
            trainer.train()
    finally:
        opt.close()
    assert torch_casts.peak >= 8 and casts.peak <= 2, (torch_casts.peak, casts.peak)
    # (equal to the last bit where the clipping coefficient is: offload's norm sums in
    # another order, one ulp, which Adam magnifies in later steps)
    for got, want in zip(_history(trainer), _history(plain), strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=0)


def test_trainer_refuses_an_accumulation_the_step_in_backward_cannot_run(tmp_path):
    """With the update in the step's last backward, a Trainer accumulating 4 micro-batches
    over a config of 2 failed at the third, half way through a step."""
    d = write_model(tmp_path / "m")
    cfg = nvme_config(tmp_path, "cpu", "nvme") | {"gradient_accumulation_steps": 2}
    model, opt = offload.from_pretrained(d, cfg)
    try:
        with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4 .* is 2"):
            offload.OffloadTrainer(
                model=model, args=_trainer_args(tmp_path / "o", gradient_accumulation_steps=4),
                train_dataset=_dataset(), optimizers=(opt, None),
            )  # fmt: skip
        offload.OffloadTrainer(  # the same: fine
            model=model, args=_trainer_args(tmp_path / "o", gradient_accumulation_steps=2),
            train_dataset=_dataset(), optimizers=(opt, None),
        )  # fmt: skip
    finally:
        opt.close()


class _Holder(torch.nn.Module):
    """A model around the wrapped one that calls it (as a PeftModel does its base model)."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, labels=None, attention_mask=None):
        return self.inner(input_ids=input_ids, labels=labels, attention_mask=attention_mask)


def test_trainer_takes_a_model_that_holds_the_wrapped_one(tmp_path, trainer_reference):
    """PEFT: the transformers model inside the PeftModel is the one wrapped (so that generate
    works), and the Trainer gets the PeftModel (so that it saves the adapters); it was refused
    as "a model offload did not wrap"."""
    d, (ref_losses, _) = trainer_reference
    cfg = nvme_config(tmp_path, "cpu", "nvme")
    cfg["optimizer"]["lr"] = LR
    model, opt = offload.from_pretrained(d, cfg)
    try:
        trainer = offload.OffloadTrainer(
            model=_Holder(model), args=_trainer_args(tmp_path / "o"), train_dataset=_dataset(),
            optimizers=(opt, None),
        )  # fmt: skip
        trainer.train()
        losses, _ = _history(trainer)
    finally:
        opt.close()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def test_trainer_scales_the_loss_with_fp16_compute(tmp_path, trainer_reference):
    """fp16 compute: the step and clipping divide the gradients by the loss scale, so the
    backward must be of the scaled loss. Trainer's plain backward left them 65536x small: the
    logged grad_norm was ~3e-5 against the reference's ~2, nothing clipped, nothing learned. The
    norms and losses now follow the fp32 reference to fp16's precision."""
    d, (ref_losses, ref_norms) = trainer_reference
    cfg = nvme_config(tmp_path, "none", "cpu", dtype="fp16")
    cfg["optimizer"]["lr"] = LR
    model, opt = offload.from_pretrained(d, cfg)
    try:
        trainer = offload.OffloadTrainer(
            model=model,
            args=_trainer_args(tmp_path / "o"),
            train_dataset=_dataset(),
            optimizers=(opt, None),
        )
        trainer.train()
        losses, norms = _history(trainer)
    finally:
        opt.close()
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=0.05, atol=0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0.02, atol=0)


def test_trainer_says_which_training_arguments_do_not_apply(tmp_path, caplog):
    """The optimizer comes from the offload config, built before the Trainer: learning_rate,
    weight_decay, adam_* and optim of TrainingArguments do not reach it (the usual HF template
    with "auto" in the config ran lr 1e-3 against learning_rate=2e-5 without a word). One
    warning now names each that differs, with both values; none when they agree."""
    model, opt = offload.from_pretrained(
        write_model(tmp_path / "m"), nvme_config(tmp_path, "none", "cpu")
    )
    try:
        with caplog.at_level(logging.WARNING, logger="offload"):
            offload.OffloadTrainer(
                model=model, args=_trainer_args(tmp_path / "a"), train_dataset=_dataset(),
                optimizers=(opt, None),
            )  # fmt: skip
        assert "TrainingArguments do not apply" not in caplog.text
        with caplog.at_level(logging.WARNING, logger="offload"):
            offload.OffloadTrainer(
                model=model, train_dataset=_dataset(), optimizers=(opt, None),
                args=_trainer_args(tmp_path / "b", learning_rate=2e-5, optim="sgd"),
            )  # fmt: skip
        said = [r.getMessage() for r in caplog.records if "do not apply" in r.getMessage()]
        assert len(said) == 1, said
        assert "learning_rate=2e-05 (the config's 0.01)" in said[0]
        assert "optim='sgd' (offload runs AdamW)" in said[0] and "weight_decay" not in said[0]
    finally:
        opt.close()


def test_trainer_decay_says_where_it_differs_and_matches_after_set_no_decay(tmp_path, caplog):
    """transformers' Trainer, building its optimizer itself, leaves biases and norm weights
    undecayed (two groups); offload's optimizer decayed them too: 1.5e-2 off the Trainer's norm
    weights after 3 steps at decay 0.5. One warning says so and how to match; after
    ``optimizer.set_no_decay`` with the Trainer's names it says nothing and trains as the
    Trainer (losses, grad norms, weights)."""
    from transformers import Trainer  # noqa: PLC0415

    d, wd = write_model(tmp_path / "m"), 0.5
    args = dict(weight_decay=wd, optim="adamw_torch")
    ref = AutoModelForCausalLM.from_pretrained(d)
    plain = Trainer(model=ref, args=_trainer_args(tmp_path / "r", **args), train_dataset=_dataset())
    plain.train()
    cfg = nvme_config(tmp_path, "nvme", "nvme")
    cfg["optimizer"].update(lr=LR, weight_decay=wd)
    model, opt = offload.from_pretrained(d, cfg)
    try:
        with caplog.at_level(logging.WARNING, logger="offload"):
            trainer = offload.OffloadTrainer(
                model=model, args=_trainer_args(tmp_path / "a", **args),
                train_dataset=_dataset(), optimizers=(opt, None),
            )  # fmt: skip
        said = [r.getMessage() for r in caplog.records if "undecayed" in r.getMessage()]
        assert len(said) == 1 and "weight_decay=0.5 offload's optimizer decays" in said[0], said
        assert "norm.weight" in said[0] and "set_no_decay" in said[0]
        decayed = trainer.get_decay_parameter_names(model)
        opt.set_no_decay(p for n, p in model.named_parameters() if n not in decayed)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="offload"):
            trainer = offload.OffloadTrainer(
                model=model, args=_trainer_args(tmp_path / "b", **args),
                train_dataset=_dataset(), optimizers=(opt, None),
            )  # fmt: skip
        assert "undecayed" not in caplog.text
        trainer.train()
        (losses, norms), (ref_losses, ref_norms) = _history(trainer), _history(plain)
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0
        )
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
        got = model.state_dict()
        for name, want in ref.state_dict().items():
            torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        opt.close()


def test_from_pretrained_freezes_before_wrap(tmp_path):
    """``before_wrap`` runs on the meta-device model before wrap fixes which parameters train:
    the frozen embedding stays as loaded through steps on NVMe (frozen after wrap it moved)."""
    d = write_model(tmp_path / "m")

    def freeze(model):
        model.get_input_embeddings().weight.requires_grad_(False)

    model, opt = offload.from_pretrained(
        d, nvme_config(tmp_path, "nvme", "nvme"), before_wrap=freeze
    )
    try:
        before = model.state_dict()["model.embed_tokens.weight"].clone()
        ids = torch.randint(3, VOCAB, (2, 12))
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        after = model.state_dict()
        assert torch.equal(after["model.embed_tokens.weight"], before)
        loaded = AutoModelForCausalLM.from_pretrained(d).state_dict()
        assert not torch.equal(after["lm_head.weight"], loaded["lm_head.weight"])  # trained
    finally:
        opt.close()


def test_from_pretrained_returns_the_model_in_eval_mode_as_transformers(tmp_path):
    """transformers' ``from_pretrained`` returns the model in eval mode (dropout off); offload's
    returned it in training mode, so an evaluation or ``generate`` straight after loading ran
    with dropout on: logits differed from the same directory loaded by transformers."""
    torch.manual_seed(0)
    config = hf_config()
    config.attention_dropout = 0.5
    d = tmp_path / "m"
    AutoModelForCausalLM.from_config(config).save_pretrained(d)
    ref = AutoModelForCausalLM.from_pretrained(d)
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path, "nvme", "nvme"))
    try:
        assert [n for n, m in model.named_modules() if m.training] == []
        assert not ref.training
        ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    finally:
        opt.close()


def test_trainer_refuses_a_model_its_optimizer_does_not_train(tmp_path):
    """A model that is not the one the optimizer was built for trained nothing and failed at
    the first step with "no backward since the last step" (now: "before any backward")."""
    d = write_model(tmp_path / "m")
    _, opt = offload.from_pretrained(d, nvme_config(tmp_path, "none", "cpu"))
    try:
        with pytest.raises(TypeError, match="neither is nor holds the model this optimizer"):
            offload.OffloadTrainer(
                model=AutoModelForCausalLM.from_pretrained(d), args=_trainer_args(tmp_path / "o"),
                train_dataset=_dataset(), optimizers=(opt, None),
            )  # fmt: skip
    finally:
        opt.close()


def test_clipping_offload_s_parameters_with_torch_is_an_error(tmp_path):
    from transformers import Trainer  # noqa: PLC0415

    d = write_model(tmp_path / "m")
    # gradients in .grad (CPU, fp32, optimizer on the CPU): torch's clipping works, no error
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path / "a", "none", "cpu"))
    try:
        _loss(model, _batches(1)[0]).backward()
        assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) > 0
    finally:
        opt.close()
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path / "b", "nvme", "nvme"))
    try:
        _loss(model, _batches(1)[0]).backward()
        for clip in (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_):
            with pytest.raises(ClipError, match=r"optimizer\.clip_grad_norm_\(max_norm\)"):
                clip(model.parameters(), 1.0)
        with pytest.raises(ClipError, match="NVMe shards"):
            torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)
        with pytest.raises(ClipError, match="all of a wrapped model's gradients together"):
            offload.api.clipping.clip_grad_norm_(list(model.parameters())[:3], 1.0)
        opt.zero_grad()
        trainer = Trainer(
            model=model,
            args=_trainer_args(tmp_path / "o"),
            train_dataset=_dataset(),
            optimizers=(opt, None),
        )
        with pytest.raises(ClipError, match="offload.OffloadTrainer"):
            trainer.train()  # a plain Trainer would log grad_norm 0.0 and never clip
    finally:
        opt.close()
    # a closed model is not guarded any more
    assert float(torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0)) == 0


def test_an_unrouted_accelerator_refuses_to_clip_offload_s_parameters(tmp_path):
    """Accelerate's own clip_grad_norm_ no longer goes through torch's (it clips the parameters
    whose .grad is set): unrouted, it would return a norm of 0 for offload's parameters and
    clip nothing, so it is guarded too; other parameters still go through it."""
    from accelerate import Accelerator  # noqa: PLC0415

    d = write_model(tmp_path / "m")
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path, "nvme", "nvme"))
    try:
        acc = Accelerator(cpu=True, device_placement=False)
        _loss(model, _batches(1)[0]).backward()
        with pytest.raises(ClipError, match=r"accelerate\.Accelerator\.clip_grad_norm_"):
            acc.clip_grad_norm_(model.parameters(), 1.0)
        other = torch.nn.Linear(2, 1)
        other(torch.ones(1, 2)).sum().backward()
        assert float(acc.clip_grad_norm_(other.parameters(), 1.0)) > 0
        opt.zero_grad()
    finally:
        opt.close()


@pytest.mark.heavy  # (a child process; torch's clipping guard stays in the default suite)
def test_accelerate_imported_after_wrap_is_guarded_too(tmp_path):
    """The guard is installed at the first wrap; Accelerate imported only later (a Trainer
    imported further down a script of a plain torch model) is guarded as it loads, without
    offload importing it first (clipping.py's Note on the guard), also after something asked
    for its spec without loading it. A fresh process: here it is imported already."""
    script = f"""
import sys
from pathlib import Path
import offload
from offload.api.clipping import ClipError
from offload.demo.model import GPT, config_for_size
nvme = {{"device": "nvme", "nvme_path": {str(tmp_path)!r}}}
model, opt = offload.wrap(GPT(config_for_size("tiny")), {{"offload_optimizer": nvme}})
assert "accelerate" not in sys.modules
import importlib.util
assert importlib.util.find_spec("accelerate")  # as transformers asks whether it is installed
from accelerate import Accelerator
try:
    Accelerator(cpu=True, device_placement=False).clip_grad_norm_(model.parameters(), 1.0)
except ClipError:
    print("refused")
finally:
    opt.close()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["refused"], out.stdout


def test_accelerate_loop_clips_through_route_clipping(tmp_path):
    from accelerate import Accelerator  # noqa: PLC0415

    d = write_model(tmp_path / "m")
    ref_model = AutoModelForCausalLM.from_pretrained(d)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    model, opt = offload.from_pretrained(d, nvme_config(tmp_path, "nvme", "nvme"))
    try:
        acc = Accelerator(cpu=True, device_placement=False)
        offload.route_clipping(acc)
        p_model, p_opt = acc.prepare(model, opt)
        for x in _batches(3):
            norms = []
            for m, o, clip in (
                (ref_model, ref_opt, torch.nn.utils.clip_grad_norm_),
                (p_model, p_opt, acc.clip_grad_norm_),
            ):
                _loss(m, x).backward()
                norms.append(float(clip(m.parameters(), CLIP)))
                o.step()
                o.zero_grad()
            assert norms[0] > CLIP and norms[1] == pytest.approx(norms[0], rel=1e-5)
    finally:
        opt.close()


# peft 0.21's get_peft_model asks transformers 5 for its deprecated is_gradient_checkpointing
_PEFT_ASKS_DEPRECATED = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)


@pytest.mark.heavy
@_PEFT_ASKS_DEPRECATED
def test_peft_lora_through_offload_trainer_matches_the_plain_trainer(tmp_path):
    """The README's PEFT recipe (peft: the hf extra's since 2026-12-06, skipped without it):
    wrap ``peft_model.get_base_model()``, give ``OffloadTrainer`` the PeftModel. Params and
    optimizer on NVMe (the step in backward), accumulation 2, clipping: the losses and the
    adapters ``save_model`` writes are the plain Trainer's, and greedy ``generate`` too."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: PLC0415

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(LlamaForCausalLM(cfg), lora)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # (LoRA starts at zero; here it must not)
            torch.nn.init.normal_(p, std=0.1)
    ref = copy.deepcopy(model)
    ref.save_pretrained(str(tmp_path / "init"))  # the adapters before training
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(3, 64, (12,), generator=g) for _ in range(16)]
    data = [{"input_ids": t, "labels": t} for t in tokens]

    def args(out):
        return TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=4, learning_rate=1e-2, weight_decay=0.0, max_grad_norm=1.0,
            lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
            use_cpu=True, seed=0, disable_tqdm=True,
        )  # fmt: skip

    config = nvme_config(tmp_path, "nvme", "nvme") | {"gradient_accumulation_steps": 2}
    config["optimizer"] = {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0}
    config["wrap"] = {"module_classes": ["LlamaDecoderLayer"]}
    _, opt = offload.wrap(model.get_base_model(), config)
    try:
        ours = offload.OffloadTrainer(
            model=model, args=args(tmp_path / "a"), train_dataset=data, optimizers=(opt, None)
        )
        ours.train()
        ours.save_model(str(tmp_path / "a_out"))
        ref_opt = torch.optim.AdamW(
            [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0,
            foreach=False,
        )  # fmt: skip
        theirs = Trainer(
            model=ref, args=args(tmp_path / "b"), train_dataset=data, optimizers=(ref_opt, None)
        )
        theirs.train()
        theirs.save_model(str(tmp_path / "b_out"))
        assert _history(ours)[0] == pytest.approx(_history(theirs)[0], rel=1e-5)
        got = load_file(tmp_path / "a_out" / "adapter_model.safetensors")
        want = load_file(tmp_path / "b_out" / "adapter_model.safetensors")
        assert got.keys() == want.keys()
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
        prompt = torch.stack(tokens[:2])[:, :4]
        mask = torch.ones_like(prompt)
        assert torch.equal(
            model.generate(
                input_ids=prompt, attention_mask=mask, max_new_tokens=5, do_sample=False
            ),
            ref.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=5, do_sample=False),
        )
        # loading adapters back (load_best_model_at_end does so): a strict=False load of the
        # wrapped model's part, which loaded nothing (the last adapters stayed, 0.020 off)
        model.load_adapter(str(tmp_path / "init"), adapter_name="default")
        init = load_file(tmp_path / "init" / "adapter_model.safetensors")
        values = {k: v for k, v in model.state_dict().items() if "lora_" in k}
        assert len(values) == len(init)
        for k, v in values.items():
            want = init[k.replace(".default", "")]
            torch.testing.assert_close(v, want, rtol=0, atol=0, msg=k)
    finally:
        opt.close()


@pytest.mark.heavy
@pytest.mark.parametrize("param_dev,opt_dev", [("none", "cpu"), ("nvme", "nvme")])
def test_trainer_on_two_ranks_trains_as_one_process(tmp_path, param_dev, opt_dev):
    """Under torchrun, Accelerate wrapped the model in DistributedDataParallel: its hooks
    reduce gradients offload reduces itself, and its zero_grad does not reach offload's, so the
    Trainer's second step was refused on every rank (``loss.backward() after optimizer.step()
    with no zero_grad()``); and the Trainer saved its checkpoints' state dicts on rank 0 alone,
    where offload's gather from every rank (gloo aborted a process at the first checkpoint).
    Now two ranks at a per-device batch of 1, saving a checkpoint every 2 steps, log the losses
    and grad norms of one process at 2 and end at its weights (stages 2 and 3: params on the
    device, and on NVMe), and a resume from the checkpoint of step 2 ends bitwise there."""
    import os  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    d = write_model(tmp_path / "m")
    worker = str(Path(__file__).parent / "_trainer_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ranks = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]

    def run(cmd, mode):
        done = subprocess.run(
            [*cmd, worker, str(d), str(tmp_path), param_dev, opt_dev, mode],
            capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
        return done

    for cmd, mode in (([sys.executable], "plain"), (ranks, "save"), (ranks, "resume")):
        done = run(cmd, mode)
        assert done.returncode == 0, done.stderr[-3000:]
    result = {
        m: json.loads((tmp_path / f"result.{m}.json").read_text()) for m in ("plain.w1", "save.w2")
    }
    one, two = result["plain.w1"], result["save.w2"]
    assert len(two["losses"]) == 5 and sorted(p.name for p in (tmp_path / "trainer.w2").iterdir()) == [
        "checkpoint-2", "checkpoint-4", "checkpoint-5"
    ]  # fmt: skip
    assert (tmp_path / "trainer.w2" / "checkpoint-2" / "offload_state" / "latest").is_file()
    torch.testing.assert_close(
        torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(
        torch.tensor(two["norms"]), torch.tensor(one["norms"]), rtol=1e-5, atol=0
    )
    want, got, resumed = (
        torch.load(tmp_path / f"state.{m}.pt") for m in ("plain.w1", "save.w2", "resume.w2")
    )
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
        assert torch.equal(resumed[name], got[name]), name
    if param_dev != "none":
        return
    # wrapped before the group existed: each rank would train a model of its own, unsaid
    env["GROUP_AFTER_WRAP"] = "1"
    done = run(ranks, "plain")
    assert done.returncode != 0
    assert "the Trainer runs 2 processes but the model was wrapped over 1 rank" in done.stderr


@_PEFT_ASKS_DEPRECATED
def test_peft_merge_and_unload_is_refused_until_close_restore(tmp_path):
    """``merge_and_unload`` reads and writes the LoRA and base weights themselves, which offload
    releases between uses: it merged the released storage's zeros and replaced the LoRA layers,
    so the merged model ran (and transformers' ``save_pretrained`` saved it) without the
    adapters, 0.26 off, and ``offload.save_pretrained`` raised a bare ``KeyError``;
    ``merge_adapter`` (layers kept) gave logits 0.41 off. Refused now at the next use, the
    trained values still saved by a checkpoint; after ``optimizer.close(restore=True)`` the
    merge is torch's."""
    peft = pytest.importorskip("peft")

    def lora_model():
        torch.manual_seed(0)
        lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(AutoModelForCausalLM.from_config(hf_config()), lora)

    def train(model, opt):
        for x in _batches(2):
            _loss(model, x).backward()
            opt.step()
            opt.zero_grad()

    ref = lora_model()
    train(ref, torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR))
    x = _batches(1)[0]
    with torch.no_grad():
        logits = ref(input_ids=x).logits
    want = ref.merge_and_unload().state_dict()
    for close_first in (False, True):
        model = lora_model()
        cfg = nvme_config(tmp_path / str(close_first), "cpu", "cpu")
        cfg["optimizer"]["weight_decay"] = 0.01  # (torch's AdamW default)
        _, opt = offload.wrap(model.get_base_model(), cfg)
        try:
            train(model, opt)
            if close_first:
                opt.close(restore=True)
                merged = model.merge_and_unload()
                for k, v in merged.state_dict().items():
                    torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=k)
                continue
            model.merge_adapter()  # (the layers stay: it merged zeros, the adapters skipped)
            with pytest.raises(PhaseError, match=r"merged into 4 layer.*unmerge_adapter\(\)"):
                model(input_ids=x)
            model.unmerge_adapter()
            with torch.no_grad():
                torch.testing.assert_close(model(input_ids=x).logits, logits, rtol=1e-5, atol=1e-5)
            merged = model.merge_and_unload()
            refused = r"no longer in the model .*merge_and_unload.*close\(restore=True\)"
            with pytest.raises(PhaseError, match=refused):
                merged(input_ids=x)
            with pytest.raises(PhaseError, match=refused):
                merged.state_dict()
            with pytest.raises(PhaseError, match=refused):
                offload.save_pretrained(merged, tmp_path / "merged")
            with pytest.raises(PhaseError, match=refused):
                opt.step()
            offload.save_checkpoint(tmp_path / "ckpt", merged, opt)  # (the trained values)
        finally:
            opt.close()


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_resize_token_embeddings_after_wrap_is_refused_naming_the_resize(tmp_path, tie):
    """``resize_token_embeddings`` after ``wrap`` sets the embedding's new table through
    ``p.data = ...`` and replaces an untied output layer: refused at the next forward, but the
    message spoke of ``p.data`` and ``vector_to_parameters``, or of PEFT's merge, not of the
    resize. It names the resize, the shapes, and what is not put back (the config's
    ``vocab_size``)."""
    model = AutoModelForCausalLM.from_config(hf_config("llama", tie=tie))
    _, opt = offload.wrap(model, nvme_config(tmp_path, "cpu", "cpu"))
    try:
        vocab = model.config.vocab_size
        model.resize_token_embeddings(vocab + 8, mean_resizing=False)
        x = _batches(1)[0]
        if tie:
            said = (
                rf"resized after offload.wrap \(model\.embed_tokens\.weight \[{vocab}, \d+\] "
                rf"-> \[{vocab + 8}, \d+\]; transformers' resize_token_embeddings\(\).*"
                r"vocab_size\) is not put back. Resize before offload.wrap"
            )
        else:
            said = r"no longer in the model \(lm_head\.weight\).*resize_token_embeddings\(\)"
        with pytest.raises(PhaseError, match=said):
            model(input_ids=x)
    finally:
        opt.close()


@_PEFT_ASKS_DEPRECATED
def test_peft_prompt_tuning_saves_through_offload_trainer(tmp_path):
    """Prompt tuning trains parameters of the PeftModel itself, so the PeftModel is wrapped
    whole; its ``save_pretrained`` computes the embeddings it saves by calling its prompt
    encoder (a part of the root unit) by itself, with gradients on: refused, so
    ``OffloadTrainer.save_model`` raised after training. It saves under ``no_grad`` now, the
    plain Trainer's file; a direct call with gradients on says to use ``torch.no_grad()``, and
    wrapping ``get_base_model()`` (the LoRA recipe; nothing trains there) wraps it for forwards
    only, and its first step says what to wrap."""
    peft = pytest.importorskip("peft")
    from transformers import Trainer  # noqa: PLC0415

    def prompt_model():
        torch.manual_seed(0)
        prompt = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
        return peft.get_peft_model(AutoModelForCausalLM.from_config(hf_config()), prompt)

    args = dict(max_steps=2, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0)
    model = prompt_model()
    cfg = nvme_config(tmp_path, "cpu", "cpu")
    cfg["optimizer"].update(lr=LR, weight_decay=0.0)
    base, opt = offload.wrap(model.get_base_model(), cfg)  # wrapped for forwards only
    try:
        assert not base(torch.randint(0, 8, (1, 5))).logits.requires_grad  # (nothing trains)
        with pytest.raises(PhaseError, match="no trainable parameters.*wrap the PeftModel"):
            opt.step()
    finally:
        opt.close(restore=True)
    _, opt = offload.wrap(model, cfg)
    try:
        trainer = offload.OffloadTrainer(
            model=model, args=_trainer_args(tmp_path / "o", **args), train_dataset=_dataset(),
            optimizers=(opt, None),
        )  # fmt: skip
        trainer.train()
        trainer.save_model(tmp_path / "o_out")
        with pytest.raises(RuntimeError, match=r"under torch\.no_grad\(\)"):
            model.save_pretrained(tmp_path / "direct")
    finally:
        opt.close()
    ref = prompt_model()
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.0
    )
    ref_trainer = Trainer(
        model=ref, args=_trainer_args(tmp_path / "r", **args), train_dataset=_dataset(),
        optimizers=(ref_opt, None),
    )  # fmt: skip
    ref_trainer.train()
    ref_trainer.save_model(tmp_path / "r_out")
    got = load_file(tmp_path / "o_out" / "adapter_model.safetensors")
    want = load_file(tmp_path / "r_out" / "adapter_model.safetensors")
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
