"""`offload demo` end to end from a subprocess: tiny runs, the report, Ctrl-C and cleanup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from children import default_sigint, stacks_of_stuck

from offload.cli.demo import build_config, engine_status
from offload.cli.main import build_parser, main
from offload.config import load_config

ROOT = Path(__file__).resolve().parent.parent
ENGINE_OK, ENGINE_WHY = engine_status()
needs_engine = pytest.mark.skipif(not ENGINE_OK, reason=f"engine not available: {ENGINE_WHY}")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env() -> dict[str, str]:
    # one torch thread: the tiny model trains fastest that way, also on a busy machine
    path = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    # (a demo that does not end shows its threads' stacks: children.stacks_of_stuck)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _records(report: Path) -> list[dict]:
    return [json.loads(line) for line in (report / "metrics.jsonl").read_text().splitlines()]


def _check_report(report: Path, steps: int) -> list[dict]:
    records = _records(report)
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "run" and kinds[-1] == "summary"
    step_recs = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in step_recs] == list(range(1, steps + 1))
    for r in step_recs:
        assert r["loss"] > 0 and r["wall_seconds"] > 0 and r["rss_bytes"] > 0
        assert set(r["bytes"]) >= {"nvme->host", "host->nvme", "host->device", "device->host"}
    png = (report / "report.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 20_000
    return records


def test_demo_without_engine_says_so(monkeypatch, capsys):
    import offload.cli.demo as demo_cli

    monkeypatch.setattr(demo_cli, "engine_status", lambda: (False, "offload.api has no wrap()"))
    assert main(["demo", "--size", "tiny", "--steps", "3", "--no-report"]) == 2
    err = capsys.readouterr().err
    assert "the training engine is not built yet" in err and "no wrap()" in err


def run_main(*args: str) -> int:
    """The `offload demo` command in this process (the CLI path without a new interpreter)."""
    return main(["demo", "--no-progress", *args])


def test_demo_baseline_tiny_end_to_end(tmp_path, capsys):
    code = run_main(
        "--baseline", "--size", "tiny", "--steps", "3", "--report", str(tmp_path / "rep")
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "offload demo summary" in out and "train loss" in out
    _check_report(tmp_path / "rep", 3)


def test_demo_rejects_bad_size(tmp_path, capsys):
    assert run_main("--baseline", "--size", "huge", "--report", str(tmp_path / "rep")) == 2
    assert "--size" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,named",
    [
        (("--seq-len", "0"), "--seq-len must be >= 1, got 0"),  # ran at 256 without a word
        (("--warmup", "-2"), "--warmup must be >= 0, got -2"),  # an LR above the peak
        (("--eval-batches", "-3"), "--eval-batches must be >= 0, got -3"),
        (("--lr", "-1"), "--lr must be a finite number > 0, got -1.0"),  # said optimizer.lr
        (("--lr", "nan"), "--lr must be a finite number > 0, got nan"),
        (("--nvme-path", "/proc/no/such"), "--nvme-path: cannot make a swap directory in"),
        # a FileExistsError / PermissionError traceback once the model was wrapped
        (("--report", "/proc/version"), "--report '/proc/version' is a file, not a directory"),
        (("--report", "/proc/no/such"), "--report: cannot write in '/proc/no/such'"),
    ],
    ids=[
        "seq-len",
        "warmup",
        "eval-batches",
        "lr",
        "lr-nan",
        "nvme-path",
        "report-file",
        "report-unwritable",
    ],
)
def test_demo_names_a_bad_flag_before_it_trains(tmp_path, capsys, flags, named):
    report = tmp_path / "rep"
    assert run_main("--size", "tiny", "--steps", "1", "--report", str(report), *flags) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err
    assert not report.exists()  # nothing written


@needs_engine
def test_demo_tiny_end_to_end(tmp_path, capsys):
    nvme = tmp_path / "nvme"
    code = run_main(
        "--size", "tiny", "--steps", "3", "--nvme-path", str(nvme),
        "--report", str(tmp_path / "rep"),
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "offload demo summary" in out and "params on nvme, optimizer on nvme" in out
    records = _check_report(tmp_path / "rep", 3)
    steps = [r for r in records if r["kind"] == "step"]
    # params and optimizer state live on NVMe: every step writes the updated state back, and
    # the run reads it in (later steps may find clean copies still cached in the buffers)
    assert all(r["bytes"]["host->nvme"] > 0 for r in steps)
    assert sum(r["bytes"]["nvme->host"] for r in steps) > 0
    assert list(nvme.iterdir()) == []  # the temporary swap directory is gone


@needs_engine
def test_demo_config_file_overrides_defaults(tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"offload_optimizer": {"device": "cpu"}, "prefetch": {"depth": 1}}))
    code = run_main(
        "--size", "tiny", "--steps", "2", "--config", str(cfg), "--eval-batches", "0",
        "--nvme-path", str(tmp_path / "nvme"), "--report", str(tmp_path / "rep"),
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "params on nvme, optimizer on cpu" in out
    run = _records(tmp_path / "rep")[0]
    assert run["config"]["offload_optimizer"]["device"] == "cpu"
    assert run["config"]["offload_param"]["device"] == "nvme"  # the demo's default kept
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"offload_param": {"device": "floppy"}}))
    assert run_main("--size", "tiny", "--config", str(bad), "--no-report") == 2
    err = capsys.readouterr().err
    assert "offload_param.device" in err and "floppy" in err


def test_the_configs_gradient_accumulation_steps_makes_each_step_that_many_batches(tmp_path):
    """`--config` with gradient_accumulation_steps 2 stepped at every batch (one batch's
    tokens a step, the config's value dropped unsaid); now a step is two micro-batches."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"gradient_accumulation_steps": 2, "gradient_clipping": 1.0}))
    code = run_main(
        "--size", "tiny", "--steps", "2", "--batch-size", "2", "--config", str(cfg),
        "--eval-batches", "0", "--no-progress", "--nvme-path", str(tmp_path / "nvme"),
        "--report", str(tmp_path / "rep"),
    )  # fmt: skip
    assert code == 0
    records = _records(tmp_path / "rep")
    seq = records[0]["model"]["seq_len"]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["tokens"] for r in steps] == [2 * 2 * seq] * 2
    assert records[0]["gradient_accumulation_steps"] == 2


