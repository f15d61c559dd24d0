"""Training state larger than this machine's RAM, loaded from safetensors shards with bounded RSS.

    python benchmarks/beyond_ram.py [--size 2B] [--steps 3] [--dir DIR] [--json FILE]

1. **write**: a random Llama-shaped bf16 checkpoint (``config.json``, shards of
   ``--shard-size`` and ``model.safetensors.index.json``), each tensor generated and written in
   chunks (``offload.api.pretrained.write_shards``), never whole in RAM.
2. **load** (a fresh process): ``offload.from_pretrained`` with params and optimizer state on
   NVMe: the model is built on the meta device and every piece streams from the shards into its
   NVMe home (compute params, fp32 master, zero moments).
3. **train**: ``--steps`` steps of random tokens on the CPU, computing in ``--dtype`` (fp32 by
   default: torch's bf16 backward on this CPU took 26 s where fp32 took 2 s, 125M model, 64
   tokens; the checkpoint stays bf16, so the load converts bf16 to fp32).
4. **export**: ``offload.save_pretrained`` back to sharded safetensors (``--no-export`` skips).

It prints, per phase, the wall time and the peak RSS growth over the fresh process's RSS before
the model existed, against the documented budget (README "Memory": buffers + 4 x the largest
unit in fp32 + 48 MiB), and the training state's bytes (bf16 params + fp32 master + moments,
+ fp32 gradients on NVMe) against the machine's RAM. ``--size tiny`` runs in seconds (tests).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _llama import PeakRss, llama_config, meta_model, param_count, random_weights  # noqa: E402

from offload.io._owner import disk_bytes  # noqa: E402

# hidden, intermediate, layers, heads, kv heads, vocab
SIZES = {
    "tiny": (64, 160, 2, 4, 2, 256),
    "125M": (768, 2048, 12, 12, 12, 32000),
    "1B": (2048, 5504, 16, 16, 16, 32000),
    "2B": (2560, 6912, 24, 20, 20, 32000),
}


ITEMSIZE = {"fp32": 4, "bf16": 2}


def _config(size: str):
    h, i, n, a, kv, v = SIZES[size]
    return llama_config(hidden=h, intermediate=i, layers=n, heads=a, kv_heads=kv, vocab=v)


def write_checkpoint(directory: Path, size: str, shard_size: str) -> dict:
    from offload.api.pretrained import write_shards  # noqa: PLC0415

    cfg = _config(size)
    model = meta_model(cfg, torch.bfloat16)
    weights = random_weights(model, torch.bfloat16)
    entries = [
        (name, t.dtype, list(t.shape), lambda t=t: t.chunks()) for name, t in weights.items()
    ]
    rss = PeakRss()
    base = rss.rss()
    rss.start()
    t0 = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    cfg.dtype = torch.bfloat16
    cfg.to_json_file(directory / "config.json")
    files = write_shards(directory, entries, shard_size)
    seconds = time.perf_counter() - t0
    peak = rss.stop()
    return {
        "params": param_count(model),
        "checkpoint_bytes": sum(f.stat().st_size for f in files),
        "shards": sum(1 for f in files if f.suffix == ".safetensors"),
        "seconds": seconds,
        "peak_growth": peak - base,
    }


def train_phase(args: argparse.Namespace) -> dict:
    """Runs in a fresh process: load, train, export; prints one JSON line."""
    import torch.nn as nn  # noqa: PLC0415

    import offload  # noqa: PLC0415
    from offload.api import engine_of  # noqa: PLC0415
    from offload.estimate import host_memory_budget  # noqa: PLC0415

    torch.manual_seed(0)
    directory = Path(args.dir)
    swap = directory / "swap"
    swap.mkdir(exist_ok=True)
    # what any training loop pays once (autograd engine, the first torch.optim.Optimizer),
    # before the baseline, as tests/test_memory.py does
    warm = nn.Linear(4, 1)
    warm(torch.zeros(2, 4)).sum().backward()
    torch.optim.SGD(warm.parameters(), lr=0.1).step()
    # and what any Hugging Face user pays: transformers and the model's code, imported by
    # building it once on the meta device (no memory)
    meta_model(_config(args.size), torch.bfloat16)
    rss = PeakRss()
    base = rss.rss()
    pools = {"buffer_count": args.buffer_count, "buffer_size": args.buffer_size}
    cfg = {
        "device": "cpu",
        "dtype": args.dtype,
        "optimizer": {"lr": 1e-5},
        "offload_param": {"device": "nvme", "nvme_path": str(swap), "persistence_threshold": 0}
        | pools,
        "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)}
        | pools
        | {"buffer_count": args.opt_buffer_count or 2 * args.buffer_count},
        "wrap": {"module_classes": ["LlamaDecoderLayer"]},
    }
    if args.prefetch_depth is not None:
        cfg["prefetch"] = {"depth": args.prefetch_depth}
    out: dict = {"phases": {}}

    def phase(name: str, seconds: float) -> None:
        out["phases"][name] = {"seconds": seconds, "peak_growth": rss.stop() - base}

    rss.start()
    t0 = time.perf_counter()
    model, optimizer = offload.from_pretrained(directory / "ckpt", cfg)
    phase("load", time.perf_counter() - t0)
    plan = engine_of(model).plan
    n = sum(p.numel() for p in model.parameters())
    norm = offload.load_config(cfg)
    buffers = sum(
        getattr(norm, s).buffer_count * plan.placement.buffer_sizes[s]
        for s in ("offload_param", "offload_optimizer")
    )
    budget = host_memory_budget(buffers, plan.largest_unit)
    out.update(
        params=n,
        largest_unit=plan.largest_unit,
        buffers=buffers,
        budget=budget.total,
        # compute params + fp32 master, exp_avg, exp_avg_sq (+ fp32 grads)
        state_bytes=(ITEMSIZE[args.dtype] + 12) * n,
        state_with_grads_bytes=(ITEMSIZE[args.dtype] + 16) * n,
        ram_bytes=psutil.virtual_memory().total,
        nvme_bytes_after_load=disk_bytes(str(swap)),
    )
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    steps = []
    # cumulative bytes per tier pair at the last synchronize() (here: what the load moved)
    moved = optimizer.stats()["total"]["bytes"]
    rss.start()
    t_train = time.perf_counter()
    for _ in range(args.steps):
        x = torch.randint(0, vocab, (args.batch, args.seq_len), generator=gen)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        optimizer.synchronize()  # the NVMe update runs in the background: time all of it
        t3 = time.perf_counter()
        stats = optimizer.stats()
        # The step's record closes at step(), so an update that runs on after it (the first
        # step's, after its backward) is in the next step's record: "bytes" counts from one
        # synchronize() to the next instead (the totals', read at the call), a step with all
        # of its update
        total = stats["total"]["bytes"]
        steps.append(
            {
                "loss": loss.item(),
                "forward": t1 - t0,
                "backward": t2 - t1,
                "step": t3 - t2,
                "bytes": {k: v - moved.get(k, 0) for k, v in total.items()},
                "record_bytes": stats.get("bytes", {}),
            }
        )
        moved = total
        print(f"beyond_ram: step {len(steps)}: {steps[-1]}", file=sys.stderr, flush=True)
    phase("train", time.perf_counter() - t_train)
    out["steps"] = steps
    out["nvme_bytes_training"] = disk_bytes(str(swap))
    if args.export:
        rss.start()
        t0 = time.perf_counter()
        offload.save_pretrained(model, directory / "export", max_shard_size=args.shard_size)
        phase("export", time.perf_counter() - t0)
    rss.start()
    t0 = time.perf_counter()
    optimizer.close()
    phase("close", time.perf_counter() - t0)
    out["peak_growth"] = max(p["peak_growth"] for p in out["phases"].values())
    out["within_budget"] = out["peak_growth"] <= out["budget"]
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="2B")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--dtype",
        choices=sorted(ITEMSIZE),
        default="fp32",
        help="compute dtype (fp32: torch's bf16 backward on CPUs is ~13x slower here)",
    )
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--buffer-count", type=int, default=4, help="param pool (optimizer: 2x)")
    ap.add_argument(
        "--opt-buffer-count",
        type=int,
        help="optimizer pool (default: 2x --buffer-count)",
    )
    ap.add_argument("--buffer-size", default="64MiB")
    ap.add_argument(
        "--prefetch-depth", type=int, help="prefetch.depth (default: the config's default)"
    )
    ap.add_argument("--shard-size", default="2GB", help="max safetensors shard size")
    ap.add_argument("--dir", help="work directory (checkpoint, swap, export; a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--no-export", dest="export", action="store_false")
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--phase", choices=["all", "train"], default="all", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase == "train":
        print(json.dumps(train_phase(args)))
        return 0
    own = args.dir is None
    directory = Path(args.dir or tempfile.mkdtemp(prefix="offload-beyond-ram-"))
    try:
        t0 = time.perf_counter()
        written = write_checkpoint(directory / "ckpt", args.size, args.shard_size)
        print(f"beyond_ram: wrote {written}", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--phase", "train", "--dir", str(directory)]
        cmd += ["--size", args.size, "--dtype", args.dtype]
        cmd += ["--steps", str(args.steps), "--seq-len", str(args.seq_len)]
        cmd += ["--batch", str(args.batch), "--buffer-count", str(args.buffer_count)]
        cmd += ["--buffer-size", args.buffer_size, "--shard-size", args.shard_size]
        cmd += [] if args.export else ["--no-export"]
        if args.opt_buffer_count:
            cmd += ["--opt-buffer-count", str(args.opt_buffer_count)]
        if args.prefetch_depth is not None:
            cmd += ["--prefetch-depth", str(args.prefetch_depth)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            print(f"beyond_ram: the training process failed ({proc.returncode})", file=sys.stderr)
            return proc.returncode
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["write"] = written
        result["total_seconds"] = time.perf_counter() - t0
        result["size"] = args.size
    finally:
        if own and not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    r = result
    print(f"\nbeyond_ram ({args.size}): {r['params'] / 1e9:.3f} B parameters")
    print(
        f"  training state {r['state_bytes'] / 1e9:.1f} GB ({args.dtype} params + fp32 master, m, v; "
        f"{r['state_with_grads_bytes'] / 1e9:.1f} GB with fp32 grads) vs RAM "
        f"{_gib(r['ram_bytes'])}; NVMe used {r['nvme_bytes_training'] / 1e9:.1f} GB"
    )
    print(
        f"  checkpoint {r['write']['checkpoint_bytes'] / 1e9:.2f} GB in {r['write']['shards']} "
        f"shards, written in {r['write']['seconds']:.0f} s (peak RSS +{_gib(r['write']['peak_growth'])})"
    )
    print(
        f"  budget {_gib(r['budget'])} = buffers {_gib(r['buffers'])} + 4 x largest unit "
        f"({r['largest_unit'] / 1e6:.0f}M elements) in fp32 + 48 MiB"
    )
    for name, p in r["phases"].items():
        print(f"  {name:<7} {p['seconds']:8.1f} s   peak RSS growth {_gib(p['peak_growth'])}")
    for i, s in enumerate(r["steps"], 1):
        rw = (s["bytes"].get(k, 0) / r["params"] for k in ("nvme->host", "host->nvme"))
        print(
            f"  step {i}: loss {s['loss']:.3f}  forward {s['forward']:.1f} s  backward "
            f"{s['backward']:.1f} s  step {s['step']:.1f} s  NVMe read / write "
            "{:.1f} / {:.1f} B/param".format(*rw)
        )
    print(f"  peak RSS growth {_gib(r['peak_growth'])}: within budget: {r['within_budget']}")
    return 0 if r["within_budget"] else 1


if __name__ == "__main__":
    sys.exit(main())
