"""offload.demo parts: the GPT, its sizing, the stdlib text loader, the loop and the report."""

from __future__ import annotations

import json
import math
import socket
import struct

import pytest
import torch

from offload.demo import data as demo_data
from offload.demo import loop as demo_train
from offload.demo import model as demo_model
from offload.demo import report as demo_report
from offload.demo.data import ByteCorpus, batches, get_batch, load_corpus, stdlib_source_files
from offload.demo.model import (
    GPT,
    Block,
    block_params,
    config_for_size,
    largest_unit_params,
    lm_loss,
    param_count,
)
from offload.estimate import host_memory_budget

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus.from_stdlib(max_bytes=400_000)


@pytest.fixture
def one_thread():
    """Tiny models train fastest on one thread (and do not suffer from a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- model ---------------------------------------------------------------------------------


def test_tiny_forward_backward():
    torch.manual_seed(0)
    cfg = config_for_size("tiny")
    model = GPT(cfg)
    x = torch.randint(0, 256, (3, 17))
    logits = model(x)
    assert logits.shape == (3, 17, 256) and logits.dtype == torch.float32
    loss = lm_loss(logits, torch.randint(0, 256, (3, 17)))
    # a freshly initialised model guesses close to uniform over 256 bytes
    assert abs(float(loss.detach()) - math.log(256)) < 0.3
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    with pytest.raises(ValueError, match="longer than seq_len"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


def test_blocks_are_a_repeated_class_named_block():
    cfg = config_for_size("tiny")
    model = GPT(cfg)
    blocks = [m for m in model.modules() if type(m).__name__ == "Block"]
    assert len(blocks) == cfg.n_layer >= 2
    assert all(isinstance(b, Block) for b in blocks)
    # no other module class name could be mistaken for a unit by the wrap policy
    others = {type(m).__name__ for m in model.modules()} - {"Block"}
    assert not any(n.endswith(("Block", "Layer")) for n in others), others


@pytest.mark.parametrize("tied", [False, True])
def test_param_count_is_exact(tied):
    for size in ("tiny", "1M"):
        cfg = config_for_size(size, tie_embeddings=tied)
        model = GPT(cfg)
        assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
        assert (model.head.weight is model.tok_emb.weight) == tied


@pytest.mark.parametrize("size, target", [("1M", 1e6), ("5M", 5e6), ("50M", 50e6), ("125M", 125e6)])
def test_size_is_close_to_target(size, target):
    cfg = config_for_size(size)
    assert abs(param_count(cfg) / target - 1) < 0.10
    assert cfg.d_model % cfg.n_head == 0 and cfg.d_model // cfg.n_head == 64


@pytest.mark.parametrize("size", ["abc", "10", "0M", "-5M", "5X"])
def test_bad_sizes(size):
    with pytest.raises(ValueError, match="--size"):
        config_for_size(size)


# --- data ----------------------------------------------------------------------------------


def test_stdlib_text_is_found_without_network(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the demo data must not touch the network")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    files = stdlib_source_files()
    assert any(f.name == "os.py" for f in files)
    assert all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "encodings" in f.parts for f in files)
    text = load_corpus(200_000)
    assert len(text) == 200_000
    assert b"def " in text and b"import " in text
    assert load_corpus(200_000) == text  # deterministic


def test_load_corpus_order_cap_and_skips(tmp_path):
    (tmp_path / "b.py").write_bytes(b"B" * 10)
    (tmp_path / "a.py").write_bytes(b"A" * 10)
    (tmp_path / "notes.txt").write_bytes(b"T" * 10)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "c.py").write_bytes(b"C" * 10)
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "d.py").write_bytes(b"D" * 10)
    sep = demo_data.FILE_SEPARATOR
    assert load_corpus(10_000, root=tmp_path) == b"A" * 10 + sep + b"B" * 10 + sep + b"D" * 10 + sep
    assert load_corpus(15, root=tmp_path) == b"A" * 10 + sep + b"B" * 3
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no .py source files"):
        load_corpus(100, root=empty)


def test_split_and_batches(corpus):
    assert corpus.train.dtype == torch.uint8
    assert len(corpus.val) == pytest.approx(0.1 * (len(corpus.train) + len(corpus.val)), abs=1)
    x, y = next(batches(corpus.train, 5, 33, seed=7))
    assert x.shape == y.shape == (5, 33)
    assert x.dtype == y.dtype == torch.int64
    assert int(x.max()) < 256 and int(x.min()) >= 0
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    a = [next(it) for it in [batches(corpus.train, 5, 33, seed=7)] for _ in range(3)]
    b = [next(it) for it in [batches(corpus.train, 5, 33, seed=7)] for _ in range(3)]
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    c = next(batches(corpus.train, 5, 33, seed=8))
    assert not torch.equal(a[0][0], c[0])
    with pytest.raises(ValueError, match="seq_len"):
        get_batch(corpus.val[:10], 2, 32, torch.Generator())


# --- report --------------------------------------------------------------------------------


def _fake_records(n: int = 6) -> list[dict]:
    out: list[dict] = [
        {"kind": "run", "model": {"params": 1}},
        {"kind": "eval", "step": 0, "val_loss": 5.5},
    ]
    for i in range(1, n + 1):
        out.append(
            {
                "kind": "step",
                "step": i,
                "loss": 5.5 - 0.3 * i,
                "tokens": 1024,
                "wall_seconds": 1.0,
                "elapsed_seconds": float(i),
                "forward_seconds": 0.2,
                "backward_seconds": 0.4,
                "io_wait_seconds": 0.1 * (i % 2),
                "gather_copy_seconds": 0.05,
                "optimizer_seconds": 0.3,
                "bytes": {"nvme->host": 3 * 10**8, "host->nvme": 2 * 10**8, "host->device": 10**8},
                "prefetch_hits": 9,
                "prefetch_misses": 1,
                "rss_bytes": (400 + i) * 10**6,
                "host_peak_bytes": 256 * 10**6,
            }
        )
    out.append({"kind": "eval", "step": n, "val_loss": 3.9})
    return out


def test_metrics_jsonl_round_trip(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    records = _fake_records()
    with demo_report.MetricsWriter(path) as w:
        for r in records:
            w.write(r)
    lines = path.read_text().splitlines()
    assert len(lines) == len(records)
    assert all(isinstance(json.loads(line), dict) for line in lines)
    assert demo_report.read_metrics(path) == records
    path.write_text(lines[0] + "\n{not json\n")
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        demo_report.read_metrics(path)


def test_png_report(tmp_path):
    pytest.importorskip("matplotlib")
    out = demo_report.plot_report(
        _fake_records(),
        tmp_path / "report.png",
        host_budget=host_memory_budget(256 * 10**6, 10**6),
        rss_before_bytes=300 * 10**6,
    )
    blob = out.read_bytes()
    assert blob[:8] == PNG_MAGIC
    assert blob[12:16] == b"IHDR"
    width, height = struct.unpack(">II", blob[16:24])
    assert (width, height) == (1300, 850)
    assert 20_000 < len(blob) < 2_000_000


def test_ema_is_bias_corrected():
    assert demo_report.ema([4.0, 4.0, 4.0]) == pytest.approx([4.0, 4.0, 4.0])
    smooth = demo_report.ema([5.0, 1.0, 5.0, 1.0])
    assert smooth[0] == 5.0 and 1.0 < min(smooth[1:]) and max(smooth[1:]) < 5.0


def test_summary_numbers_and_table():
    s = demo_report.summarize(_fake_records())
    assert s["steps"] == 6
    assert s["loss_first"] == pytest.approx(5.5 - 0.3 * 1.5)  # mean of steps 1, 2
    assert s["loss_last"] == pytest.approx(5.5 - 0.3 * 5.5)
    assert s["val_first"] == 5.5 and s["val_last"] == 3.9
    assert s["tokens_per_second"] == pytest.approx(1024.0)
    assert s["io_gb_per_second"] == pytest.approx(0.6)
    assert s["bytes_total"]["nvme->host"] == 6 * 3 * 10**8
    assert s["rss_peak_bytes"] == 406 * 10**6
    text = demo_report.format_summary(s, [("model", "fake")])
    for needle in ("model", "train loss", "5.050 -> 3.850", "0.60 GB/s", "90 % hit", "peak RSS"):
        assert needle in text
    assert "IO wait 0.050 s and gather copies 0.050 s of forward+backward" in text


# --- the loop ------------------------------------------------------------------------------


class _EngineLike(torch.optim.AdamW):
    """A plain optimizer that reports counters the way the engine does."""

    def stats(self) -> dict:
        return {
            "forward_seconds": 0.5,
            "io_wait_seconds": 0.25,
            "bytes": {"nvme->host": 1000, "host->nvme": 500},
            "prefetch_hits": 3,
            "total": {"bytes": {"nvme->host": 10**9}},
        }


def test_normalize_stats_fills_missing_keys():
    s = demo_train.normalize_stats({"io_wait_seconds": 0.5, "bytes": {"nvme->host": 7, "x->y": 1}})
    assert s["io_wait_seconds"] == 0.5 and s["forward_seconds"] == 0 and s["rss_bytes"] == 0
    assert s["bytes"] == {
        "nvme->host": 7,
        "host->nvme": 0,
        "host->device": 0,
        "device->host": 0,
        "x->y": 1,
    }
    assert demo_train.normalize_stats(None)["bytes"]["host->device"] == 0


def test_train_loop_learns_and_writes_records(corpus, tmp_path, one_thread):
    torch.manual_seed(0)
    cfg = config_for_size("tiny", seq_len=32)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with demo_report.MetricsWriter(tmp_path / "m.jsonl") as w:
        res = demo_train.train(
            model, opt, corpus, steps=30, batch_size=8, seq_len=32, lr=3e-3, warmup_steps=3,
            eval_batches=2, writer=w, progress=False,
        )  # fmt: skip
    assert res.steps_done == 30 and not res.interrupted
    steps = [r for r in res.records if r["kind"] == "step"]
    evals = [r for r in res.records if r["kind"] == "eval"]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert [e["step"] for e in evals] == [0, 30]
    assert evals[1]["val_loss"] < evals[0]["val_loss"] - 0.3
    first = sum(r["loss"] for r in steps[:5]) / 5
    last = sum(r["loss"] for r in steps[-5:]) / 5
    assert last < first - 0.5
    assert steps[0]["lr"] == pytest.approx(1e-3) and steps[-1]["lr"] == pytest.approx(3e-3)
    # without engine counters the split is the loop's own wall time per phase
    r = steps[-1]
    parts = r["forward_seconds"] + r["backward_seconds"] + r["optimizer_seconds"]
    assert r["io_wait_seconds"] == 0 and parts == pytest.approx(r["wall_seconds"], rel=1e-6)
    assert r["rss_bytes"] > 10**7 and r["tokens"] == 8 * 32
    assert demo_report.read_metrics(tmp_path / "m.jsonl") == res.records


def test_train_loop_accumulates_the_configs_micro_batches_per_step(corpus, one_thread):
    """The demo stepped at every batch whatever the config's gradient_accumulation_steps: a
    step is that many micro-batches now, each loss divided by their count, as a torch loop."""
    torch.manual_seed(0)
    cfg = config_for_size("tiny", seq_len=16)
    model, ref = GPT(cfg), GPT(cfg)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    res = demo_train.train(
        model, opt, corpus, steps=3, batch_size=2, seq_len=16, lr=1e-3, progress=False,
        accumulation=2,
    )  # fmt: skip
    stream = batches(corpus.train, 2, 16, 0)
    losses = []
    for _ in range(3):
        total = 0.0
        for _ in range(2):
            x, y = next(stream)
            loss = demo_train.lm_loss(ref(x), y) / 2
            loss.backward()
            total += loss.item()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(total)
    steps = [r for r in res.records if r["kind"] == "step"]
    assert [r["tokens"] for r in steps] == [2 * 2 * 16] * 3
    assert [r["loss"] for r in steps] == pytest.approx(losses, rel=1e-6)
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_train_loop_uses_engine_counters_and_stops_on_ctrl_c(corpus, one_thread):
    torch.manual_seed(0)
    model = GPT(config_for_size("tiny", seq_len=16))
    opt = _EngineLike(model.parameters(), lr=1e-3)
    seen: list[int] = []

    def interrupt_after_three(rec: dict) -> None:
        seen.append(rec["step"])
        if rec["step"] == 3:
            raise KeyboardInterrupt

    res = demo_train.train(
        model, opt, corpus, steps=50, batch_size=2, seq_len=16, lr=1e-3, progress=False,
        on_step=interrupt_after_three,
    )  # fmt: skip
    assert res.interrupted and res.steps_done == 3 and seen == [1, 2, 3]
    r = res.records[-1]
    assert r["forward_seconds"] == 0.5 and r["io_wait_seconds"] == 0.25  # the engine's numbers
    assert r["backward_seconds"] == pytest.approx(r["backward_wall"])  # not reported: wall time
    assert r["bytes"]["nvme->host"] == 1000 and r["io_bytes"] == 1500
    assert r["prefetch_hits"] == 3 and r["prefetch_misses"] == 0


def test_model_module_note_formula_matches_blocks():
    for d in (64, 640):
        block = Block(demo_model.GPTConfig(d_model=d, n_layer=1, n_head=d // 64))
        assert sum(p.numel() for p in block.parameters()) == 12 * d * d + 13 * d


# --- the picture adds up ------------------------------------------------------------------


def _background_step(i: int = 1) -> dict:
    """A step as the engine reports it with the optimizer state on NVMe: the CPU step (0.3 s)
    mostly ran beside the next forward; the loop waited 0.05 s for it in optimizer.step()."""
    return {
        "kind": "step", "step": i, "wall_seconds": 0.66, "forward_seconds": 0.2,
        "backward_seconds": 0.4, "optimizer_seconds": 0.3, "step_wall": 0.05,
        "io_wait_seconds": 0.02, "elapsed_seconds": float(i), "rss_bytes": 400 * 10**6,
    }  # fmt: skip


def test_time_split_adds_up_to_the_wall_time():
    split = demo_report.time_split(_background_step())
    assert split["forward"] + split["backward"] + split["step_waited"] + split["other"] == (
        pytest.approx(0.66)
    )
    assert split["step_waited"] == 0.05 and split["step_overlapped"] == pytest.approx(0.25)
    # a synchronous step: everything was waited for, nothing hidden
    sync = demo_report.time_split(_background_step() | {"optimizer_seconds": 0.04})
    assert sync["step_overlapped"] == 0 and sync["step_waited"] == 0.05
    # older records without step_wall: the wall time left after forward and backward
    old = demo_report.time_split({k: v for k, v in _background_step().items() if k != "step_wall"})
    assert old["step_waited"] == pytest.approx(0.06) and old["step_overlapped"] == pytest.approx(
        0.24
    )


def test_time_caption_says_why_the_bars_pass_the_wall_line():
    hidden = demo_report.time_caption([demo_report.time_split(_background_step())])
    flat = " ".join(hidden.split())
    assert "add up to the wall time" in flat and "83 % of the CPU step" in flat
    assert "background" in flat and "next forward" in flat
    assert all(len(line) <= 88 for line in hidden.splitlines())
    sync = demo_report.time_caption([demo_report.time_split(_background_step() | {"step_wall": 1})])
    assert "background" not in sync


def _axes():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    return plt, fig, ax


def test_time_panel_stacks_to_the_wall_and_hatches_the_rest():
    plt, fig, ax = _axes()
    steps = [_background_step(i) for i in (1, 2)]
    demo_report._plot_time(ax, steps, [1, 2])
    bars = {c.get_label(): c.patches for c in ax.containers}
    solid = ["forward", "backward", "CPU step: waited for"]
    for i in range(2):
        top = bars[solid[-1]][i].get_y() + bars[solid[-1]][i].get_height()
        assert sum(bars[k][i].get_height() for k in solid) == pytest.approx(top)
        assert top == pytest.approx(0.65)  # 0.66 wall - 0.01 of the loop's own overhead
        hatched = bars["CPU step: in the background"][i]
        assert hatched.get_y() == pytest.approx(top) and hatched.get_height() == pytest.approx(0.25)
        assert hatched.get_hatch()
    assert "background" in ax.get_xlabel()
    plt.close(fig)


def test_memory_panel_draws_the_documented_budget_from_the_baseline():
    plt, fig, ax = _axes()
    budget = host_memory_budget(168 * 10**6, 4_923_520)  # the 50M demo: pools, one block
    demo_report._plot_memory(ax, [_background_step()], budget, 330 * 10**6)
    lines = {line.get_label(): line for line in ax.get_lines()}
    level = next(v for k, v in lines.items() if k.startswith("documented budget")).get_ydata()[0]
    assert level == pytest.approx((330 * 10**6 + budget.total) / 1e6)
    assert budget.total == 168 * 10**6 + 16 * 4_923_520 + 48 * 2**20
    label = next(k for k in lines if k.startswith("documented budget"))
    assert "buffers 168" in label and "4 x largest unit in fp32 79" in label and "fixed 50" in label
    assert lines["RSS before the model (330 MB)"].get_ydata()[0] == pytest.approx(330)
    # no line for the buffers alone: against them a run within its budget reads as an overrun
    assert not [k for k in lines if k.startswith("host buffer")]
    plt.close(fig)


def test_summary_names_the_background_step():
    s = demo_report.summarize([_background_step(1), _background_step(2)])
    assert s["step_background_median"] == pytest.approx(0.25)
    assert "0.250 s of the CPU step in the background" in demo_report.format_summary(s)


# --- what the demo's budget is made of ----------------------------------------------------


@pytest.mark.parametrize("size", ["tiny", "1M", "5M"])
@pytest.mark.parametrize("tied", [False, True])
def test_largest_unit_params_matches_the_model(size, tied):
    cfg = config_for_size(size, tie_embeddings=tied)
    model = GPT(cfg)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    per_block = [sum(p.numel() for p in b.parameters()) for b in blocks]
    assert largest_unit_params(cfg) == max([root, *per_block])
    assert per_block[0] == block_params(cfg.d_model)


def test_host_buffer_bytes_counts_nvme_pools_as_wrap_sizes_them():
    from offload.cli.demo import host_buffer_bytes
    from offload.config import load_config

    both = {"device": "nvme", "nvme_path": "/x", "buffer_count": 4, "buffer_size": 20 * 2**20}
    cfg = load_config({"offload_param": both, "offload_optimizer": both, "dtype": "fp32"})
    assert host_buffer_bytes(cfg, 10**6) == 2 * 4 * 20 * 2**20
    cpu_opt = load_config({"offload_param": both, "offload_optimizer": {"device": "cpu"}})
    assert host_buffer_bytes(cpu_opt, 10**6) == 4 * 20 * 2**20  # the cpu section has no pool
    auto = {"device": "nvme", "nvme_path": "/x", "buffer_count": 4}
    cfg = load_config({"offload_param": auto, "offload_optimizer": auto, "dtype": "bf16"})
    unit = 5 * 10**6  # 10 MB in bf16, 20 MB in fp32, each rounded up to 4096
    assert host_buffer_bytes(cfg, unit) == 4 * 10_002_432 + 4 * 20_000_768


def test_rss_before_model_is_this_process():
    from offload.cli.demo import rss_before_model

    assert 10**7 < rss_before_model() < 10**11
