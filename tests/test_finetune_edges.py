"""``offload finetune`` on inputs a user meets: a JSONL file with a byte-order mark, packed
windows inside long prompts, an ``OUT`` that has a ``swap`` folder of its own, a resume asked
for fewer steps than its checkpoint's, a config that sets ``gradient_clipping`` or weight
decay."""

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

CPU = "device: cpu\ndtype: fp32\n"


@pytest.fixture
def setup(tmp_path):
    model = write_model(tmp_path / "model")
    write_tokenizer(model)
    rng = random.Random(0)
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(40):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(12))}) + "\n")
    (tmp_path / "cfg.yaml").write_text(CPU)
    return tmp_path


def _args(t, out, *extra):
    return [
        "finetune", "--model", str(t / "model"), "--data", str(t / "data.jsonl"),
        "--out", str(out), "--config", str(t / "cfg.yaml"), "--steps", "2", "--seq-len", "16",
        "--batch", "2", "--lr", "1e-2", "--no-progress", "--no-report", *extra,
    ]  # fmt: skip


def _tokenizer(t):
    from transformers import AutoTokenizer  # noqa: PLC0415

    return AutoTokenizer.from_pretrained(t / "model")


def test_a_jsonl_file_with_a_byte_order_mark_is_jsonl(setup):
    """The mark made line 1 not JSON: the file was trained on as one plain-text document, its
    JSON syntax included."""
    t = setup
    bom = t / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (t / "data.jsonl").read_bytes())
    got, want = (load_data(p, _tokenizer(t), 16) for p in (bom, t / "data.jsonl"))
    assert (got.format, got.documents) == ("jsonl text", 40)
    assert torch.equal(got.input_ids, want.input_ids)


def test_a_window_inside_a_long_prompt_is_not_trained_on(setup, capsys):
    """A packed sequence whose labels were all -100 (inside a prompt) made the loss 0/0: NaN at
    the first such micro-batch, after the optimizer had stepped on it."""
    t = setup
    rng = random.Random(1)
    with open(t / "pc.jsonl", "w") as f:
        for _ in range(10):
            prompt = " ".join(rng.choice(WORDS) for _ in range(60))
            f.write(json.dumps({"prompt": prompt, "completion": "yes"}) + "\n")
    data = load_data(t / "pc.jsonl", _tokenizer(t), 16).trained()
    assert len(data) > 0 and bool((data.labels[:, 1:] != IGNORE).any(dim=1).all())
    args = _args(t, t / "a", "--batch", "1", "--steps", "4")
    args[args.index(str(t / "data.jsonl"))] = str(t / "pc.jsonl")
    assert main(args) == 0
    with open(t / "prompts.jsonl", "w") as f:  # no completion token at all: named
        f.write(json.dumps({"prompt": "the cat " * 40, "completion": ""}) + "\n")
    args[args.index(str(t / "pc.jsonl"))] = str(t / "prompts.jsonl")
    assert main([*args[:-2], "--out", str(t / "b")]) == 2
    assert "with a token the loss covers" in capsys.readouterr().err


def test_a_swap_folder_the_run_did_not_make_is_left_alone(setup):
    """OUT/swap was removed at the end of every run, NVMe or not, with whatever it held."""
    t = setup
    (t / "a" / "swap").mkdir(parents=True)
    (t / "a" / "swap" / "notes.txt").write_text("mine")
    assert main(_args(t, t / "a")) == 0
    assert (t / "a" / "swap" / "notes.txt").read_text() == "mine"


