"""``offload finetune`` end to end on the CPU: a tiny random Llama, a tokenizer built here with
the ``tokenizers`` library, JSONL data; checkpoints, an interrupted run resumed bitwise, the
Hugging Face export loaded back by ``transformers``."""

from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import WORDS, write_model, write_tokenizer  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from offload.cli.main import main  # noqa: E402
from offload.demo.report import read_metrics  # noqa: E402
from offload.finetune import Options, finetune, load_data  # noqa: E402
from offload.finetune.data import IGNORE  # noqa: E402

CONFIG = """\
device: cpu
dtype: fp32
offload_param: {device: nvme, buffer_count: 4, buffer_size: 16KiB, persistence_threshold: 0}
offload_optimizer: {device: nvme, buffer_count: 8, buffer_size: 16KiB}
"""


@pytest.fixture
def setup(tmp_path):
    model = write_model(tmp_path / "model")
    write_tokenizer(model)
    rng = random.Random(0)
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(40):
            prompt = " ".join(rng.choice(WORDS) for _ in range(5))
            f.write(json.dumps({"prompt": prompt, "completion": "yes the cat sat"}) + "\n")
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    return tmp_path


def _args(t, out, *extra):
    return [
        "finetune", "--model", str(t / "model"), "--data", str(t / "data.jsonl"),
        "--out", str(out), "--config", str(t / "cfg.yaml"), "--steps", "6", "--seq-len", "16",
        "--batch", "2", "--accum", "2", "--lr", "1e-2", "--warmup", "2", "--save-every", "2",
        "--gradient-checkpointing", "--no-progress", *extra,
    ]  # fmt: skip


def _steps(out):
    return [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "step"]


def test_finetune_end_to_end_and_resume_bitwise(setup):
    t = setup
    assert main(_args(t, t / "a")) == 0
    full = _steps(t / "a")
    assert [r["step"] for r in full] == [1, 2, 3, 4, 5, 6]
    assert full[-1]["loss"] < full[0]["loss"]
    assert all(r["grad_norm"] > 0 for r in full) and full[0]["lr"] == 0.0  # warm-up from 0
    assert (t / "a" / "report.png").stat().st_size > 10_000
    kinds = [r["kind"] for r in read_metrics(t / "a" / "metrics.jsonl")]
    assert kinds[0] == "run" and kinds[-1] == "summary"

    # the export is a Hugging Face directory transformers loads, tokenizer included
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    hf = t / "a" / "hf"
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf)
    ids = torch.tensor([tok("the cat sat")["input_ids"]])
    assert torch.isfinite(model(input_ids=ids).logits).all()

    # the same run, stopped (as by Ctrl-C) after step 3: the last checkpoint is step 2's
    opts = Options(
        model=str(t / "model"), data=str(t / "data.jsonl"), out=str(t / "b"),
        config=str(t / "cfg.yaml"), steps=6, seq_len=16, batch=2, accum=2, lr=1e-2, warmup=2,
        save_every=2, gradient_checkpointing=True, progress=False,
    )  # fmt: skip

    def stop(rec):
        if rec["step"] == 3:
            raise KeyboardInterrupt

    assert finetune(opts, on_step=stop) == 130
    assert not (t / "b" / "hf").exists()
    assert [r["step"] for r in _steps(t / "b")] == [1, 2, 3]
    assert (t / "b" / "checkpoints" / "latest").read_text().startswith("ckpt-00000002")
    # resumed: steps 3-6 recomputed exactly as the uninterrupted run computed them
    assert main(_args(t, t / "b", "--resume")) == 0
    resumed = _steps(t / "b")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full, resumed):
        assert (a["loss"], a["lr"], a["grad_norm"]) == (b["loss"], b["lr"], b["grad_norm"])
    for name, tensor in load_file(t / "a" / "hf" / "model.safetensors").items():
        assert torch.equal(tensor, load_file(t / "b" / "hf" / "model.safetensors")[name]), name


def test_resume_refuses_another_run(setup, capsys):
    t = setup
    assert main(_args(t, t / "a", "--resume")) == 2
    assert "--resume: no checkpoint in" in capsys.readouterr().err
    assert main([*_args(t, t / "a"), "--steps", "2"]) == 0  # the last --steps wins
    assert main([*_args(t, t / "a", "--resume"), "--seq-len", "8"]) == 2
    assert "the checkpoint's run had seq_len=16" in capsys.readouterr().err