def test_the_flags_and_the_swap_directory_apply_to_a_deepspeed_config_too(tmp_path):
    """A DeepSpeed file was used exactly as given: --dtype, --device, --stage and --nvme-path
    were dropped unsaid and an NVMe section without nvme_path was refused; one without
    zero_optimization (bf16 and optimizer.params) was merged into the demo's defaults and
    refused as a mix of both formats. --stage lost to an offload file's distributed.stage. And
    "NVMe", which the loader accepts, got no swap directory (refused for its nvme_path)."""
    swap = str(tmp_path / "swap")
    ds = tmp_path / "ds.json"
    nvme = {"device": "NVMe"}
    zero = {"stage": 3, "offload_optimizer": nvme, "offload_param": nvme}
    ds.write_text(json.dumps({"zero_optimization": zero}))
    flags = ["--dtype", "bf16", "--device", "cpu", "--stage", "2"]
    args = build_parser().parse_args(["demo", "--config", str(ds), *flags])
    cfg = load_config(build_config(args, swap, "cpu"))
    assert (cfg.dtype, cfg.device, cfg.distributed.stage) == ("bf16", "cpu", 2)
    assert cfg.offload_param.device == cfg.offload_optimizer.device == "nvme"
    assert cfg.offload_param.nvme_path == cfg.offload_optimizer.nvme_path == swap
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"bf16": {"enabled": True}, "optimizer": {"params": {"lr": 3e-4}}}))
    cfg = load_config(
        build_config(build_parser().parse_args(["demo", "--config", str(bare)]), swap, "cpu")
    )
    assert (cfg.dtype, cfg.optimizer.lr, cfg.offload_param.device) == ("bf16", 3e-4, "none")
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"distributed": {"stage": 3, "timeout": 60}}))
    args = build_parser().parse_args(["demo", "--config", str(own), "--stage", "1"])
    cfg = load_config(build_config(args, swap, "cpu"))
    assert (cfg.distributed.stage, cfg.distributed.timeout) == (1, 60)


def test_a_yaml_config_is_read_as_offload_config_reads_it(tmp_path):
    """The demo read YAML with plain yaml.safe_load: `lr: 1e-4` became the string '1e-4' and was
    refused, a key given twice kept its last value unsaid, an empty file was refused."""
    swap = str(tmp_path / "swap")

    def built(text: str):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        args = build_parser().parse_args(["demo", "--config", str(path)])
        return load_config(build_config(args, swap, "cpu"))

    assert built("optimizer:\n  lr: 1e-4\n").optimizer.lr == 1e-4
    assert built("").offload_param.device == "nvme"  # the demo's defaults
    with pytest.raises(ValueError, match="'aio' appears twice"):
        built("aio:\n  queue_depth: 4\naio:\n  queue_depth: 8\n")