def test_a_resume_with_fewer_steps_than_its_checkpoint_is_refused(setup, capsys):
    """It exported the checkpoint's model as if trained for --steps and saved it as a
    checkpoint of step --steps: a later resume trained the steps after that again."""
    t = setup
    assert main([*_args(t, t / "a"), "--steps", "4", "--save-every", "2"]) == 0
    latest = (t / "a" / "checkpoints" / "latest").read_text()
    held = sorted(p.name for p in (t / "a" / "checkpoints").iterdir())
    export = load_file(t / "a" / "hf" / "model.safetensors")
    assert main([*_args(t, t / "a", "--resume"), "--steps", "2", "--save-every", "2"]) == 2
    assert "the checkpoint is at step 4, past this run's 2 steps" in capsys.readouterr().err
    assert (t / "a" / "checkpoints" / "latest").read_text() == latest
    assert sorted(p.name for p in (t / "a" / "checkpoints").iterdir()) == held
    again = load_file(t / "a" / "hf" / "model.safetensors")
    assert all(torch.equal(export[k], again[k]) for k in export)


def test_the_config_s_gradient_clipping_holds_unless_the_flag_says_otherwise(setup, capsys):
    """--max-grad-norm's default (1.0) replaced the config's gradient_clipping silently, and
    with --max-grad-norm 0 (off) the optimizer clipped to the config's value all the same."""
    t = setup
    (t / "clip.yaml").write_text(CPU + "gradient_clipping: 0.001\n")

    def trained(out, config, *extra):
        args = _args(t, t / out, *extra)
        args[args.index(str(t / "cfg.yaml"))] = str(t / config)
        assert main(args) == 0
        return load_file(t / out / "hf" / "model.safetensors")

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a)

    from_file = trained("a", "clip.yaml")
    assert same(from_file, trained("b", "cfg.yaml", "--max-grad-norm", "0.001"))
    off = trained("c", "clip.yaml", "--max-grad-norm", "0")
    assert "--max-grad-norm 0.0 overrides gradient_clipping=0.001" in capsys.readouterr().err
    assert same(off, trained("d", "cfg.yaml", "--max-grad-norm", "0"))
    assert not same(off, from_file)


def _stopped_at_step_3(t) -> None:
    """A run of 4 steps into ``t / "a"``, checkpointed every 2, stopped by Ctrl-C at step 3."""
    opts = Options(
        model=str(t / "model"), data=str(t / "data.jsonl"), out=str(t / "a"),
        config=str(t / "cfg.yaml"), steps=4, seq_len=16, batch=2, lr=1e-2, save_every=2,
        progress=False,
    )  # fmt: skip

    def stop(rec):
        if rec["step"] == 3:
            raise KeyboardInterrupt

    assert finetune(opts, on_step=stop) == 130


def test_a_metrics_line_cut_short_does_not_refuse_the_resume(setup, capsys):
    """A run killed while writing metrics.jsonl (or a full disk) left a line that is not JSON:
    --resume stopped on it (after loading the model) and could not continue the run."""
    t = setup
    _stopped_at_step_3(t)
    metrics = t / "a" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    assert json.loads(lines[-2])["step"] == 3  # then the summary
    metrics.write_text("".join(lines[:-2]) + lines[-2][:40])  # step 3's record, cut short
    args = _args(t, t / "a", "--resume", "--steps", "4", "--save-every", "2")
    assert main([a for a in args if a != "--no-report"]) == 0
    err = capsys.readouterr().err
    assert "metrics.jsonl:4: not a JSON object (" in err and "; left out" in err, err
    steps = [r["step"] for r in read_metrics(metrics) if r["kind"] == "step"]
    assert steps == [1, 2, 3, 4]


def test_a_resumed_run_s_metrics_hold_one_summary_and_no_record_past_the_checkpoint(setup):
    """--resume kept every record but the steps past the checkpoint: the stopped run's summary
    (and an eval past the checkpoint, were there one) stayed in metrics.jsonl, so the resumed
    run's file held two summaries, the first in the middle of the steps."""
    t = setup
    _stopped_at_step_3(t)
    args = _args(t, t / "a", "--resume", "--steps", "4", "--save-every", "2")
    assert main([a for a in args if a != "--no-report"]) == 0
    kinds = [r["kind"] for r in read_metrics(t / "a" / "metrics.jsonl")]
    assert kinds == ["run", "step", "step", "step", "step", "summary"], kinds


