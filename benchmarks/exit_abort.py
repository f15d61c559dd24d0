"""How often a two-rank gloo script aborts at exit, with and without ``torch.distributed.nn``
imported before ``init_process_group`` (plain torch; ``offload.dist.comm``'s Note on the end of a
process says why it matters to offload).

    python benchmarks/exit_abort.py [--pairs 60]

Each pair runs the same script twice, alternated: ``late`` joins the group, then makes a torch
optimizer (which imports ``torch.distributed.nn``: its functions then keep the default group as a
default argument), runs a few collectives and calls ``destroy_process_group``; ``early`` imports
``torch.distributed.nn`` first. It prints, per variant, how many runs ended with a rank killed by
a signal (SIGABRT: "terminate called without an active exception") and how many processes still
had gloo threads after ``destroy_process_group``. The abort is a race (a gloo thread freeing a
collective's tensors while the interpreter finalizes) and shows more often on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = """
import os, sys
import torch
if sys.argv[1] == "early":
    import torch.distributed.nn  # noqa: F401
import torch.distributed as dist
dist.init_process_group("gloo")
opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
t = torch.ones(1 << 14)
for _ in range(10):
    dist.all_reduce(t, async_op=True).wait()
out = [None, None]
dist.all_gather_object(out, {"rank": dist.get_rank()})
dist.destroy_process_group()
names = [(p / "comm").read_text().strip() for p in __import__("pathlib").Path("/proc/self/task").iterdir()]
print("gloo threads after destroy:", sum("gloo" in n for n in names), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(script: Path, variant: str) -> tuple[bool, int]:
    """(a rank died of a signal, ranks left with gloo threads)."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        env["MASTER_PORT"] = str(port)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), variant],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    killed = any(p.returncode < 0 for p in procs)
    failed = [p.returncode for p in procs if p.returncode > 0]
    if failed:
        raise RuntimeError(f"{variant}: a rank failed: {failed}\n{outs[0][1][-2000:]}")
    pinned = sum("after destroy: 0" not in out for out, _ in outs if out)
    return killed, pinned


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=60)
    args = ap.parse_args()
    counts = {v: {"aborted": 0, "pinned": 0} for v in ("late", "early")}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "exit_script.py"
        script.write_text(SCRIPT)
        for i in range(args.pairs):
            for variant in ("late", "early"):
                killed, pinned = run_pair(script, variant)
                counts[variant]["aborted"] += killed
                counts[variant]["pinned"] += pinned
            print(f"after {i + 1} pairs: {counts}", flush=True)
    for variant, c in counts.items():
        print(
            f"{variant}: {c['aborted']} of {args.pairs} runs with a rank aborted; "
            f"{c['pinned']} of {2 * args.pairs} ranks kept gloo threads after destroy_process_group"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