def _interrupt_after_steps(
    args: list[str], report: Path, steps: int = 1, extra_delay: float = 0.0
) -> tuple[int, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "offload", "demo", "--no-progress", *args, "--report", str(report)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_env(),
        preexec_fn=default_sigint,  # a Ctrl-C must reach the demo even if ours is ignored
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            path = report / "metrics.jsonl"
            if path.exists() and path.read_text().count('"kind":"step"') >= steps:
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the demo ended before it could be interrupted"
        time.sleep(extra_delay)
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            stacks = stacks_of_stuck(proc)
            raise AssertionError(
                f"the demo did not end within 120 s of its Ctrl-C; its stderr:\n{stacks[-8000:]}"
            ) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out + err


@pytest.mark.heavy
def test_ctrl_c_baseline_stops_cleanly(tmp_path):
    code, output = _interrupt_after_steps(
        ["--baseline", "--size", "tiny", "--steps", "100000", "--eval-batches", "0"],
        tmp_path / "rep",
    )
    assert code == 130, output[-3000:]
    assert "Traceback" not in output and "Ctrl-C after" in output
    summary = _records(tmp_path / "rep")[-1]
    assert summary["kind"] == "summary" and summary["interrupted"] is True
    assert summary["steps"] >= 1


@pytest.mark.heavy  # (a killed demo's swap reclaimed by the next stays in the default suite)
@needs_engine
def test_ctrl_c_removes_swap_files(tmp_path):
    nvme = tmp_path / "nvme"
    code, output = _interrupt_after_steps(
        ["--size", "tiny", "--steps", "100000", "--eval-batches", "0", "--nvme-path", str(nvme)],
        tmp_path / "rep",
    )
    assert code == 130, output[-3000:]
    assert "Traceback" not in output
    assert list(nvme.iterdir()) == []
    assert _records(tmp_path / "rep")[-1]["interrupted"] is True


@needs_engine
@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.05 * i + 0.013 * (i % 3) for i in range(16)])
def test_ctrl_c_anywhere_in_a_step(tmp_path, delay):
    """Ctrl-C lands at a different point of a step each time (in a hook, inside the store's
    bookkeeping, during the background update): always exit 130, no traceback, no swap file
    left. Two store bugs (an interrupt inside a write's submission, or between a transfer's
    completion and its record) were found this way. `pytest -m slow tests/test_demo.py`."""
    nvme = tmp_path / "nvme"
    code, output = _interrupt_after_steps(
        ["--size", "tiny", "--steps", "100000", "--eval-batches", "0", "--nvme-path", str(nvme)],
        tmp_path / "rep",
        extra_delay=delay,
    )
    assert code == 130, output[-3000:]
    assert "Traceback" not in output
    assert list(nvme.iterdir()) == []


@needs_engine
@pytest.mark.heavy
def test_two_ranks_report_the_run_s_loss_and_tokens(tmp_path):
    """With ``--nproc 2`` rank 0 reported its own step: the loss of its own batch and its own
    tokens (half the run's tokens/s), under a header saying "2 ranks, batch 2 per rank". Now a
    step's record is the run's: the mean of the ranks' losses (each rank's stream is seeded
    with --seed + rank) and every rank's tokens."""
    from offload.cli.demo import rss_before_model  # noqa: PLC0415
    from offload.demo.data import ByteCorpus, batches  # noqa: PLC0415
    from offload.demo.model import GPT, config_for_size, lm_loss  # noqa: PLC0415

    cmd = [
        sys.executable, "-m", "offload", "demo", "--size", "tiny", "--steps", "1",
        "--batch-size", "2", "--nproc", "2", "--stage", "2", "--eval-batches", "0",
        "--no-progress", "--report", str(tmp_path / "rep"),
    ]  # fmt: skip
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (step,) = [r for r in _records(tmp_path / "rep") if r["kind"] == "step"]

    gcfg = config_for_size("tiny")  # the demo's model, made as it makes it
    torch.manual_seed(0)
    corpus = ByteCorpus.from_stdlib()
    rss_before_model()
    model = GPT(gcfg)
    losses = []
    with torch.no_grad():
        for rank in (0, 1):
            x, y = next(batches(corpus.train, 2, gcfg.seq_len, seed=rank))
            losses.append(float(lm_loss(model(x), y)))
    assert step["tokens"] == 2 * 2 * gcfg.seq_len
    assert step["loss"] == pytest.approx(sum(losses) / 2, abs=1e-5), losses