def test_accumulation_weighs_every_covered_token_alike(setup):
    """With prompt / completion data the micro-batches cover different numbers of tokens; each
    one's mean divided by --accum weighed them unequally: --batch 2 --accum 2 ended 3.3e-3 off
    --batch 4 after 3 steps. The step's loss is now its mean over every token it covers
    (``num_items_in_batch``, as transformers' Trainer), and the two runs agree."""
    t = setup
    rng = random.Random(2)
    with open(t / "pc.jsonl", "w") as f:
        for _ in range(40):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 14)))
            completion = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")

    def trained(out, batch, accum):
        args = _args(t, t / out, "--batch", str(batch), "--accum", str(accum), "--steps", "3")
        args[args.index(str(t / "data.jsonl"))] = str(t / "pc.jsonl")
        assert main(args) == 0
        return load_file(t / out / "hf" / "model.safetensors")

    data = load_data(t / "pc.jsonl", _tokenizer(t), 16)
    covered = (data.labels[:, 1:] != IGNORE).sum(dim=1)
    assert covered.min() < covered.max()  # the micro-batches differ in what they cover
    whole, split = trained("a", 4, 1), trained("b", 2, 2)
    for name, want in whole.items():
        # (2.4e-6 at most: the split batch's rounding, which Adam magnifies near zero)
        torch.testing.assert_close(split[name], want, rtol=1e-5, atol=1e-5, msg=name)


def test_lr_given_to_a_resume_replaces_the_checkpoint_s(setup, capsys):
    """The checkpoint's scheduler state kept the old peak LR whatever --lr the resume gave,
    without a word; and a resume with more --steps took its first step at the LR the old
    schedule had set for it (0 here: the end of its cosine). Now --lr is the schedule's peak
    from the checkpoint's step on, said on stderr; without --lr the checkpoint's holds; and
    every resumed step's LR is this run's schedule's."""
    t = setup

    def run(out, *extra, lr=True):
        drop = {"--no-report"} | (set() if lr else {"--lr", "1e-2"})
        assert main([a for a in _args(t, t / out, *extra) if a not in drop]) == 0

    for out in ("a", "b"):
        run(out, "--steps", "2", "--save-every", "2")
    run("a", "--resume", "--steps", "4", "--lr", "5e-2")
    assert "--lr 0.05 replaces the checkpoint's 0.01 from step 3 on" in capsys.readouterr().err
    run("b", "--resume", "--steps", "4", lr=False)
    run("c", "--steps", "4")  # uninterrupted
    lrs = {
        out: {
            r["step"]: r["lr"]
            for r in read_metrics(t / out / "metrics.jsonl")
            if r["kind"] == "step"
        }
        for out in ("a", "b", "c")
    }
    assert [lrs["b"][k] for k in (3, 4)] == [lrs["c"][k] for k in (3, 4)]  # this schedule's
    assert lrs["a"][1] == lrs["b"][1] == 1e-2 and lrs["b"][3] > 0
    assert lrs["a"][3] == pytest.approx(5 * lrs["b"][3]) and lrs["a"][4] == pytest.approx(
        5 * lrs["b"][4]
    )