def test_a_resume_knows_its_data_by_content_not_by_path(setup, capsys):
    """The data was named by its absolute path: a byte-identical copy elsewhere (data staged
    into a requeued job's scratch directory) was refused, and the file edited in place was
    resumed without a word. Its packed tokens name it now."""
    import shutil  # noqa: PLC0415

    t = setup
    assert main([*_args(t, t / "a"), "--steps", "2", "--save-every", "1"]) == 0
    (t / "staged").mkdir()
    shutil.copy(t / "data.jsonl", t / "staged" / "data.jsonl")
    args = _args(t, t / "a", "--resume", "--steps", "3")
    args[args.index(str(t / "data.jsonl"))] = str(t / "staged" / "data.jsonl")
    assert main(args) == 0, capsys.readouterr().err
    assert [r["step"] for r in _steps(t / "a")] == [1, 2, 3]
    edited = (t / "data.jsonl").read_text().replace("the", "a")
    (t / "staged" / "data.jsonl").write_text(edited)
    args[args.index("3")] = "4"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--resume: the checkpoint's run had data='tokens sha256:" in err, err


def test_data_formats(tmp_path):
    from transformers import AutoTokenizer  # noqa: PLC0415

    write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    eos = tok.eos_token_id
    (tmp_path / "pc.jsonl").write_text(
        json.dumps({"prompt": "what is the cat", "completion": "a cat"}) + "\n"
    )
    pc = load_data(tmp_path / "pc.jsonl", tok, 4)
    ids, labels = pc.input_ids.flatten().tolist(), pc.labels.flatten().tolist()
    assert pc.format == "prompt/completion" and len(ids) == 4  # 7 tokens: one sequence of 4
    prompt = tok("what is the cat", add_special_tokens=False)["input_ids"]
    assert ids == prompt and labels == [IGNORE] * 4  # the prompt is not trained on
    whole = load_data(tmp_path / "pc.jsonl", tok, 7)
    assert whole.labels.flatten().tolist() == [IGNORE] * 4 + [*tok("a cat")["input_ids"], eos]

    (tmp_path / "t.jsonl").write_text(
        "\n".join(json.dumps({"text": w}) for w in ("the cat", "a dog"))
    )
    text = load_data(tmp_path / "t.jsonl", tok, 6)
    assert text.format == "jsonl text"
    assert text.input_ids.flatten().tolist() == text.labels.flatten().tolist()
    assert text.input_ids.flatten().tolist()[2] == eos and len(text) == 1

    (tmp_path / "plain.txt").write_text("the cat sat\non the mat\n\nthe dog ran\n")
    plain = load_data(tmp_path / "plain.txt", tok, 2)
    assert plain.format == "text" and plain.documents == 2 and len(plain) == 5  # 11 tokens

    # JSON allows U+2028, U+2029 and U+0085 raw inside a string (ensure_ascii=False writes
    # them so): the file was split at them too and refused as "not JSON"
    raw = [{"text": "the cat\u2028sat"}, {"text": "on\u2029the\x85mat"}]
    (tmp_path / "raw.jsonl").write_text(
        "\r\n".join(json.dumps(r, ensure_ascii=False) for r in raw), encoding="utf-8"
    )
    got = load_data(tmp_path / "raw.jsonl", tok, 4)
    want = [*tok(raw[0]["text"])["input_ids"], eos, *tok(raw[1]["text"])["input_ids"], eos]
    assert got.format == "jsonl text" and got.documents == 2
    assert got.input_ids.flatten().tolist() == want[: len(want) // 4 * 4]

    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"x": 1}))
    with pytest.raises(ValueError, match=r"bad\.jsonl' line 2: expected string values for 'text'"):
        load_data(tmp_path / "bad.jsonl", tok, 4)
    (tmp_path / "keys.jsonl").write_text(json.dumps({"question": "a"}))
    with pytest.raises(ValueError, match=r"line 1 has keys \['question'\]"):
        load_data(tmp_path / "keys.jsonl", tok, 4)
    # a first record that is not JSON was trained on as plain text, braces and all
    for name in ("comma.jsonl", "comma.txt"):
        (tmp_path / name).write_text('{"text": "the cat",}\n' + json.dumps({"text": "a"}))
        with pytest.raises(ValueError, match=rf"{name}' line 1 is not JSON \(Expecting"):
            load_data(tmp_path / name, tok, 4)
    (tmp_path / "words.jsonl").write_text("the cat sat\n")  # named .jsonl, no JSON
    with pytest.raises(ValueError, match=r"words\.jsonl' line 1 is not JSON"):
        load_data(tmp_path / "words.jsonl", tok, 4)
    (tmp_path / "array.json").write_text(json.dumps([{"text": "the cat"}, {"text": "a"}]))
    with pytest.raises(ValueError, match=r"array\.json' line 1 is a JSON list, not an object"):
        load_data(tmp_path / "array.json", tok, 4)