_STUCK_RANK = """
import os, sys, time
import offload.demo.model
from offload.cli.main import main

if os.environ["RANK"] == "1":  # stuck in its first forward (a hung data or device call)
    offload.demo.model.GPT.forward = lambda self, *a, **k: time.sleep(100)
main(["demo", "--size", "tiny", "--steps", "2", "--no-progress", "--no-report",
      "--eval-batches", "0", "--config", {config!r}])
"""


@needs_engine
@pytest.mark.heavy
def test_a_rank_whose_peer_is_stuck_ends_at_the_distributed_timeout(tmp_path):
    """Rank 0 said at ``distributed.timeout`` (15 s) that its gather did not complete, but its
    process ended only when the stuck rank did (107 s here; 30 minutes, the group's own
    timeout, for one stuck for good): the gather it left pending held the exit. The demo's
    group now has ``distributed.timeout`` as its own timeout."""
    from dist_harness import start_ranks, wait_all  # noqa: PLC0415

    (tmp_path / "c.yaml").write_text("distributed: {timeout: 15}\n")
    (tmp_path / "w.py").write_text(_STUCK_RANK.format(config=str(tmp_path / "c.yaml")))
    procs = start_ranks([sys.executable, str(tmp_path / "w.py")], 2, tmp_path)
    t0 = time.monotonic()
    try:
        ((rc0, _, err0),) = wait_all(procs[:1], 200)
    finally:
        procs[1].kill()
        procs[1].communicate()
    took = time.monotonic() - t0
    assert rc0 == 1 and "did not complete within 15 s (distributed.timeout)" in err0, err0[-2000:]
    assert took < 75, took  # starting, 15 s, the pending gather's 15 s: not the stuck 100 s


@needs_engine
@pytest.mark.heavy
def test_a_rank_s_error_under_nproc_ends_as_in_one_process(tmp_path):
    """A flag the ranks refuse (a --nvme-path that cannot be made) printed its one line on
    each rank, then torchrun's own traceback and failure summary (40 lines), and ended with
    torchrun's status 1 where one process ends with 2. Now: the ranks' lines, one line
    naming the rank that failed first, and its status."""
    cmd = [
        sys.executable, "-m", "offload", "demo", "--size", "tiny", "--steps", "1",
        "--nproc", "2", "--nvme-path", "/dev/null/swap", "--no-progress", "--no-report",
    ]  # fmt: skip
    run = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "cannot make a swap directory in '/dev/null/swap'" in run.stderr
    assert "Traceback" not in run.stderr and "ChildFailedError" not in run.stderr, run.stderr
    assert "offload demo: rank " in run.stderr and "exited with status 2" in run.stderr


_KILLED_STORE = """
import os, signal, sys
from offload.io import NvmeStore
store = NvmeStore(sys.argv[1])
store.allocate("k", 1 << 20)
print(store.directory, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_store_in(path: Path) -> str:
    """A swap directory in ``path`` whose owner died by SIGKILL (a killed demo's)."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", _KILLED_STORE, str(path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(root)),
        timeout=120,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    left = out.stdout.strip()
    assert os.path.isdir(left), left
    return left


@pytest.mark.parametrize("given", [False, True])
def test_a_killed_demo_s_swap_is_reclaimed_by_the_next_demo(tmp_path, monkeypatch, given):
    """The demo swaps into one directory of its own per user (or ``--nvme-path``), not a new
    temporary one per run: a demo killed outright left its swap files in a directory no later
    run looked in, for good; the next demo's stores reclaim them as any store on a path does.
    Two demos at once still each have their own store directory."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    where = tmp_path / "swap" if given else tmp_path / f"offload-demo-{os.getuid()}"
    where.mkdir()
    dead = _killed_store_in(where)
    extra = ["--nvme-path", str(where)] if given else []
    assert run_main("--size", "tiny", "--steps", "2", "--no-report", *extra) == 0
    assert not os.path.exists(dead)
    assert not list(where.glob("offload-*"))  # the demo's own went with it