def test_lr_given_to_a_resume_leaves_a_group_with_an_lr_of_its_own(capsys):
    """With the config's ``optimizer.param_groups``, ``--lr`` is ``optimizer.lr``: at a run's
    start the groups without an ``lr`` of their own take it and the others keep theirs; a
    resume's ``--lr`` replaced every group's peak with it (a new head's own LR lost without a
    word). Now it replaces only the peaks of the groups that follow ``optimizer.lr``."""
    from offload.finetune.recipe import _resume_lr  # noqa: PLC0415

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    opt = torch.optim.AdamW(
        [{"params": [p], "lr": lr} for p, lr in zip(params, (1e-2, 1e-3, 1e-2))]
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    _resume_lr(opt, sched, 5e-2, 3, [False, True, False])
    assert sched.base_lrs == [5e-2, 1e-3, 5e-2]
    assert [g["lr"] for g in opt.param_groups] == [2.5e-2, 5e-4, 2.5e-2]
    assert "--lr 0.05 replaces the checkpoint's 0.01 from step 4 on" in capsys.readouterr().err


def test_a_diverged_run_stops_with_a_clear_error_before_another_step(setup, capsys):
    """A loss that became NaN (an LR far too high) raised a traceback, after the optimizer had
    stepped on that NaN loss. Now the run stops before that step with an error that says what
    to try, exports nothing and keeps its checkpoints."""
    t = setup
    args = [a for a in _args(t, t / "a", "--steps", "4", "--save-every", "1") if a != "1e-2"]
    args[args.index("--lr") + 1 : args.index("--lr") + 1] = ["1e30"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "error: the loss became nan at step 2, and the run stopped" in err, err
    assert "lower --lr" in err and "Traceback" not in err
    assert not (t / "a" / "hf").exists()
    assert (t / "a" / "checkpoints" / "latest").read_text().startswith("ckpt-00000001-")


def test_a_seq_len_over_the_model_s_positions_is_refused_before_loading(setup, capsys):
    """--seq-len over GPT-2's n_positions failed with an IndexError in the first forward,
    after the model had streamed in and OUT was made."""
    t = setup
    args = _args(t, t / "a")
    args[args.index("--seq-len") + 1] = "129"  # the test model's max_position_embeddings: 128
    assert main(args) == 2
    assert "--seq-len 129: over the model's max_position_embeddings=128" in capsys.readouterr().err
    assert not (t / "a").exists()


def test_weight_decay_leaves_biases_and_norms_alone_as_the_trainer(setup, capsys):
    """A config's weight decay decayed every parameter, norm weights included, where the
    Trainer this recipe mirrors leaves biases and norm weights undecayed. Now the run leaves
    out what the installed Trainer does (said on stderr) unless the file lists
    ``optimizer.no_decay`` itself: the default trains as the patterns naming the same set, and
    ``no_decay: []`` decays everything, as before."""
    t = setup

    def trained(out, extra):
        (t / f"{out}.yaml").write_text(CPU + f"optimizer: {{weight_decay: 0.5{extra}}}\n")
        args = _args(t, t / out)
        args[args.index(str(t / "cfg.yaml"))] = str(t / f"{out}.yaml")
        assert main(args) == 0
        return load_file(t / out / "hf" / "model.safetensors")

    default = trained("a", "")
    assert "weight decay 0.5 leaves 5 parameter(s) undecayed" in capsys.readouterr().err
    named = trained("b", ", no_decay: [norm]")  # the tiny Llama's 5 norm weights, no biases
    every = trained("c", ", no_decay: []")
    assert "leaves" not in capsys.readouterr().err
    norms = [n for n in default if "norm" in n]
    assert len(norms) == 5
    for name, want in named.items():
        assert torch.equal(default[name], want), name
    for name in norms:  # decayed by lr * 0.5 of themselves more in each of the 2 steps
        assert not torch.allclose(every[name], default[name], atol=1e-4), name


def _prompts(t, name="pc.jsonl", seed=2):
    """Prompt / completion data whose micro-batches cover different numbers of tokens."""
    rng = random.Random(seed)
    with open(t / name, "w") as f:
        for _ in range(40):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 14)))
            completion = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return t / name


