"""What seeing writes into device-resident parameters costs a training step.

Where the parameters stay on the device while their fp32 master is a copy apart (bf16 compute, or
the optimizer on NVMe), offload keeps a fingerprint of each piece as it last wrote it and reads the
pieces again at each forward (``offload.homes.piece_prints``, Note on writes by code outside offload). This
trains the demo GPT at such a placement and times its steps (forward, backward, ``step()``) with
the fingerprints kept and with them dropped (the home's ``NoPrints``, as where the master is
not apart), in alternating rounds on the same model, and prints the medians and their ratio, with
the time of one fingerprint pass over every device parameter alone. A diagnostic: no peer.

    python benchmarks/bench_device_watch.py [--size 50M] [--batch 2] [--steps 6] [--rounds 3]
        [--opt cpu|nvme]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import offload  # noqa: E402
from offload.api.wrap import engine_of  # noqa: E402
from offload.demo.model import GPT, config_for_size, lm_loss  # noqa: E402
from offload.device import fingerprint  # noqa: E402
from offload.homes.piece_prints import NoPrints, PiecePrints  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="50M")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6, help="steps timed per round and mode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--opt", choices=["cpu", "nvme"], default="cpu", help="cpu: bf16 compute")
    args = ap.parse_args()
    torch.manual_seed(0)
    mcfg = config_for_size(args.size)
    model = GPT(mcfg)
    x = torch.randint(0, 256, (args.batch, args.seq + 1))  # (bytes)
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        cfg = {
            "device": "cpu",
            "dtype": "bf16" if args.opt == "cpu" else "fp32",
            "optimizer": {"type": "adamw", "lr": 1e-4},
            "offload_param": {"device": "none"},
            "offload_optimizer": {"device": args.opt}
            | ({"nvme_path": tmp} if args.opt == "nvme" else {}),
        }
        model, opt = offload.wrap(model, cfg)
        home = engine_of(model).params
        kept = home.prints
        assert isinstance(kept, PiecePrints), "this placement keeps no fingerprints"

        def step() -> float:
            t0 = time.perf_counter()
            lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - t0

        try:
            for _ in range(2):
                step()
            times: dict[str, list[float]] = {"kept": [], "dropped": []}
            for _ in range(args.rounds):
                for mode in times:
                    home.prints = kept if mode == "kept" else NoPrints()
                    step()  # (the records refill at the commits)
                    times[mode] += [step() for _ in range(args.steps)]
            home.prints = kept
            flats = list(home.flat.values())
            t0 = time.perf_counter()
            for _ in range(5):
                torch.stack([fingerprint(f) for f in flats]).tolist()
            one_pass = (time.perf_counter() - t0) / 5
        finally:
            opt.close()
    n = sum(f.numel() for f in flats)
    kept, dropped = (statistics.median(times[m]) for m in ("kept", "dropped"))
    print(f"# {args.size} GPT, offload_param none, {cfg['dtype']}, optimizer on {args.opt}")
    print(f"# {n / 1e6:.1f}M device parameters; medians of {args.rounds} x {args.steps} steps")
    print(f"step, fingerprints kept     {kept:.3f} s")
    print(f"step, fingerprints dropped  {dropped:.3f} s")
    print(f"ratio                       {kept / dropped:.3f}")
    print(f"one pass over every piece   {one_pass * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
