"""End-to-end: the demo GPT trained through offload.wrap against its ceilings and its peers, one run.

    python benchmarks/bench_e2e.py [--size 50M] [--batch 4] [--seq 128] [--reps 5] [--path /work]
        [--buffers 8,14]   # the two pools' buffer counts; the bars are defined at 8,14

Prints one table (and --json FILE writes it):

- cpu tier: optimizer on the CPU, params on the compute device (device="cpu", fp32) against plain
  PyTorch with torch.optim.AdamW(fused=True) on the same model and data. Bar: <= 1.0x.
- nvme: params and optimizer state on NVMe with a host budget (all swap buffers) at most 1/4 of
  the model's fp32 state. Step time (steady state: one iteration's start to the next one's,
  see nvme_sample) against max(compute-only step, IO bytes / disk bandwidth measured in this
  run, CPU Adam time), with the serial sum beside it. Bar: <= 1.25x of the max. The time with
  the last background update drained is shown beside it.
  Peak RSS growth during those steps against the documented budget (buffers + 4 units + 48 MiB).
- nvme, step in backward: the same with ``offload_optimizer.step_in_backward`` (each unit updated
  as its backward completes; gradients never go to disk), against its own ceiling (its own IO
  bytes), interleaved with the default one; its peak RSS in a fresh process of its own.
- nvme recipe: the default config with accumulation 2 and clipping 1.0 (norms that clip, and
  norms under the threshold) against the recipe's plain compute. Bar: <= 1.10x. The clipping row
  also prints the floor of any exact schedule in the bars' memory budget (clip_floor).
- deepspeed: the same model, batch and placement under DeepSpeed ZeRO-3 with NVMe offload, run by
  the peers' Python (../shared/anchors/setup-peers.sh) in a subprocess; "unavailable" without it.

Variants inside this process are interleaved (A B C D, A B C D, ...) and reported as medians.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import offload  # noqa: E402
from offload.api.wrap import engine_of  # noqa: E402
from offload.config import parse_size  # noqa: E402
from offload.demo.model import GPT, config_for_size, lm_loss  # noqa: E402
from offload.io import AsyncIO, aligned_empty  # noqa: E402
from offload.optim import adam_step  # noqa: E402
from offload.plan.traffic import predict_iteration  # noqa: E402

PEERS_PY = Path(os.environ.get("PEERS_VENV", "/work/peers-venv")) / "bin" / "python"


def train_step(model, opt, x) -> None:
    loss = lm_loss(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()


RECIPE_DATA = torch.Generator().manual_seed(1)
"""The recipe's batches: a fresh random batch per micro-step, as a training loop's data. On one
batch used again and again the demo GPT learns it within a few steps (the recipe's gradient norm
fell from 1.5 to 0.01 in 25 steps), and clipping stopped triggering after the third: the rows
meant to clip ran the speculative update instead (before 2026-12-01 10:45)."""


def recipe_step(model, opt, x, scale: float = 3.0) -> None:
    """What fine-tuning recipes run: accumulation 2 (two micro-batches the shape of ``x``, fresh
    ones from ``RECIPE_DATA``; its compute ceiling is :func:`recipe_compute_step`) and
    clipping at 1.0 (``gradient_clipping`` in the config). ``scale`` multiplies the loss (Adam's
    update does not depend on the gradients' scale, but for ``eps``). On these batches the
    gradient norm at scale 1 starts at 1.5 and drifts toward 1.0 as the model learns their
    distribution (in one run of bench_e2e half the steps still clipped), so the default, 3, keeps
    it at 2.4-4.1: clipping triggers in every step. At 0.5 the norms are under the threshold, as
    in fine-tuning once clipping rarely triggers. The rows print how many steps clipped, so the
    regime is measured, not assumed."""
    for _ in range(2):
        micro = torch.randint(0, 256, x.shape, generator=RECIPE_DATA)
        (lm_loss(model(micro[:, :-1]), micro[:, 1:]) * (scale / 2)).backward()
    opt.step()
    opt.zero_grad()


def unclipped_step(model, opt, x) -> None:
    """:func:`recipe_step` with norms under the clipping threshold."""
    recipe_step(model, opt, x, scale=0.5)


NVME_RUN = 4  # consecutive NVMe iterations per timed sample (after one untimed lead-in)


def nvme_sample(model, opt, x, step=train_step) -> tuple[float, float]:
    """(steady-state seconds per iteration, seconds per iteration with the final drain).

    The NVMe update runs in the background into the next forward (by design), so one iteration
    of a training run is the time from one iteration's start to the next one's. The sample
    starts idle, runs one lead-in iteration (whose forward has no update to wait for), then
    times ``NVME_RUN`` iterations back to back: each of them carries exactly one update, the
    previous iteration's. The last update is then waited for (``synchronize``); that drain is
    paid once per run, or per checkpoint, and is reported separately."""
    step(model, opt, x)  # lead-in: its update spills into the first timed iteration
    t0 = time.perf_counter()
    for _ in range(NVME_RUN):
        step(model, opt, x)
    t1 = time.perf_counter()
    opt.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / NVME_RUN, (t2 - t0) / NVME_RUN


def store_bytes(model) -> dict[str, int]:
    """Cumulative bytes per tier pair over the engine's stores (background IO included once it
    has completed): the counters telemetry reads."""
    from offload.runtime.telemetry import store_totals  # noqa: PLC0415

    return store_totals(engine_of(model).counted())[0]


def step_counts(opt) -> dict[str, float]:
    """Cumulative counts of where the updates ran, and the seconds the training thread spent
    in offload's hooks (telemetry's totals)."""
    total = opt.stats()["total"]
    return {
        k: total.get(k, 0)
        for k in ("clipped_steps", "updates_in_backward", "rollbacks", "hook_seconds")
    }


def compute_step(model, x) -> None:
    loss = lm_loss(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    model.zero_grad(set_to_none=True)


PLAIN_RECIPE_DATA = torch.Generator().manual_seed(2)


def recipe_compute_step(model, x) -> None:
    """Plain PyTorch's forward and backward of :func:`recipe_step`, the recipe's compute ceiling:
    two fresh micro-batches, the second backward accumulating into ``p.grad`` (the add that
    ``AccumulateGrad`` does), the gradients dropped after. Twice :func:`compute_step` leaves that
    add out (the recipe rows print both; benchmarks/README.md). Clipping's norm and scale are
    left out (in plain PyTorch they belong to the step, not to the model's compute)."""
    for _ in range(2):
        micro = torch.randint(0, 256, x.shape, generator=PLAIN_RECIPE_DATA)
        (lm_loss(model(micro[:, :-1]), micro[:, 1:]) * 0.5).backward()
    model.zero_grad(set_to_none=True)


def forward_step(model, x) -> None:
    """Plain PyTorch's forward (and loss) of one micro-batch, as in training: the graph is built,
    then dropped. The one pass of :func:`clip_floor`'s window."""
    lm_loss(model(x[:, :-1]), x[:, 1:])


def clip_floor(compute: float, forward: float, n: int, held: float, rd_bw: float, wr_bw: float):
    """The least iteration time of an exact schedule of the clipping recipe that stores each
    fp32 state byte once on disk (nothing recomputed) and holds at most ``held`` bytes in host
    memory: ``(floor seconds, seconds of disk work in the window)`` (benchmarks/README.md,
    bench_e2e, "The clipping floor").

    When clipping triggers, every new parameter depends on the global norm, known only when the
    last backward ends, and the next forward needs a unit's new parameters before it runs the
    unit. Between those two moments only that forward computes, and every unit is updated:

    - at its update, the unit's parameters (the fp32 master), both moments and its gradient sum
      are in memory, 16 B a parameter; at most ``held`` of them were in memory before, so the
      rest is read in the window;
    - when the forward ends, the new parameters and moments (12 B) are in memory or on disk; at
      most ``held`` in memory, so the rest is written in the window.

    The disk is modelled as in the ceiling: reads and writes share its time. The rest of the
    iteration's compute lies outside the window, so the floor is that compute plus the longer
    of the forward and the window's disk work."""
    window = max(0.0, 16 * n - held) / rd_bw + max(0.0, 12 * n - held) / wr_bw
    return compute - forward + max(forward, window), window


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class PeakRSS:
    """Samples this process's RSS every 2 ms while active."""

    def __init__(self) -> None:
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()

    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def disk_bandwidth(path: Path, nbytes: int, cfg_aio: dict) -> tuple[float, float]:
    """(read, write) bytes/s of sequential O_DIRECT IO through AsyncIO at the engine's settings."""
    buf = aligned_empty(nbytes)
    buf.fill_(7)
    f = path / "bw.scratch"
    with AsyncIO(**cfg_aio) as aio:
        tw = timed(lambda: aio.write(buf, str(f)).wait())
        tr = timed(lambda: aio.read(buf, str(f)).wait())
    f.unlink()
    return nbytes / tr, nbytes / tw


def deepspeed_step(args, nvme_dir: Path) -> dict:
    if not PEERS_PY.exists():
        return {
            "status": f"unavailable: {PEERS_PY} not found (run ../shared/anchors/setup-peers.sh)"
        }
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(PEERS_PY.parents[1] / "torch_extensions"))
    cmd = [
        str(PEERS_PY),
        str(ROOT / "benchmarks" / "_ds_zero3.py"),
        "--size",
        args.size,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.reps),
        "--nvme",
        str(nvme_dir),
    ]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return {"status": "unavailable: DeepSpeed run timed out"}
    if out.returncode != 0:
        return {
            "status": "unavailable: DeepSpeed failed: " + out.stderr.strip().splitlines()[-1][:300]
        }
    return {"status": "ok", **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="50M")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--path", default="/work", help="directory on the disk under test")
    ap.add_argument("--buffer-size", default="8MiB")
    add_buffers(ap)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--step-in-backward", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_only:
        return memory_only(args)

    torch.manual_seed(0)
    gcfg = config_for_size(args.size, seq_len=args.seq)
    base = GPT(gcfg)
    n = sum(p.numel() for p in base.parameters())
    x = torch.randint(0, 256, (args.batch, args.seq + 1))
    work = Path(tempfile.mkdtemp(prefix="bench_e2e-", dir=args.path))
    buf = parse_size(args.buffer_size)
    aio = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2}
    nvme_cfg = nvme_config(work / "default", buf, aio, counts=args.buffers)
    host_budget = host_buffers(nvme_cfg)
    fp32_state = 16 * n
    machine = f"{psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, torch {torch.__version__}"
    print(f"# bench_e2e  {time.strftime('%Y-%m-%d %H:%M')}  {machine}")
    print(
        f"# model {n / 1e6:.1f}M params ({gcfg.n_layer} layers x d{gcfg.d_model}), batch {args.batch} x seq {args.seq}, fp32"
    )
    print(
        f"# nvme: host budget {host_budget / 2**20:.0f} MiB = 1/{fp32_state / host_budget:.1f} of the fp32 state ({fp32_state / 2**20:.0f} MiB)"
    )
    if args.buffers != BUFFERS:
        print(
            f"# --buffers {args.buffers[0]},{args.buffers[1]}: not the bars' budget "
            f"({BUFFERS[0]},{BUFFERS[1]}); the NVMe bars below are printed for reference only"
        )

    plain = copy.deepcopy(base)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)
    tier_model, tier_opt = offload.wrap(
        copy.deepcopy(base),
        {
            "device": "cpu",
            "dtype": "fp32",
            "optimizer": {"lr": 1e-4},
            "offload_param": {"device": "none"},
            "offload_optimizer": {"device": "cpu"},
        },
    )
    compute_model = copy.deepcopy(base)
    nv_model, nv_opt = offload.wrap(copy.deepcopy(base), nvme_cfg)
    sib_cfg = nvme_config(work / "sib", buf, aio, step_in_backward=True, counts=args.buffers)
    sib_model, sib_opt = offload.wrap(copy.deepcopy(base), sib_cfg)
    recipe_cfg = nvme_config(work / "recipe", buf, aio, step_in_backward=True, counts=args.buffers)
    recipe_cfg["gradient_clipping"] = 1.0  # accumulation: "auto", learned from the first step
    rc_model, rc_opt = offload.wrap(copy.deepcopy(base), recipe_cfg)
    un_cfg = nvme_config(work / "unclipped", buf, aio, step_in_backward=True, counts=args.buffers)
    un_cfg["gradient_clipping"] = 1.0
    un_model, un_opt = offload.wrap(copy.deepcopy(base), un_cfg)
    for _ in range(2):  # warm-up (the first NVMe step also records the prefetch trace)
        train_step(plain, plain_opt, x)
        train_step(tier_model, tier_opt, x)
        compute_step(compute_model, x)
        recipe_compute_step(compute_model, x)
        train_step(nv_model, nv_opt, x)
        nv_opt.synchronize()
        train_step(sib_model, sib_opt, x)
        sib_opt.synchronize()
        recipe_step(rc_model, rc_opt, x)
        rc_opt.synchronize()
        unclipped_step(un_model, un_opt, x)
        un_opt.synchronize()
    t = {
        k: []
        for k in (
            "plain", "tier", "compute", "recipe_compute", "forward", "nvme", "nvme_drained",
            "sib", "sib_drained", "recipe", "recipe_drained", "unclipped", "unclipped_drained",
        )
    }  # fmt: skip
    bytes0 = store_bytes(nv_model)
    nv_counts0 = step_counts(nv_opt)
    sib_bytes0 = store_bytes(sib_model)
    sib_counts0 = step_counts(sib_opt)
    rc_bytes0 = store_bytes(rc_model)
    rc_counts0 = step_counts(rc_opt)
    un_bytes0 = store_bytes(un_model)
    un_counts0 = step_counts(un_opt)
    bw = []  # (read, write) bytes/s, one measurement per rep: the disk varies as much as the rest
    for _ in range(args.reps):
        t["plain"].append(timed(lambda: train_step(plain, plain_opt, x)))
        t["tier"].append(timed(lambda: train_step(tier_model, tier_opt, x)))
        t["compute"].append(timed(lambda: compute_step(compute_model, x)))
        t["recipe_compute"].append(timed(lambda: recipe_compute_step(compute_model, x)))
        t["forward"].append(timed(lambda: forward_step(compute_model, x)))
        steady, drained = nvme_sample(nv_model, nv_opt, x)
        t["nvme"].append(steady)
        t["nvme_drained"].append(drained)
        steady, drained = nvme_sample(sib_model, sib_opt, x)
        t["sib"].append(steady)
        t["sib_drained"].append(drained)
        steady, drained = nvme_sample(rc_model, rc_opt, x, step=recipe_step)
        t["recipe"].append(steady)
        t["recipe_drained"].append(drained)
        steady, drained = nvme_sample(un_model, un_opt, x, step=unclipped_step)
        t["unclipped"].append(steady)
        t["unclipped_drained"].append(drained)
        bw.append(disk_bandwidth(work, 256 << 20, aio))
    bytes1 = store_bytes(nv_model)
    nv_counts = {k: v - nv_counts0[k] for k, v in step_counts(nv_opt).items()}
    sib_bytes1 = store_bytes(sib_model)
    sib_counts = {k: v - sib_counts0[k] for k, v in step_counts(sib_opt).items()}
    rc_bytes1 = store_bytes(rc_model)
    rc_counts = {k: v - rc_counts0[k] for k, v in step_counts(rc_opt).items()}
    un_bytes1 = store_bytes(un_model)
    un_counts = {k: v - un_counts0[k] for k, v in step_counts(un_opt).items()}
    planned = {
        "nvme": predict_iteration(engine_of(nv_model).plan),
        "sib": predict_iteration(engine_of(sib_model).plan),
        # the norms are > 1 here: clipping triggers every step, so the step in backward updates
        # after the backward (speculating would redo every update)
        "recipe": predict_iteration(engine_of(rc_model).plan, 2, after_backward=True),
        # norms under the threshold: speculative, kept; the grads are kept for a redo
        "unclipped": predict_iteration(engine_of(un_model).plan, 2, retained=True),
    }
    rd_bw = statistics.median(r for r, _ in bw)
    wr_bw = statistics.median(w for _, w in bw)
    p, g, m, v = torch.zeros(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    adam = statistics.median(
        timed(
            lambda: adam_step(
                p, g, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
            )
        )
        for _ in range(3)
    )
    med = {k: statistics.median(vs) for k, vs in t.items()}
    iters = args.reps * (NVME_RUN + 1)  # every update completed (synchronize ends each sample)

    def nvme_row(key: str, b0: dict, b1: dict, counts: dict, compute_key: str = "compute") -> dict:
        """``compute_key``: the plain model's fwd+bwd of this row's iteration."""
        rd, wr = ((b1.get(k, 0) - b0.get(k, 0)) / iters for k in ("nvme->host", "host->nvme"))
        plan = planned[key]
        need_rd = sum(st.fetched for st in plan.stores.values())
        need_wr = sum(st.written for st in plan.stores.values())
        io_time = rd / rd_bw + wr / wr_bw
        compute = med[compute_key]
        ceiling = max(compute, io_time, adam)
        return {
            "read_B_per_param": rd / n,
            "write_B_per_param": wr / n,
            "planned_read_B_per_param": need_rd / n,
            "planned_write_B_per_param": need_wr / n,
            "step_s": med[key],
            "step_with_drain_s": med[key + "_drained"],
            "compute_only_s": compute,
            "io_s": io_time,
            "read_MB": rd / 1e6,
            "write_MB": wr / 1e6,
            "disk_read_GBps": rd_bw / 1e9,
            "disk_write_GBps": wr_bw / 1e9,
            "cpu_adam_s": adam,
            "max_s": ceiling,
            "ratio_to_max": med[key] / ceiling,
            "serial_sum_s": compute + io_time + adam,
            # offload's work on the training thread (mean over every iteration of the samples)
            "hook_s": counts["hook_seconds"] / iters,
            "bar": "<= 1.25",
        }

    def recipe_row(key: str, b0: dict, b1: dict, counts: dict) -> dict:
        """A recipe row against plain PyTorch's compute of the recipe (recipe_compute_step),
        with its ratio to twice one fwd+bwd beside it (the ceiling before 2026-12-01 19:59)."""
        row = nvme_row(key, b0, b1, counts, compute_key="recipe_compute")
        two = max(2 * med["compute"], row["io_s"], adam)
        return {
            **row,
            **{f"{k}_per_step": v / iters for k, v in counts.items() if k != "hook_seconds"},
            "two_fwd_bwd_s": 2 * med["compute"],
            "ratio_to_max_two_fwd_bwd": med[key] / two,
            "bar": "<= 1.10",
        }

    mem = memory_subprocess(args)
    sib_mem = memory_subprocess(args, step_in_backward=True)
    rows = {
        "cpu_tier": {
            "torch_fused_s": med["plain"],
            "offload_s": med["tier"],
            "ratio": med["tier"] / med["plain"],
            "bar": "<= 1.0",
        },
        "nvme": nvme_row("nvme", bytes0, bytes1, nv_counts),
        "nvme_step_in_backward": nvme_row("sib", sib_bytes0, sib_bytes1, sib_counts),
        "nvme_recipe": recipe_row("recipe", rc_bytes0, rc_bytes1, rc_counts),
        "nvme_recipe_unclipped": recipe_row("unclipped", un_bytes0, un_bytes1, un_counts),
        "memory": mem,  # a fresh process of its own (memory_only)
        "memory_step_in_backward": sib_mem,
    }
    clip = rows["nvme_recipe"]
    held = max(mem["budget_MiB"], sib_mem["budget_MiB"]) * 2**20  # the bars' memory budget
    floor, window = clip_floor(clip["compute_only_s"], med["forward"], n, held, rd_bw, wr_bw)
    floor = max(floor, clip["max_s"])  # the ceiling's terms bound every schedule too
    clip.update(forward_s=med["forward"], floor_held_MiB=held / 2**20, floor_window_io_s=window)
    if clip["clipped_steps_per_step"] >= 1:  # the floor is that of steps that clip
        clip.update(
            floor_s=floor,
            ratio_to_floor=clip["step_s"] / floor,
            floor_over_max=floor / clip["max_s"],
        )
    else:
        clip.update(floor_s=None, ratio_to_floor=None, floor_over_max=None)
    tier_opt.close()
    nv_opt.close()
    sib_opt.close()
    rc_opt.close()
    un_opt.close()
    ds = {"status": "skipped (--no-deepspeed)"} if args.no_deepspeed else deepspeed_step(args, work)
    if ds.get("status") == "ok":
        ds["offload_nvme_over_deepspeed"] = med["nvme"] / ds["median_step_s"]
        ds["step_in_backward_over_deepspeed"] = med["sib"] / ds["median_step_s"]
    rows["deepspeed_zero3_nvme"] = ds
    shutil.rmtree(work, ignore_errors=True)

    r = rows
    print()
    print("| what | offload | reference | ratio | bar |")
    print("|---|---|---|---|---|")
    print(
        f"| cpu tier step (opt on CPU) | {r['cpu_tier']['offload_s']:.3f} s | torch AdamW(fused) {r['cpu_tier']['torch_fused_s']:.3f} s | {r['cpu_tier']['ratio']:.2f}x | <= 1.0x |"
    )
    for key, label in (
        ("nvme", "nvme, update after backward"),
        ("nvme_step_in_backward", "nvme, step in backward (default)"),
        ("nvme_recipe", "nvme recipe: default, accumulation 2, clipping 1.0 (triggers)"),
        ("nvme_recipe_unclipped", "nvme recipe, norms under the clipping threshold"),
    ):
        nv = r[key]
        bar = "<= 1.10x" if key.startswith("nvme_recipe") else "<= 1.25x"
        print(
            f"| {label} (params+opt on NVMe) | {nv['step_s']:.3f} s | max(compute {nv['compute_only_s']:.3f}, IO {nv['io_s']:.3f}, Adam {nv['cpu_adam_s']:.3f}) = {nv['max_s']:.3f} s; serial sum {nv['serial_sum_s']:.3f} s | {nv['ratio_to_max']:.2f}x | {bar} |"
        )
        print(
            f"| {label} incl. the final drain | {nv['step_with_drain_s']:.3f} s | (waiting for the last background update, spread over {NVME_RUN} iterations) | {nv['step_with_drain_s'] / nv['max_s']:.2f}x | |"
        )
        print(
            f"| {label}: IO per iteration | read {nv['read_MB']:.0f} MB, write {nv['write_MB']:.0f} MB | disk {nv['disk_read_GBps']:.2f} / {nv['disk_write_GBps']:.2f} GB/s (read/write, same run) | | |"
        )
        print(
            f"| {label}: bytes per parameter | read {nv['read_B_per_param']:.1f}, write {nv['write_B_per_param']:.1f} | the plan's (no cache hits): read {nv['planned_read_B_per_param']:.1f}, write {nv['planned_write_B_per_param']:.1f} | | |"
        )
        rest = nv["step_s"] - nv["compute_only_s"] - nv["hook_s"]
        print(
            f"| {label}: offload's hooks on the training thread | {nv['hook_s']:.3f} s per iteration | compute + hooks {nv['compute_only_s'] + nv['hook_s']:.3f} s; the rest {rest:.3f} s (step(), offload's threads beside the compute) | {(nv['compute_only_s'] + nv['hook_s']) / nv['max_s']:.2f}x | |"
        )
        if "two_fwd_bwd_s" in nv:
            print(
                f"| {label}: against twice one fwd+bwd (no accumulation) | | compute {nv['two_fwd_bwd_s']:.3f} s | {nv['ratio_to_max_two_fwd_bwd']:.2f}x | |"
            )
        if "floor_s" in nv and nv["floor_s"] is None:
            print(
                f"| {label}: the floor of an exact schedule | | not every step clipped ({nv['clipped_steps_per_step']:.2f} per step): no floor | | |"
            )
        elif "floor_s" in nv:
            print(
                f"| {label}: the floor of an exact schedule in {nv['floor_held_MiB']:.0f} MiB, nothing recomputed | {nv['step_s']:.3f} s | compute {nv['compute_only_s']:.3f} - forward {nv['forward_s']:.3f} + max(forward, disk work from the norm to the forward's end {nv['floor_window_io_s']:.3f}) = {nv['floor_s']:.3f} s, {nv['floor_over_max']:.2f}x the ceiling | {nv['ratio_to_floor']:.2f}x | |"
            )
        if "rollbacks_per_step" in nv:
            print(
                f"| {label}: clipped / updated in backward / rolled back, per step | {nv['clipped_steps_per_step']:.2f} / {nv['updates_in_backward_per_step']:.2f} / {nv['rollbacks_per_step']:.2f} | | | |"
            )
    nv, sib = r["nvme"], r["nvme_step_in_backward"]
    print(
        f"| nvme, step in backward vs default | {sib['step_s']:.3f} s | {nv['step_s']:.3f} s | {sib['step_s'] / nv['step_s']:.2f}x | (lower is better) |"
    )
    for key, label in (("memory", "nvme"), ("memory_step_in_backward", "nvme, step in backward")):
        me = r[key]
        print(
            f"| peak RSS growth ({label}) | {me['rss_growth_MiB']:.0f} MiB | budget {me['budget_MiB']:.0f} MiB (buffers {me['host_buffers_MiB']:.0f}); fp32 state {me['fp32_state_MiB']:.0f} MiB | {me['rss_growth_MiB'] / me['budget_MiB']:.2f}x | <= 1.0x |"
        )
    if ds.get("status") == "ok":
        print(
            f"| DeepSpeed ZeRO-3 NVMe step | {nv['step_s']:.3f} s | {ds['median_step_s']:.3f} s | {ds['offload_nvme_over_deepspeed']:.2f}x | (lower is better) |"
        )
        print(
            f"| DeepSpeed ZeRO-3 NVMe step vs step in backward | {sib['step_s']:.3f} s | {ds['median_step_s']:.3f} s | {ds['step_in_backward_over_deepspeed']:.2f}x | (lower is better) |"
        )
    else:
        print(f"| DeepSpeed ZeRO-3 NVMe step | | {ds['status']} | | |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def host_buffers(cfg: dict) -> int:
    """Bytes of both swap pools (the host budget)."""
    return sum(
        cfg[s]["buffer_count"] * cfg[s]["buffer_size"]
        for s in ("offload_param", "offload_optimizer")
    )


BUFFERS = (8, 14)
"""``buffer_count`` of the NVMe rows' ``offload_param`` and ``offload_optimizer`` pools: 22
buffers, at ``--buffer-size`` 8MiB 1/4.3 of the 50M GPT's fp32 state; the bars are defined
there."""


def buffer_counts(spec: str) -> tuple[int, int]:
    """``"PARAM,OPT"`` -> the two pools' buffer counts (argparse's type of ``--buffers``)."""
    param, _, opt = spec.partition(",")
    if not (param.isdigit() and opt.isdigit() and int(param) >= 1 and int(opt) >= 4):
        raise argparse.ArgumentTypeError(
            f"{spec!r}: allowed: PARAM,OPT buffer counts, PARAM >= 1 and OPT >= 4 (the NVMe "
            "step's pieces in flight), e.g. 12,46"
        )
    return int(param), int(opt)


def add_buffers(ap: argparse.ArgumentParser) -> None:
    """``--buffers``: other pools than the bars' (what more host memory buys;
    benchmarks/README.md, bench_e2e)."""
    ap.add_argument(
        "--buffers",
        type=buffer_counts,
        default=BUFFERS,
        help=f"buffer counts PARAM,OPT of the NVMe rows' two pools (default {BUFFERS[0]},"
        f"{BUFFERS[1]}, the bars' host budget)",
    )


def nvme_config(
    work: Path,
    buf: int,
    aio: dict,
    step_in_backward: bool = False,
    counts: tuple[int, int] = BUFFERS,
) -> dict:
    (work / "p").mkdir(parents=True, exist_ok=True)
    (work / "o").mkdir(parents=True, exist_ok=True)
    return {
        "device": "cpu",
        "dtype": "fp32",
        "aio": aio,
        "offload_param": {
            "device": "nvme",
            "nvme_path": str(work / "p"),
            # the bars' 8 of 22 buffers: a unit (19 MiB, 3 pieces) gathered, the update's 2 and
            # the next unit read beside them (6 / 16 made wrap warn: the gathers waited for reads)
            "buffer_count": counts[0],
            "buffer_size": buf,
            "persistence_threshold": 0,
        },
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": str(work / "o"),
            "buffer_count": counts[1],
            "buffer_size": buf,
            "step_in_backward": step_in_backward,
        },
        "prefetch": {"depth": 2},
    }


def memory_only(args) -> int:
    """Fresh process: RSS before the model exists, then the peak while training on NVMe."""
    from offload.api.wrap import engine_of  # noqa: PLC0415

    torch.manual_seed(0)
    gcfg = config_for_size(args.size, seq_len=args.seq)
    # one short sequence: activations (not offload's to budget) stay negligible
    x = torch.randint(0, 256, (1, 33))
    warm = torch.nn.Linear(8, 1)  # what every loop pays once: autograd, torch.optim's imports
    warm(torch.randn(2, 8)).sum().backward()
    torch.optim.SGD(warm.parameters(), lr=0.1).step()
    compute_step(GPT(config_for_size("tiny")), torch.randint(0, 256, (1, 9)))
    work = Path(tempfile.mkdtemp(prefix="bench_e2e-mem-", dir=args.path))
    buf = parse_size(args.buffer_size)
    rss0 = psutil.Process().memory_info().rss  # before the model exists
    model = GPT(gcfg)
    n = sum(p.numel() for p in model.parameters())
    aio = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2}
    cfg = nvme_config(work, buf, aio, step_in_backward=args.step_in_backward, counts=args.buffers)
    model, opt = offload.wrap(model, cfg)  # frees the model's storage
    unit = max(u.layout.trainable for u in engine_of(model).units)
    after_wrap = psutil.Process().memory_info().rss
    with PeakRSS() as rss:
        for _ in range(args.reps + 1):
            train_step(model, opt, x)
    opt.close()
    shutil.rmtree(work, ignore_errors=True)
    buffers = host_buffers(cfg)
    budget = buffers + 4 * 4 * unit + 48 * 2**20
    print(
        json.dumps(
            {
                "rss_growth_MiB": (rss.peak - rss0) / 2**20,
                "after_wrap_MiB": (after_wrap - rss0) / 2**20,
                "budget_MiB": budget / 2**20,
                "fp32_state_MiB": 16 * n / 2**20,
                "host_buffers_MiB": buffers / 2**20,
            }
        )
    )
    return 0


def memory_subprocess(args, step_in_backward: bool = False) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--memory-only",
        "--size",
        args.size,
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--reps",
        str(args.reps),
        "--path",
        args.path,
        "--buffer-size",
        args.buffer_size,
        "--buffers",
        ",".join(map(str, args.buffers)),
        *(["--step-in-backward"] if step_in_backward else []),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError("memory run failed: " + out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