@pytest.mark.heavy
def test_two_ranks_train_as_one_process_on_their_joined_batch(setup, capsys):
    """Under torchrun each rank ran the whole recipe by itself: two unsharded trainings on the
    same batches, racing to write one OUT (one of them failed). ``--nproc 2`` (or torchrun)
    now joins the ranks: two ranks at --batch 1 train as one process at --batch 2 (prompt /
    completion data, so each micro-batch's token count differs between the ranks, and the
    step's loss is weighed over all of them), with the params on NVMe under OUT/swap; the run
    resumes on two ranks as it ran, and a resume on one is refused."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    t = setup
    data = _prompts(t)
    (t / "nvme.yaml").write_text(
        # 16000 bytes: a config note (rounded up to 16 KiB), said by rank 0 alone (below)
        CPU + "offload_param: {device: nvme, buffer_count: 4, buffer_size: 16000}\n"
        "offload_optimizer: {device: nvme, buffer_count: 8, buffer_size: 16KiB}\n"
    )

    def args(out, batch, *extra):
        a = _args(t, t / out, "--batch", str(batch), "--accum", "2", "--steps", "4", *extra)
        a[a.index(str(t / "data.jsonl"))] = str(data)
        a[a.index(str(t / "cfg.yaml"))] = str(t / "nvme.yaml")
        return a

    def ranks(out, *extra):
        cmd = [sys.executable, "-m", "offload", *args(out, 1, "--nproc", "2", *extra)]
        cmd.remove("--no-report")  # (rank 0's metrics.jsonl: read below)
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        return run

    assert main(args("one", 2)) == 0
    run = ranks("two", "--save-every", "2")
    assert "ranks                2" in run.stdout and not (t / "two" / "swap").exists()
    # the config's notes, once: the same on every rank, rank 0 says them (each rank, before)
    assert run.stderr.count("rounded up to 16384") == 1, run.stderr[-3000:]
    one = load_file(t / "one" / "hf" / "model.safetensors")
    two = load_file(t / "two" / "hf" / "model.safetensors")
    for name, want in one.items():
        torch.testing.assert_close(two[name], want, rtol=1e-5, atol=1e-5, msg=name)
    steps = [r for r in read_metrics(t / "two" / "metrics.jsonl") if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # rank 0's records, once each
    assert (t / "two" / "hf" / "tokenizer.json").exists()

    # the checkpoint of step 2, resumed on two ranks: steps 3-4 as the uninterrupted run's
    (t / "two" / "checkpoints" / "latest").write_text(
        next(p.name for p in (t / "two" / "checkpoints").glob("ckpt-00000002-*"))
    )
    ranks("two", "--save-every", "2", "--resume")
    again = load_file(t / "two" / "hf" / "model.safetensors")
    for name, want in two.items():
        assert torch.equal(again[name], want), name
    capsys.readouterr()
    assert main(args("two", 1, "--resume")) == 2
    assert "the checkpoint's run had ranks=2" in capsys.readouterr().err


def test_an_out_that_is_a_file_is_named(setup, capsys):
    """It said only "[Errno 17] File exists: '...'", naming neither --out nor the problem."""
    t = setup
    out = t / "notes.txt"
    out.write_text("mine")
    assert main(_args(t, out)) == 2
    err = capsys.readouterr().err
    assert f"--out '{out}' is a file, not a directory" in err
    assert out.read_text() == "mine"


@pytest.mark.parametrize(
    "text", ["gradient_accumulation_steps: 4.0\n", "gradient_accumulation_steps: 4\n"]
)
def test_the_files_accumulation_holds_when_written_as_a_float(tmp_path, text):
    """The loader takes 4.0 as the count 4, but the recipe read only an int from the file: 4.0
    was taken as unset, so 1 micro-batch per step."""
    from offload.finetune.recipe import offload_config  # noqa: PLC0415

    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(CPU + text)
    opts = Options(model="m", data="d", out=str(tmp_path / "out"), config=str(cfg_file))
    cfg, opts, _, _ = offload_config(opts, tmp_path / "out")
    assert opts.accum == 4 and cfg["gradient_accumulation_steps"] == 4


def test_swap_files_of_the_user_and_a_failed_run_s_out_are_handled(setup, capsys):
    """With an NVMe section that names no nvme_path the run swaps in OUT/swap and removed it at
    the end with ``rmtree``, whatever it held (a user's notes there too). Now only its empty
    folders go (its stores removed their files); and a run that fails before writing anything
    (here its data has no sequence) leaves no OUT it made, where OUT/swap stayed."""
    t = setup
    (t / "nvme.yaml").write_text(
        CPU + "offload_param: {device: nvme, buffer_count: 4, buffer_size: 16KiB}\n"
        "offload_optimizer: {device: nvme, buffer_count: 8, buffer_size: 16KiB}\n"
    )

    def args(out, data="data.jsonl"):
        a = _args(t, t / out)
        a[a.index(str(t / "cfg.yaml"))] = str(t / "nvme.yaml")
        a[a.index(str(t / "data.jsonl"))] = str(t / data)
        return a

    assert main(args("a")) == 0
    assert not (t / "a" / "swap").exists() and (t / "a" / "hf").is_dir()
    (t / "b" / "swap").mkdir(parents=True)
    (t / "b" / "swap" / "notes.txt").write_text("mine")
    assert main(args("b")) == 0
    assert (t / "b" / "swap" / "notes.txt").read_text() == "mine"
    assert [p.name for p in (t / "b" / "swap").iterdir()] == ["notes.txt"]
    (t / "empty.jsonl").write_text("")
    capsys.readouterr()
    assert main(args("c", "empty.jsonl")) == 2
    assert "--data" in capsys.readouterr().err and not (t / "c").exists()


_STUCK_RANK = """
import os, sys, time
sys.path.insert(0, {tests!r})
import transformers
from offload.finetune import Options, finetune

if os.environ["RANK"] == "1":  # stuck in its first forward (a hung data or device call)
    transformers.LlamaForCausalLM.forward = lambda self, *a, **k: time.sleep(100)
t0 = time.monotonic()
try:
    finetune(Options(model={model!r}, data={data!r}, out={out!r}, config={config!r}, steps=2,
                     seq_len=16, batch=1, lr=1e-2, progress=False, report=False))
except Exception as exc:
    print(f"{{time.monotonic() - t0:.1f}} {{type(exc).__name__}}: {{exc}}", flush=True)
    sys.exit(0)
"""


@pytest.mark.heavy
def test_a_rank_stuck_in_its_forward_stops_the_others_at_the_distributed_timeout(setup):
    """At stage 1 nothing in the forwards and backwards waits on the other ranks, so the first
    wait is the step's loss summed over the ranks: a plain ``all_reduce`` on the default group,
    which waited the group's own timeout (30 minutes; here until the stuck rank's 100 s sleep
    ended) where every other wait in offload ends at ``distributed.timeout`` (15 s here: wrap's
    waits too, for a rank that loads slower on a loaded machine)."""
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from dist_harness import start_ranks, wait_all  # noqa: PLC0415

    t = setup
    (t / "stage1.yaml").write_text(CPU + "distributed: {stage: 1, timeout: 15}\n")
    script = _STUCK_RANK.format(
        tests=str(Path(__file__).parent), model=str(t / "model"), data=str(t / "data.jsonl"),
        out=str(t / "out"), config=str(t / "stage1.yaml"),
    )  # fmt: skip
    (t / "w.py").write_text(script)
    procs = start_ranks([sys.executable, str(t / "w.py")], 2, t)
    try:
        ((rc0, out0, err0),) = wait_all(procs[:1], 200)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert rc0 == 0 and "CollectiveError" in out0, (out0, err0[-2000:])
    took, message = out0.split(" ", 1)
    assert "did not complete within 15 s (distributed.timeout)" in message, message
    assert "the step's loss" in message, message
    assert float(took) < 75, out0  # loading the model, then 15 s: not the stuck rank's 100 s


@pytest.mark.heavy
def test_a_resume_on_another_rank_count_with_the_same_global_batch_continues_the_run(setup, capsys):
    """Two ranks at --batch 1 train as one process at --batch 2 (the same sequences per
    micro-batch, split), and the checkpoint reshards to any rank count; but a resume with
    another rank count was refused ("the checkpoint's run had batch=1, ranks=2"), so a run
    that lost a rank could not go on. Now the checkpoint of step 2 of either run, resumed on
    the other rank count at the same global batch, ends where the uninterrupted run did."""
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    t = setup

    def args(out, batch, *extra):
        return _args(t, t / out, "--batch", str(batch), "--steps", "4", "--save-every", "2", *extra)

    def two_ranks(out, *extra):
        cmd = [sys.executable, "-m", "offload", *args(out, 1, "--nproc", "2", *extra)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        return run

    def back_to_step_2(out):
        ckpts = t / out / "checkpoints"
        (ckpts / "latest").write_text(next(p.name for p in ckpts.glob("ckpt-00000002-*")))

    def assert_same(out, want):
        got = load_file(t / out / "hf" / "model.safetensors")
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=name)

    assert main(args("one", 2)) == 0
    one = load_file(t / "one" / "hf" / "model.safetensors")
    two_ranks("two")
    assert_same("two", one)

    back_to_step_2("two")  # two ranks' checkpoint, one process
    capsys.readouterr()
    assert main(args("two", 2, "--resume")) == 0, capsys.readouterr().err
    assert "continues it on 1 rank at --batch 2" in capsys.readouterr().err
    assert_same("two", one)

    shutil.copytree(t / "one", t / "again")  # one process's checkpoint, two ranks
    back_to_step_2("again")
    run = two_ranks("again", "--resume")
    assert "continues it on 2 ranks at --batch 1" in run.stderr
    assert_same("again", one)

    capsys.readouterr()  # another global batch is still another run (its last: 2 x 1)
    assert main(args("again", 1, "--resume")) == 2
    assert "the checkpoint's run had ranks=2; this one has ranks=1" in capsys.readouterr().err


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux ``/proc``)."""
    from pathlib import Path  # noqa: PLC0415

    parents = {}
    for p in Path("/proc").iterdir():
        try:
            parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    out, todo = [], [pid]
    while todo:
        of = todo.pop()
        kids = [c for c, parent in parents.items() if parent == of]
        out += kids
        todo += kids
    return out


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.heavy
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGKILL"])
def test_a_signal_to_the_command_of_several_ranks_stops_its_ranks(setup, signum):
    """``offload finetune --nproc 2`` ran torchrun as a child and waited for it: a SIGTERM to
    the command (what a scheduler sends: Slurm's scancel, Kubernetes, ``timeout``) ended the
    command alone, and torchrun and both ranks went on training in the background, writing
    OUT's checkpoints and export (a resume started then raced them for the directory). Now
    the command passes SIGTERM on to torchrun, which stops the ranks, and ends with 143
    (128 + SIGTERM); a command killed outright (SIGKILL) takes torchrun with it (the parent
    death signal), and torchrun its ranks."""
    import contextlib  # noqa: PLC0415
    import os  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import time  # noqa: PLC0415

    from children import ROOT, default_sigint  # noqa: PLC0415

    t = setup
    out = t / "out"
    args = _args(t, out, "--steps", "100000", "--save-every", "1", "--nproc", "2")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = subprocess.Popen(
        [sys.executable, "-m", "offload", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    under: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not list((out / "checkpoints").glob("ckpt-*")):  # the ranks train
            assert cmd.poll() is None and time.monotonic() < deadline, cmd.stderr.read()[-3000:]
            time.sleep(0.1)
        under = _descendants(cmd.pid)
        assert len(under) >= 3, under  # torchrun and its two ranks
        cmd.send_signal(getattr(signal, signum))
        status = cmd.wait(60)
        deadline = time.monotonic() + 60
        while any(_running(p) for p in under) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in under if _running(p)]
        assert left == [], f"still running after the command ended by {signum}: {left}"
        assert status == (143 if signum == "SIGTERM" else -9), status
        assert not (out / "hf").exists()
    finally:
        for p in [cmd.pid, *_descendants(cmd.pid), *under]:  # (what is left: ours)
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        cmd.communicate()
