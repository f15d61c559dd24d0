"""Worker for bench_e2e.py: the demo GPT under DeepSpeed ZeRO-3 with params and optimizer state
on NVMe, one process (gloo, world size 1). Prints one JSON line with the median step time.

    python benchmarks/_ds_zero3.py --size 20M --batch 4 --seq 128 --steps 5 --nvme DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="20M")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--nvme", required=True)
    ap.add_argument("--buffer-elems", type=int, default=4_000_000)
    ap.add_argument("--offload", choices=["nvme", "cpu"], default="nvme")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    import deepspeed  # noqa: PLC0415

    from offload.demo.model import GPT, config_for_size, lm_loss  # noqa: PLC0415

    torch.manual_seed(0)
    gcfg = config_for_size(args.size, seq_len=args.seq)
    model = GPT(gcfg)
    dev = {"device": args.offload, "pin_memory": False}
    if args.offload == "nvme":
        dev["nvme_path"] = args.nvme
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {**dev, "buffer_count": 5, "buffer_size": args.buffer_elems},
            "offload_optimizer": {**dev, "buffer_count": 4},
            "stage3_param_persistence_threshold": 0,
            "sub_group_size": args.buffer_elems,
        },
        "aio": {
            "block_size": 1048576,
            "queue_depth": 8,
            "thread_count": 2,
            "single_submit": False,
            "overlap_events": True,
        },
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    x = torch.randint(0, 256, (args.batch, args.seq + 1))
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        loss = lm_loss(engine(x[:, :-1]), x[:, 1:])
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    print(
        json.dumps(
            {
                "median_step_s": statistics.median(times[1:]),
                "steps": args.steps,
                "loss": float(loss.detach()),
            }
        )
    )


if __name__ == "__main__":
    main()
