"""ZeRO stages across gloo ranks on this machine: what each rank sends and holds.

    python benchmarks/bench_dist.py [--worlds 1,2,4] [--stages 1,2,3] [--steps 3] [--json FILE]

For each world size (processes on this machine, gloo, env:// rendezvous) and each stage and
placement it trains a bf16 MLP stack (``--dim``, ``--blocks``: about 8.7M parameters by default)
for a few steps without gradient accumulation and reads, for every rank, the last step's
counters (``optimizer.stats()``):

- **collective bytes per rank and step** (``offload.dist``'s count: the gathered or reduced
  tensor) against the textbook volume: 2 Psi for stages 1 and 2 (the gradients
  reduce-scattered, the updated params all-gathered), 3 Psi for stage 3 (all-gathered for the
  forward and again for the backward, reduce-scattered), Psi = parameters x 2 bytes (bf16),
  the gradients' Psi in ``distributed.reduce_dtype``'s bytes (fp32 by default: x 4);
- **host and NVMe bytes per rank**: the training state the rank holds (``state_bytes``; with
  params and optimizer on NVMe the host figure is the two swap pools), and the NVMe bytes read
  and written per step, each against 1/N of the one-rank run of the same placement;
- the same three figures from ``offload estimate`` (``offload.estimate.placement_row`` for this
  model and machine), measured / estimated.

Psi counts the parameters; the measured bytes include the padding of every unit's regions to
N x 2048 elements, and stage 3 gathers the root unit (embedding, head, final norm) once per
step, not twice. A time on two cores proves nothing about the bandwidth of a real network, so
none is reported. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's offload, also in the ranks (PYTHONPATH)
PLACEMENTS = {  # label -> (offload_param.device, offload_optimizer.device, estimate placement)
    "optimizer on CPU": ("none", "cpu", "cpu_optimizer"),
    "params + optimizer on CPU": ("cpu", "cpu", "cpu_optimizer_params"),
    "params + optimizer on NVMe": ("nvme", "nvme", "nvme"),
}


def _model(dim: int, blocks: int):
    import torch  # noqa: PLC0415
    import torch.nn as nn  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(x)))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, dim)
            self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))
            self.head = nn.Linear(dim, 256)

        def forward(self, x):
            return self.head(self.blocks(self.embed(x)))

    torch.manual_seed(0)
    return Stack()


def rank_main(spec_path: str) -> None:
    """One rank: every (stage, placement) of the spec, one after the other."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    import offload  # noqa: PLC0415
    from offload.api.wrap import engine_of  # noqa: PLC0415
    from offload.dist import init_process_group  # noqa: PLC0415

    spec = json.loads(Path(spec_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    out = []
    for run in spec["runs"]:
        param, optim, _ = PLACEMENTS[run["placement"]]
        pool = {"buffer_count": 8, "buffer_size": "auto"}
        nvme = str(Path(spec["tmp"]) / f"w{world}-s{run['stage']}-{param}")
        cfg = {
            "device": "cpu",
            "dtype": "bf16",
            "offload_param": {"device": param, "persistence_threshold": 0}
            | ({**pool, "buffer_count": 5, "nvme_path": nvme} if param == "nvme" else {}),
            "offload_optimizer": {"device": optim}
            | ({**pool, "nvme_path": nvme} if optim == "nvme" else {}),
            "wrap": {"module_classes": ["Block"]},
            "distributed": {"stage": run["stage"]},
        }
        model, opt = offload.wrap(_model(spec["dim"], spec["blocks"]), cfg)
        engine = engine_of(model)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(spec["steps"]):
            x = torch.randint(0, 256, (spec["batch"], spec["seq"] + 1), generator=gen)
            logits = model(x[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, 256), x[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad()
        st = opt.stats()
        out.append(
            {
                **run,
                "rank": rank,
                "collectives": {k: v["bytes"] for k, v in st["collectives"].items()},
                "collective_bytes": st["collective_bytes"],
                "state": st["state_bytes"],
                "pools": sum(s.stats()["host_reserved_bytes"] for s in engine.stores.values()),
                "nvme_io": st["bytes"].get("nvme->host", 0) + st["bytes"].get("host->nvme", 0),
                "params": sum(p.numel() for p in model.parameters()),
                "largest_unit": max(
                    sum(s.numel for s in u.layout.segments) for u in engine.plan.units
                ),
            }
        )
        opt.close()
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(out))
    if world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, runs: list[dict], args, tmp: Path) -> list[dict]:
    out = tmp / f"world{world}"
    out.mkdir()
    spec = out / "spec.json"
    spec.write_text(
        json.dumps(
            {"runs": runs, "out": str(out), "tmp": str(tmp / "nvme"), "steps": args.steps,
             "dim": args.dim, "blocks": args.blocks, "batch": args.batch, "seq": args.seq}
        )
    )  # fmt: skip
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(r), WORLD_SIZE=str(world))
        env |= {"LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, __file__, "--rank-worker", str(spec)]
        procs.append(subprocess.Popen(cmd, env=env))
    if any(p.wait(timeout=3600) != 0 for p in procs):
        raise SystemExit(f"bench_dist: a rank of the {world}-rank run failed")
    return [rec for r in range(world) for rec in json.loads((out / f"rank{r}.json").read_text())]


def _fmt(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def table(records: list[dict]) -> list[dict]:
    from offload import estimate as est  # noqa: PLC0415

    one = {r["placement"]: r for r in records if r["world"] == 1}
    rows = []
    for r in records:
        world = r["world"]
        if world == 1:
            continue
        psi = 2 * r["params"]  # bf16
        # the gradients' Psi in distributed.reduce_dtype's default, fp32: twice bf16's
        textbook = (2 if r["stage"] == 3 else 1) * psi + 4 * r["params"]
        base = one[r["placement"]]
        _, _, where = PLACEMENTS[r["placement"]]
        host = r["pools"] if where == "nvme" else r["state"]["host"]
        base_host = base["pools"] if where == "nvme" else base["state"]["host"]
        e = est.placement_row(
            r["params"], r["stage"], where, est.Machine(gpus_per_node=world),
            precision="bf16", unit_params=r["largest_unit"],
        )  # fmt: skip
        rows.append(
            {
                "world": world,
                "stage": r["stage"],
                "placement": r["placement"],
                "rank": r["rank"],
                "collective_bytes": r["collective_bytes"],
                "vs_textbook": r["collective_bytes"] / textbook,
                "host_bytes": host,
                "host_vs_1_over_n": host / (base_host / world) if base_host else None,
                "nvme_bytes": r["state"]["nvme"],
                "nvme_vs_1_over_n": r["state"]["nvme"] / (base["state"]["nvme"] / world)
                if base["state"]["nvme"]
                else None,
                "nvme_io": r["nvme_io"],
                "nvme_io_vs_1_over_n": r["nvme_io"] / (base["nvme_io"] / world)
                if base["nvme_io"]
                else None,
                "estimate_host": host / e.host_per_rank if e.host_per_rank else None,
                "estimate_nvme": r["state"]["nvme"] / e.nvme_per_rank if e.nvme_per_rank else None,
                "estimate_comm": r["collective_bytes"] / e.comm_per_rank,
            }
        )
    return rows


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown(rows: list[dict], params: int) -> str:
    head = (
        "| N | stage | placement | collective / rank / step | vs 2Ψ or 3Ψ | host / rank | vs 1/N | "
        "NVMe / rank | vs 1/N | NVMe IO / rank / step | vs 1/N | vs estimate: host, NVMe, comm |"
    )
    lines = [head, "|" + "---|" * 12]
    seen = set()
    for r in rows:  # every rank's figures agree but the padding's place: show the largest rank
        key = (r["world"], r["stage"], r["placement"])
        if key in seen:
            continue
        seen.add(key)
        same = [x for x in rows if (x["world"], x["stage"], x["placement"]) == key]
        r = max(same, key=lambda x: x["collective_bytes"] + x["host_bytes"] + x["nvme_bytes"])
        est = ", ".join(_ratio(r[k]) for k in ("estimate_host", "estimate_nvme", "estimate_comm"))
        lines.append(
            f"| {r['world']} | {r['stage']} | {r['placement']} | {_fmt(r['collective_bytes'])} | "
            f"{_ratio(r['vs_textbook'])} | {_fmt(r['host_bytes'])} | {_ratio(r['host_vs_1_over_n'])} | "
            f"{_fmt(r['nvme_bytes'])} | {_ratio(r['nvme_vs_1_over_n'])} | {_fmt(r['nvme_io'])} | "
            f"{_ratio(r['nvme_io_vs_1_over_n'])} | {est} |"
        )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-worker":
        rank_main(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--path", default=None, help="directory for the swap files (a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-dist-", dir=args.path))
    records = []
    t0 = time.time()
    try:
        for world in worlds:
            runs = [
                {"stage": s, "placement": p, "world": world}
                for s in (stages if world > 1 else [1])
                for p in PLACEMENTS
            ]
            records += run_world(world, runs, args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = table(records)
    params = records[0]["params"]
    print(
        f"bench_dist: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"gloo, bf16, {params / 1e6:.2f}M parameters (Psi = {_fmt(2 * params)}), "
        f"{args.steps} steps, {time.time() - t0:.0f} s"
    )
    print(markdown(rows, params))
    if args.json:
        Path(args.json).write_text(json.dumps({"records": records, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
