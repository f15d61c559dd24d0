"""The one prepared script for a lent GPU: CUDA parity for every placement and a throughput run.

    python benchmarks/gpu_smoke.py [--device cuda] [--seconds 120] [--nvme-path DIR]
        [--skip-parity] [--skip-throughput]

Part 1 runs the engine parity checks (the same model and loops as tests/test_wrap_parity.py) with
the compute on ``--device``: fp32 against torch.optim.AdamW(foreach=False) and bf16 against the
reference mixed-precision loop, for params on none/cpu/nvme x optimizer on cpu/nvme; then
``offload_optimizer.step_in_backward`` against the default step (bitwise equal). Part 2 trains
the demo GPT (~125M) in bf16 with params and optimizer on NVMe and prints tokens/s and the step
split. Part 3 (``group_parity``) runs ZeRO stages 1-3 through a process group of one rank
(NCCL on CUDA, gloo on the CPU) whose collectives run all the same (``wrap``'s
``_one_rank_collectives``): the NCCL staging, the device-side flattening and reduce-scatter,
the stage-3 gathers into per-parameter storages, against the fp32 reference. Before all of
them, ``device_checks`` tests each CUDA branch of ``offload.device`` alone, with a stream kept
busy so that a missing wait shows as wrong values (fences, the compute stream's waits, the
writer's pinned slots, a user's non-default stream, a second thread) and measures what pinned
pools cost; ``side_stream_parity`` trains under a user's own stream; ``device_write_check``
sees a write through ``p.data`` into device-resident parameters. Each row is one JSON line
with ``ok``; the end says how many of each part passed, repeats the failures, and prints
PASS or FAIL. Everything printed is also written as JSON to $OUT/gpu_smoke.json when $OUT is
set. It also runs on the CPU (``--device cpu``) so the script itself is tested here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from engine_models import (  # noqa: E402
    batches,
    lm_loss,
    make_model,
    placement_config,
    reference_fp32,
    reference_mixed,
    train_wrapped,
)

import offload  # noqa: E402


def _max_abs(sd, ref) -> float:
    """Largest absolute difference over all parameters (weights here are O(0.1-1))."""
    return max(
        float((sd[k].detach().float().cpu() - r.detach().float().cpu()).abs().max())
        for k, r in ref.items()
    )


class _Delay:
    """Keeps a stream busy for ``ms`` milliseconds before the work queued after it (CUDA: a
    spinning kernel, ``torch.cuda._sleep``), so that work ordered wrongly against it lands
    first and the check reads the wrong values. On the CPU every copy is done at once and
    there is nothing to delay: the checks then test the script itself."""

    def __init__(self, device: str, ms: float = 50.0) -> None:
        self.cuda = device.startswith("cuda")
        self.cycles = 0
        if self.cuda:  # the SM clock in kHz where torch says it; ~2 GHz otherwise
            khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 2e6
            self.cycles = int(khz * ms)

    def on(self, stream=None) -> None:
        if not self.cuda:
            return
        if stream is None:
            torch.cuda._sleep(self.cycles)
        else:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(self.cycles)


def _guarded(name: str, run) -> list[dict]:
    """``run()``'s rows, or one failed row saying what it raised (the parts after it still
    run: one broken check must not hide the others)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - reported as the check's failure
        row = {"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        print(json.dumps(row), flush=True)
        return [row]


def _check(rows: list[dict], name: str, ok: bool, **numbers) -> None:
    rows.append({"check": name, "ok": bool(ok), **numbers})
    print(json.dumps(rows[-1]), flush=True)


def device_checks(device: str) -> list[dict]:
    """The CUDA branches of ``offload.device`` one by one, each made to fail if its ordering
    were wrong (a stream kept busy so that a missing wait lets the other side land first):
    the fence before a copy into memory the compute stream still writes, the compute stream
    waiting for a copy, a copy to the host after the compute that writes its source, the
    writer's two pinned slots reused while copies are in flight, all of it again on a user's
    non-default stream and from a second thread (the update's worker), and what pinned host
    buffers really cost (torch's pinned allocator rounds up to a power of two)."""
    import threading  # noqa: PLC0415

    from offload.device import Transfers, for_device  # noqa: PLC0415

    rows: list[dict] = []
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    memory, _, writer_cls = for_device(dev)
    delay = _Delay(device)
    n = 1 << 22  # 16 MiB of fp32: a copy takes long enough to be caught
    src = memory.empty(n, torch.float32, pin=True)
    src.fill_(2.0)
    _check(rows, "host buffers pinned where CUDA computes", src.is_pinned() == delay.cuda)

    def ordering(label: str, t: Transfers) -> None:
        dst = torch.empty(n, device=dev)
        # 1. the copy waits for the compute queued before it (the fence)
        delay.on()
        dst.fill_(1.0)
        t.to_device([(dst, src)])
        got = float(dst.min().item())  # (.item() waits on the compute stream only)
        _check(
            rows,
            f"{label}: a copy to the device waits for earlier compute",
            got == 2.0,
            min_value=got,
        )
        # 2. the compute stream waits for the copy (order_after)
        delay.on(getattr(t.copier, "_to_device", None))
        t.to_device([(dst, src)])
        dst.add_(1.0)
        got = float(dst.min().item())
        _check(rows, f"{label}: compute after a copy sees its values", got == 3.0, min_value=got)
        # 3. a copy to the host waits for the compute that writes its source
        back = memory.empty(n, torch.float32, pin=True)
        delay.on()
        dst.fill_(5.0)
        t.wait(t.to_host(back, dst), "device->host")
        got = float(back.min())
        _check(
            rows, f"{label}: a copy to the host waits for the compute", got == 5.0, min_value=got
        )
        # 4. the writer's two pinned slots, reused while the copies up are in flight
        w = writer_cls(t, memory, torch.float32)
        k = n // 8
        delay.on(getattr(t.copier, "_to_device", None))
        for j in range(8):
            w.out(dst, j * k, (j + 1) * k).fill_(float(j))
            w.commit(dst, j * k, (j + 1) * k)
        w.quiesce()
        want = torch.arange(8, dtype=torch.float32).repeat_interleave(k)
        bad = int((dst.cpu() != want).sum())
        _check(
            rows,
            f"{label}: the writer's slots are reused only after their copies",
            bad == 0,
            wrong_elements=bad,
        )
        # 5. from another thread (the background update's), ordered on the captured stream
        out: list = []

        def worker() -> None:
            try:
                delay.on(getattr(t.copier, "_to_device", None))
                t.to_device([(dst, src)])
            except BaseException as exc:  # noqa: BLE001 - reported as the check's failure
                out.append(exc)

        th = threading.Thread(target=worker)
        th.start()
        th.join()
        dst.mul_(4.0)  # on the compute stream, after the worker's order_after
        got = float(dst.min().item())
        _check(
            rows,
            f"{label}: a copy queued by another thread orders the compute stream",
            not out and got == 8.0,
            min_value=got,
            error=repr(out[0]) if out else None,
        )

    ordering("default stream", Transfers(dev))
    if delay.cuda:  # the user's own stream, captured as a forward captures it
        side = torch.cuda.Stream(dev)
        with torch.cuda.stream(side):
            t = Transfers(dev)
            t.capture_stream()
            ordering("user's stream", t)
        torch.cuda.current_stream(dev).wait_stream(side)
        rows += _pinned_cost()
    return rows


def _pinned_now(stats) -> int | None:
    """Bytes torch's pinned allocator holds (its blocks, cached ones included, at their
    rounded size), or None where this torch does not say."""
    if stats is None:
        return None
    now = stats()
    held = [now[k] for k in ("allocated_bytes.current", "reserved_bytes.current") if k in now]
    return max(held) if held else None


def _pinned_cost() -> list[dict]:
    """Host bytes a pinned buffer pool really takes (CUDA): one pool of exactly 1 GiB and one
    of 17 x 64 MiB. torch's pinned allocator rounds each allocation up to a power of two, so
    the second one takes 2 GiB: over the budget the config states (a finding, not fixed)."""
    import psutil  # noqa: PLC0415

    from offload.io import BufferPool  # noqa: PLC0415

    rows: list[dict] = []
    proc = psutil.Process()
    for count in (16, 17):
        asked = count * (64 << 20)
        stats = getattr(torch.cuda, "host_memory_stats", None)
        before_rss = proc.memory_info().rss
        before = _pinned_now(stats)
        pool = BufferPool(count, 64 << 20, pin=True)
        after_rss = proc.memory_info().rss
        after = _pinned_now(stats)
        took = (after - before) if before is not None and after is not None else None
        rss = after_rss - before_rss
        cost = took if took else rss
        _check(
            rows,
            f"a pinned pool of {count} x 64 MiB takes what it asks",
            cost <= 1.05 * asked,
            asked_bytes=asked,
            pinned_reserved_bytes=took,
            rss_bytes=rss,
            pinned=pool.pinned,
            why=None
            if cost <= 1.05 * asked
            else "torch's pinned allocator rounds each allocation up to a power of two: the "
            "pool is over the budget its config states (offload.io.aligned, Note on pinning); "
            "pinning exactly needs a mapping of its own registered with cudaHostRegister",
        )
        del pool
    return rows


def parity(device: str, tmp: Path) -> list[dict]:
    rows = []
    data = [d.to(device) for d in batches(16)]
    steps, accum, clip = 10, 2, 1.0
    ref32, ref32_losses = reference_fp32(make_model().to(device), data, steps, accum, clip)
    refbf, refbf_losses = reference_mixed(
        make_model().to(device), data, steps, accum, clip, torch.bfloat16
    )
    for dtype, ref, ref_losses, tol in (
        ("fp32", ref32, ref32_losses, 1e-4),
        ("bf16", refbf, refbf_losses, 2e-2),
    ):
        for p_dev in ("none", "cpu", "nvme"):
            for o_dev in ("cpu", "nvme"):
                cfg = placement_config(p_dev, o_dev, tmp / f"{dtype}-{p_dev}-{o_dev}", dtype=dtype)
                cfg["device"] = device
                t0 = time.perf_counter()
                model, opt = offload.wrap(make_model(), cfg)
                try:
                    losses, _ = train_wrapped(model, opt, data, steps, accum, clip)
                    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
                    param_err = _max_abs(model.state_dict(), ref.state_dict())
                    rows.append(
                        {
                            "dtype": dtype,
                            "params": p_dev,
                            "optimizer": o_dev,
                            "loss_rel_err": loss_err,
                            "param_max_abs_err": param_err,
                            "ok": loss_err < tol and param_err < 10 * tol,
                            "seconds": round(time.perf_counter() - t0, 2),
                        }
                    )
                except Exception as exc:  # report and go on: one placement must not hide others
                    rows.append(
                        {
                            "dtype": dtype,
                            "params": p_dev,
                            "optimizer": o_dev,
                            "ok": False,
                            "error": f"{type(exc).__name__}: {exc}"[:500],
                        }
                    )
                finally:
                    opt.close()
                print(json.dumps(rows[-1]), flush=True)
    return rows


def step_in_backward_parity(device: str, tmp: Path) -> list[dict]:
    """bf16, optimizer on NVMe: the step in backward must give exactly the default step's
    losses and weights (the same math in the same order, gradients via the CUDA staging copy)."""
    rows = []
    data = [d.to(device) for d in batches(8)]
    for p_dev in ("none", "cpu", "nvme"):
        runs = []
        try:
            for sib in (False, True):
                cfg = placement_config(p_dev, "nvme", tmp / f"sib{sib}-{p_dev}", dtype="bf16")
                cfg["device"] = device
                cfg["offload_optimizer"]["step_in_backward"] = sib
                model, opt = offload.wrap(make_model(), cfg)
                try:
                    losses = []
                    for x in data:
                        loss = lm_loss(model, x)
                        loss.backward()
                        opt.step()
                        opt.zero_grad()
                        losses.append(float(loss.detach()))
                    runs.append((losses, model.state_dict()))
                finally:
                    opt.close()
            diff = _max_abs(runs[1][1], runs[0][1])
            row = {"step_in_backward": True, "params": p_dev, "param_max_abs_diff": diff}
            row["ok"] = runs[0][0] == runs[1][0] and diff == 0.0
        except Exception as exc:  # report and go on
            row = {"step_in_backward": True, "params": p_dev, "ok": False}
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def side_stream_parity(device: str, tmp: Path) -> list[dict]:
    """fp32 training whose wrap, forwards, backwards and steps all run on a stream of the
    user's own (``with torch.cuda.stream(s)``), against the reference on the default stream:
    the fences and waits must use the stream a forward captured (``Transfers.capture_stream``),
    not the default one. On the CPU there is no stream: the same loop as ``parity``."""
    import contextlib  # noqa: PLC0415

    rows = []
    data = [d.to(device) for d in batches(8)]
    steps, accum, clip = 4, 2, 1.0
    ref, ref_losses = reference_fp32(make_model().to(device), data, steps, accum, clip)
    cuda = device.startswith("cuda")
    side = torch.cuda.Stream(torch.device(device)) if cuda else None
    for p_dev, o_dev in (("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")):
        row = {"side_stream": cuda, "params": p_dev, "optimizer": o_dev, "ok": False}
        try:
            cfg = placement_config(p_dev, o_dev, tmp / f"side-{p_dev}-{o_dev}")
            cfg["device"] = device
            with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                if cuda:
                    side.wait_stream(torch.cuda.default_stream(torch.device(device)))
                model, opt = offload.wrap(make_model(), cfg)
                try:
                    losses, _ = train_wrapped(model, opt, data, steps, accum, clip)
                    sd = model.state_dict()
                finally:
                    opt.close()
            loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            param_err = _max_abs(sd, ref.state_dict())
            row |= {"loss_rel_err": loss_err, "param_max_abs_err": param_err}
            row["ok"] = loss_err < 1e-4 and param_err < 1e-3
        except Exception as exc:  # report and go on
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def throughput(device: str, tmp: Path, size: str, steps: int, seconds: float) -> dict:
    from offload.demo.model import GPT, config_for_size, lm_loss  # noqa: PLC0415

    torch.manual_seed(0)
    gcfg = config_for_size(size, seq_len=512)
    model = GPT(gcfg)
    (tmp / "tp").mkdir(parents=True, exist_ok=True)
    (tmp / "to").mkdir(parents=True, exist_ok=True)
    cfg = {
        "device": device,
        "dtype": "bf16",
        "offload_param": {
            "device": "nvme",
            "nvme_path": str(tmp / "tp"),
            "buffer_count": 8,
            "buffer_size": "64MiB",
        },
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": str(tmp / "to"),
            "buffer_count": 16,
            "buffer_size": "64MiB",
        },
        "prefetch": {"depth": 2},
    }
    model, opt = offload.wrap(model, cfg)
    batch = 8
    x = torch.randint(0, 256, (batch, gcfg.seq_len + 1), device=device)
    times, splits = [], []
    t_end = time.perf_counter() + seconds
    try:
        for i in range(steps):
            t0 = time.perf_counter()
            loss = lm_loss(model(x[:, :-1]), x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            if device.startswith("cuda"):
                torch.cuda.current_stream().synchronize()
            times.append(time.perf_counter() - t0)
            st = opt.stats()
            splits.append(
                {
                    k: round(st[k], 3)
                    for k in (
                        "forward_seconds",
                        "backward_seconds",
                        "io_wait_seconds",
                        "gather_copy_seconds",
                        "optimizer_seconds",
                    )
                }
            )
            if time.perf_counter() > t_end and i >= 2:
                break
    finally:
        opt.close()
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    return {
        "params_M": round(_count(gcfg) / 1e6, 1),
        "steps": len(times),
        "median_step_s": round(steady, 3),
        "tokens_per_s": round(batch * gcfg.seq_len / steady, 1),
        "last_split": splits[-1],
        "loss": float(loss.detach()),
    }


def group_parity(device: str, tmp: Path) -> list[dict]:
    """ZeRO stages 1-3 through a one-rank process group (module docstring, part 3)."""
    import socket  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    from offload.dist import init_process_group  # noqa: PLC0415

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.startswith("cuda") else "gloo"
    init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    rows = []
    try:
        if backend == "nccl":
            rows += _guarded("the NCCL wait check", lambda: [_nccl_wait(device)])
        rows += _guarded("the staging check", lambda: [_staged_collectives(device)])
        data = [d.to(device) for d in batches(16)]
        steps, accum, clip = 6, 2, 1.0
        ref, ref_losses = reference_fp32(make_model().to(device), data, steps, accum, clip)
        for stage in (1, 2, 3):
            for p_dev, o_dev in (("none", "cpu"), ("cpu", "cpu"), ("nvme", "nvme")):
                cfg = placement_config(p_dev, o_dev, tmp / f"group-{stage}-{p_dev}-{o_dev}")
                cfg |= {"device": device, "distributed": {"stage": stage, "timeout": 120}}
                model, opt = offload.wrap(make_model(), cfg, _one_rank_collectives=True)
                try:
                    losses, _ = train_wrapped(model, opt, data, steps, accum, clip)
                    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
                    param_err = _max_abs(model.state_dict(), ref.state_dict())
                    moved = opt.stats()["collective_bytes"]
                    rows.append(
                        {
                            "group": backend,
                            "stage": stage,
                            "params": p_dev,
                            "optimizer": o_dev,
                            "loss_rel_err": loss_err,
                            "param_max_abs_err": param_err,
                            "collective_bytes": moved,
                            "ok": loss_err < 1e-4 and param_err < 1e-3 and moved > 0,
                        }
                    )
                finally:
                    opt.close()
                print(json.dumps(rows[-1]))
    finally:
        dist.destroy_process_group()
    return rows


def _nccl_wait(device: str) -> dict:
    """``offload.dist``'s Note says a NCCL handle's wait orders the caller's stream after the
    collective and does not block the host (so a unit's reduce-scatter overlaps the next
    unit's backward). Checked: the stream kept busy 50 ms before an all-reduce, the wait
    must return well before that, and the compute after it see the result. ``Handle.wait``
    passes ``distributed.timeout`` to ``Work.wait``; a torch whose NCCL wait blocks the host
    when given a timeout fails here with the milliseconds it blocked."""
    from offload.dist import comm_for  # noqa: PLC0415

    comm = comm_for(None, 120.0, one_rank=True)
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    comm.use_device(dev)
    t = torch.ones(1 << 20, device=dev)
    torch.cuda.synchronize(dev)
    _Delay(device).on()
    handle = comm.all_reduce(t, what="the wait check")
    t0 = time.perf_counter()
    handle.wait()
    waited_ms = 1e3 * (time.perf_counter() - t0)
    t.add_(1.0)
    got = float(t.min().item())
    row = {
        "check": "a NCCL handle's wait orders the stream, the host goes on",
        "ok": waited_ms < 25.0 and got == 2.0,
        "host_wait_ms": round(waited_ms, 2),
        "min_value": got,
    }
    if waited_ms >= 25.0:
        row["why"] = (
            "Work.wait(timeout) blocked the host until the collective completed (torch polls "
            "for completion when given a timeout): every Handle.wait of offload.dist is then a "
            "host wait, against its Note; a NCCL wait without a timeout orders the stream only "
            "(the group's own watchdog timeout then bounds a stuck peer)"
        )
    print(json.dumps(row), flush=True)
    comm.close()
    return row


def _staged_collectives(device: str) -> dict:
    """The collectives' staging (``offload.dist``'s Note on where tensors are) with tensors on
    the other side of the backend: host tensors through NCCL (a host home's all-gather in
    place, a pool buffer's broadcast, the norm's float64 all-reduce, a host reduce-scatter),
    which a group of one rank does not reach in training (its homes are never stale, its norm
    is not all-reduced). One rank: each result is its input (or its sum of one)."""
    from offload.dist import comm_for  # noqa: PLC0415

    comm = comm_for(None, 120.0, one_rank=True)
    if device.startswith("cuda"):
        dev = torch.device(device)
        comm.use_device(dev if dev.index is not None else torch.device("cuda", 0))
    errors = []
    flat = torch.arange(4096, dtype=torch.bfloat16)  # a host home: gathered in place
    want = flat.clone()
    comm.all_gather(flat, flat, "a host home").wait()
    errors += [] if torch.equal(flat, want) else ["all_gather in place"]
    buf = torch.full((1000,), 3.0)
    comm.broadcast(buf, 0, "a pool buffer").wait()
    errors += [] if bool((buf == 3.0).all()) else ["broadcast"]
    both = torch.tensor([0.0, 12.5], dtype=torch.float64)
    comm.all_reduce(both, what="the norm").wait()
    errors += [] if both.tolist() == [0.0, 12.5] else ["all_reduce float64"]
    out = torch.empty(512)
    comm.reduce_scatter(out, torch.linspace(0, 1, 512), "host grads").wait()
    errors += [] if torch.equal(out, torch.linspace(0, 1, 512)) else ["reduce_scatter"]
    comm.close()
    row = {
        "check": f"host tensors through {comm.backend}'s staging come back whole",
        "ok": not errors,
        "wrong": errors,
    }
    print(json.dumps(row), flush=True)
    return row


def _count(gcfg) -> int:
    from offload.demo.model import param_count  # noqa: PLC0415

    return param_count(gcfg)


def device_write_check(device: str, tmp: Path) -> list[dict]:
    """Parameters on the device with their master apart (``offload_param.device: none``; on
    CUDA the master is always apart): a write through ``p.data`` after a step is refused at the
    next forward, naming it, and the training then goes on as without it (``DeviceParams``'
    fingerprints: the pinned staging slot's on the host against the device buffer's on the
    device). For the optimizer on the CPU and on NVMe, bf16; after the second step, whose
    update ran in its backward (after the first, it may still run after ``step()``, and on
    CUDA a write landing before it writes is not seen)."""
    from offload.runtime.phase import PhaseError  # noqa: PLC0415

    rows = []
    data = [d.to(device) for d in batches(4)]
    for o_dev in ("cpu", "nvme"):
        row = {"device_write": True, "optimizer": o_dev, "ok": False}
        try:
            trained = []
            for write in (False, True):
                cfg = placement_config("none", o_dev, tmp / f"dw-{o_dev}-{write}", dtype="bf16")
                cfg["device"] = device
                model, opt = offload.wrap(make_model(), cfg)
                try:
                    refused = None
                    for i, x in enumerate(data):
                        lm_loss(model, x).backward()
                        opt.step()
                        opt.zero_grad()
                        if write and i == 1:  # (no update runs after this step())
                            with torch.no_grad():
                                model.blocks[0].fc1.weight.data.mul_(0.5)
                            try:
                                model(data[2])
                            except PhaseError as exc:
                                refused = "blocks.0.fc1.weight" in str(exc)
                    trained.append((model.state_dict(), refused))
                finally:
                    opt.close()
            diff = _max_abs(trained[1][0], trained[0][0])
            row |= {"refused_by_name": trained[1][1], "param_max_abs_diff": diff}
            row["ok"] = trained[1][1] is True and diff == 0.0
        except Exception as exc:  # report and go on
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="125M")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=120.0, help="throughput run time cap")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(dir=args.nvme_path))
    out: dict = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(0)
    out["device_checks"] = _guarded("device_checks", lambda: device_checks(args.device))
    if not args.skip_parity:
        out["parity"] = parity(args.device, tmp) + step_in_backward_parity(args.device, tmp)
        out["parity"] += side_stream_parity(args.device, tmp)
        out["parity"] += device_write_check(args.device, tmp)
        out["parity"] += group_parity(args.device, tmp)
    if not args.skip_throughput:
        try:
            out["throughput"] = throughput(args.device, tmp, args.size, args.steps, args.seconds)
        except Exception as exc:  # noqa: BLE001 - the parts before it are still reported
            out["throughput"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        print(json.dumps(out["throughput"]), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_smoke.json").write_text(json.dumps(out, indent=1))
    ok = True
    for part in ("device_checks", "parity"):
        rows = out.get(part, [])
        failed = [r for r in rows if not r["ok"]]
        ok = ok and not failed
        print(f"{part}: {len(rows) - len(failed)}/{len(rows)} passed", flush=True)
        for r in failed:
            print(f"  FAIL {json.dumps(r)}", flush=True)
    if "error" in out.get("throughput", {}):
        ok = False
        print(f"throughput: FAIL {out['throughput']['error']}", flush=True)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