def _first_norm(out):
    return _steps(out)[0]["grad_norm"]


def test_fp16_scales_the_loss(setup):
    """fp16 compute: the recipe's backward is of the scaled loss (``optimizer.scale_loss``);
    a plain ``loss.backward()`` left the gradients, the logged norm and the clipping 65536x
    small. The first step's norm follows the fp32 run's to fp16's precision."""
    t = setup
    (t / "fp16.yaml").write_text(CONFIG.replace("dtype: fp32", "dtype: fp16"))
    assert main([*_args(t, t / "a"), "--steps", "1", "--save-every", "0"]) == 0
    fp16 = [
        *_args(t, t / "b"),
        "--steps",
        "1",
        "--save-every",
        "0",
        "--config",
        str(t / "fp16.yaml"),
    ]
    assert main(fp16) == 0
    assert _first_norm(t / "b") == pytest.approx(_first_norm(t / "a"), rel=0.05)


def test_a_new_run_into_an_out_holding_one_is_refused(setup, capsys):
    """Without --resume, an OUT with another run's checkpoints or export was trained into: its
    checkpoints pruned (keep_last), two runs mixed. Refused, nothing there changed."""
    t = setup
    assert main([*_args(t, t / "a"), "--steps", "2", "--save-every", "1"]) == 0
    before = {p: p.stat().st_mtime_ns for p in (t / "a").rglob("*")}
    assert main([*_args(t, t / "a"), "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert f"--out '{t / 'a'}' already holds a run" in err and "--resume" in err
    assert {p: p.stat().st_mtime_ns for p in (t / "a").rglob("*")} == before
    # another tool's checkpoints there (DeepSpeed's latest -> global_step100), or a file where
    # the checkpoints go: found at the first save, after --save-every steps of training
    (t / "ds" / "checkpoints" / "global_step100").mkdir(parents=True)
    (t / "ds" / "checkpoints" / "latest").write_text("global_step100")
    (t / "f").mkdir()
    (t / "f" / "checkpoints").write_text("a file")
    for out, says in (("ds", "already holds a run (checkpoints/latest)"), ("f", "is a file")):
        assert main(_args(t, t / out)) == 2
        err = capsys.readouterr().err
        assert says in err, err
        assert not (t / out / "metrics.jsonl").exists()  # refused before training


def test_the_config_s_lr_and_accumulation_are_used_unless_a_flag_says_otherwise(setup, capsys):
    """``--lr`` and ``--accum`` defaults replaced the config's ``optimizer.lr`` and
    ``gradient_accumulation_steps`` silently; now the file's values hold unless a flag is
    given, and a flag that overrides the file says so."""
    t = setup
    (t / "set.yaml").write_text(CONFIG + "optimizer: {lr: 0.003}\ngradient_accumulation_steps: 3\n")
    args = _args(t, t / "a")
    for flag in ("--lr", "--accum"):
        i = args.index(flag)
        del args[i : i + 2]
    args[args.index(str(t / "cfg.yaml"))] = str(t / "set.yaml")
    assert main([*args, "--steps", "3", "--save-every", "0", "--warmup", "0"]) == 0
    run = next(r for r in read_metrics(t / "a" / "metrics.jsonl") if r["kind"] == "run")
    assert run["config"]["optimizer"]["lr"] == 0.003 and run["accum"] == 3
    assert _steps(t / "a")[0]["lr"] == 0.003
    assert main([*args, "--out", str(t / "b"), "--steps", "1", "--lr", "0.02"]) == 0
    assert "--lr 0.02 overrides optimizer.lr=0.003" in capsys.readouterr().err
    run = next(r for r in read_metrics(t / "b" / "metrics.jsonl") if r["kind"] == "run")
    assert run["config"]["optimizer"]["lr"] == 0.02 and run["accum"] == 3


@pytest.mark.parametrize("bad", ["missing", "no-config", "no-tokenizer"])
def test_a_model_directory_that_is_not_one_is_named(setup, capsys, bad):
    """It said it could not reach huggingface.co (a missing directory) or to install
    sentencepiece (no tokenizer files), and made OUT first."""
    t = setup
    model = t / bad
    if bad != "missing":
        model.mkdir()
        (model / "config.json").write_text((t / "model" / "config.json").read_text())
    if bad == "no-config":
        (model / "config.json").unlink()
    args = _args(t, t / "out")
    args[args.index(str(t / "model"))] = str(model)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--model '{model}'" in err
    assert {
        "missing": "no such directory",
        "no-config": "no config.json",
        "no-tokenizer": "no tokenizer",
    }[bad] in err
    assert not (t / "out").exists()


def test_an_export_directory_that_cannot_be_written_fails_before_training(setup, capsys):
    """It was found after the whole run, whose trained weights were then lost."""
    t = setup
    (t / "a").mkdir()
    (t / "a" / "hf").write_text("a file where the export goes")
    assert main(_args(t, t / "a")) == 2
    assert f"the export directory '{t / 'a' / 'hf'}' is not writable" in capsys.readouterr().err
    assert not (t / "a" / "metrics.jsonl").exists()


def test_a_deepspeed_config_without_nvme_path_swaps_in_out(setup):
    """As an offload-format config does: the NVMe sections get OUT/swap (a DeepSpeed config
    was refused for its missing nvme_path), whatever the case of their ``device`` (which the
    loader accepts in any case: "NVMe" was refused for the nvme_path it did not get)."""
    t = setup
    (t / "ds.json").write_text(
        json.dumps(
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "NVMe", "buffer_count": 4, "buffer_size": 4096},
                    "offload_optimizer": {"device": " nvme", "buffer_count": 8},
                }
            }
        )
    )
    args = _args(t, t / "a")
    args[args.index(str(t / "cfg.yaml"))] = str(t / "ds.json")
    assert main([*args, "--steps", "1", "--save-every", "0"]) == 0
    run = next(r for r in read_metrics(t / "a" / "metrics.jsonl") if r["kind"] == "run")
    for section in ("offload_param", "offload_optimizer"):
        assert run["config"][section]["nvme_path"] == str(t / "a" / "swap"), section


