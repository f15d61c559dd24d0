"""A 7B Llama on one GPU capped at 24 GB: the README's single-card recipe, measured.

    python benchmarks/gpu_7b.py [--device cuda] [--steps 5] [--seq-len 2048] [--offload auto]
    python benchmarks/gpu_7b.py --device cpu --layers 2 ...      # the same code on the CPU (tests)

The model is Llama-2-7B-shaped (``--layers``/``--hidden``/... change it), built on the meta
device; its random weights are produced piece by piece straight into their homes
(``wrap(weights=...)`` with lazy tensors: the model never exists in host RAM). It trains
``--steps`` steps of random tokens in bf16 with activation checkpointing, the GPU capped with
``torch.cuda.set_per_process_memory_fraction`` at ``--gpu-mem``, and prints tokens/s, model
TFLOPS (6 N + attention, per step), peak GPU memory and peak RSS; with ``$OUT`` set, the
figures also go to ``$OUT/gpu_7b.json``.

``--offload``: ``nvme`` is the recipe (params and optimizer state on NVMe under
``--nvme-path``: 30 bytes per parameter there, ~202 GB for 7B: bf16 params 2, fp32 master,
moments and gradient 16, the step in backward's second extent of master and moments 12; host
RAM holds the pools);
``cpu`` keeps the params on the GPU and the optimizer state in host RAM (16 bytes per parameter,
~108 GB for 7B: for a machine with >= 128 GB of RAM and too little disk); ``auto`` picks
``nvme`` when the disk has room, else ``cpu`` when RAM has, else stops and says why.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _llama import PeakRss, llama_config, meta_model, random_weights  # noqa: E402

import offload  # noqa: E402
from offload.config import parse_size  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def recipe_config(device: str, dtype: str, nvme_path: str, placement: str) -> dict:
    """The README's single-card config (placement ``nvme``), or its RAM variant (``cpu``)."""
    if placement == "nvme":
        return {
            "device": device,
            "dtype": dtype,
            "offload_param": {"device": "nvme", "nvme_path": nvme_path},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
            "wrap": {"module_classes": ["LlamaDecoderLayer"]},
        }
    return {
        "device": device,
        "dtype": dtype,
        "offload_param": {"device": "none"},
        "offload_optimizer": {"device": "cpu"},
        "wrap": {"module_classes": ["LlamaDecoderLayer"]},
    }


# bf16 params 2 + fp32 master, m, v, grad 16 + the step in backward's second extent 12
NVME_BYTES_PER_PARAM = 30


def choose_placement(wanted: str, n_params: int, nvme_path: str) -> str:
    if wanted != "auto":
        return wanted
    disk = shutil.disk_usage(nvme_path).free
    ram = psutil.virtual_memory().available
    if disk > NVME_BYTES_PER_PARAM * n_params * 1.05:
        return "nvme"
    if ram > 16 * n_params * 1.1:
        return "cpu"
    raise SystemExit(
        f"gpu_7b: {n_params / 1e9:.1f}B parameters need "
        f"{NVME_BYTES_PER_PARAM * n_params / 1e9:.0f} GB on NVMe "
        f"(free at {nvme_path}: {disk / 1e9:.0f} GB) or {16 * n_params / 1e9:.0f} GB of RAM "
        f"(available: {ram / 1e9:.0f} GB); pass --nvme-path on a larger disk"
    )


def model_flops_per_token(cfg, seq_len: int, n_params: int) -> float:
    """6 N for the matmuls (forward + backward) plus causal attention's 6 L s h (the score and
    value matmuls over half the sequence on average, forward + backward)."""
    return 6 * n_params + 6 * cfg.num_hidden_layers * seq_len * cfg.hidden_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--gpu-mem", default="24GB", help="cap on the GPU's memory (24GB)")
    ap.add_argument("--offload", choices=["auto", "nvme", "cpu"], default="auto")
    ap.add_argument("--nvme-path", help="directory for the swap files (a temp dir)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    cfg = llama_config(
        hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab, seq_len=max(args.seq_len, 128),
    )  # fmt: skip
    cap = None
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        cap = min(parse_size(args.gpu_mem, key="--gpu-mem"), total)
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
    model = meta_model(cfg, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    workdir = Path(tempfile.mkdtemp(prefix="offload-gpu7b-", dir=args.nvme_path))
    placement = choose_placement(args.offload, n_params, str(workdir))
    print(
        f"gpu_7b: {n_params / 1e9:.2f}B parameters, {args.layers} layers, {args.dtype} on "
        f"{device}" + (f" capped at {cap / 1e9:.1f} GB" if cap else "") + f"; offload {placement}",
        flush=True,
    )
    rss = PeakRss().start()
    base_rss = rss.rss()
    try:
        t0 = time.perf_counter()
        model, optimizer = offload.wrap(
            model,
            recipe_config(str(device), args.dtype, str(workdir), placement),
            weights=random_weights(model, dtype),
        )
        wrap_s = time.perf_counter() - t0
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
        model.train()
        print(f"gpu_7b: wrapped in {wrap_s:.1f} s (random weights into the tiers)", flush=True)
        gen = torch.Generator().manual_seed(0)
        times, losses = [], []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for step in range(args.steps):
            x = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen).to(device)
            t0 = time.perf_counter()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
            optimizer.synchronize()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            print(f"gpu_7b: step {step + 1}: {times[-1]:.2f} s, loss {losses[-1]:.3f}", flush=True)
        optimizer.close()
    finally:
        peak_rss = rss.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    steady = times[1:] or times
    step_s = statistics.median(steady)
    tokens = args.batch * args.seq_len
    flops = model_flops_per_token(cfg, args.seq_len, n_params) * tokens
    result = {
        "params": n_params,
        "layers": args.layers,
        "device": str(device),
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "gpu_cap_bytes": cap,
        "offload": placement,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "wrap_seconds": wrap_s,
        "step_seconds": times,
        "losses": losses,
        "tokens_per_second": tokens / step_s,
        "model_tflops": flops / step_s / 1e12,
        "peak_gpu_allocated": torch.cuda.max_memory_allocated(device) if cap else 0,
        "peak_gpu_reserved": torch.cuda.max_memory_reserved(device) if cap else 0,
        "peak_rss_growth": peak_rss - base_rss,
        "peak_rss": peak_rss,
    }
    print(
        f"gpu_7b: {result['tokens_per_second']:.0f} tokens/s, {result['model_tflops']:.1f} "
        f"TFLOPS (model, median of steps 2-{args.steps}), peak GPU memory "
        f"{result['peak_gpu_allocated'] / 1e9:.2f} GB allocated / "
        f"{result['peak_gpu_reserved'] / 1e9:.2f} GB reserved, peak RSS "
        f"{peak_rss / 1e9:.2f} GB (+{result['peak_rss_growth'] / 1e9:.2f} GB)"
    )
    for path in filter(
        None, (args.json, os.environ.get("OUT") and f"{os.environ['OUT']}/gpu_7b.json")
    ):
        Path(path).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