def test_seed_makes_dropout_the_same_run_to_run(setup):
    """``--seed`` also seeds torch's generator (dropout, weights the checkpoint lacks), as the
    HF Trainer's ``seed`` does: two runs with one seed train alike whatever the process's
    generator held before; before, only the data order followed it."""
    t = setup
    config = json.loads((t / "model" / "config.json").read_text())
    (t / "model" / "config.json").write_text(json.dumps(dict(config, attention_dropout=0.5)))
    trained = []
    for before, out in ((1, "a"), (2, "b")):
        torch.manual_seed(before)
        assert main(_args(t, t / out, "--steps", "2", "--save-every", "0", "--no-report")) == 0
        trained.append(load_file(t / out / "hf" / "model.safetensors"))
    a, b = trained
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "flag,value,said",
    [
        ("--warmup", "-2", "--warmup must be >= 0, got -2"),
        ("--save-every", "-1", "--save-every must be >= 0, got -1"),
        ("--max-grad-norm", "-1", "--max-grad-norm must be >= 0, got -1.0"),  # was: no clipping
        ("--max-grad-norm", "nan", "--max-grad-norm must be >= 0, got nan"),
        ("--lr", "0", "--lr must be a finite number > 0, got 0.0"),
        ("--epochs", "0", "--epochs must be a finite number > 0, got 0.0"),  # was: one step
    ],
)
def test_a_bad_flag_is_named_before_anything_is_made(setup, capsys, flag, value, said):
    t = setup
    args = _args(t, t / "out")
    if flag == "--epochs":
        i = args.index("--steps")
        del args[i : i + 2]
    assert main([*args, flag, value]) == 2
    assert said in capsys.readouterr().err
    assert not (t / "out").exists()


def test_a_model_that_is_not_a_causal_lm_is_refused(setup, capsys):
    """The recipe trains a causal LM (labels = the tokens). ``from_pretrained`` builds the class
    ``config.json`` names, so a seq2seq or masked-LM directory would have trained as something
    else without a word (BERT's masked LM had been built as the decoder ``BertLMHeadModel``);
    it is refused before anything is read, naming the class."""
    import transformers  # noqa: PLC0415

    t = setup
    config = transformers.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip
    transformers.BertForMaskedLM(config).save_pretrained(t / "mlm")
    write_tokenizer(t / "mlm")
    args = _args(t, t / "out")
    args[args.index("--model") + 1] = str(t / "mlm")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "BertForMaskedLM" in err and "causal LM" in err and "AutoModelForCausalLM" in err
    assert not (t / "out" / "checkpoints").exists()
