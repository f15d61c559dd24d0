"""A training script for the exit, reclaim and fault tests, run as a child process.

``python tests/_exit_worker.py ROOT END [PARAMS] [OPTIM]`` wraps the shared test model with
params on PARAMS and the optimizer state on OPTIM ("nvme" by default; the NVMe paths are under
ROOT), and never calls ``optimizer.close()``. It prints ``step N`` after each step, then ends
as END says:

- ``return``: falls off the end after 3 steps;
- ``raise``: raises an uncaught RuntimeError after 3 steps;
- ``wait``: trains until it is signalled (at most 10,000 steps, then exits 3);
- ``checkpoint``: saves a checkpoint under ROOT/ckpt and the model's values at step 2 into
  ROOT/at_step2.pt, then trains like ``wait``.
"""

import sys
from pathlib import Path

import torch
from engine_models import batches, lm_loss, make_model, placement_config

import offload


def main() -> None:
    root, end = Path(sys.argv[1]), sys.argv[2]
    params = sys.argv[3] if len(sys.argv) > 3 else "nvme"
    optim = sys.argv[4] if len(sys.argv) > 4 else "nvme"
    model, optimizer = offload.wrap(make_model(), placement_config(params, optim, root))
    data = batches(4)
    steps = 3 if end in ("return", "raise") else 10_000
    for step in range(1, steps + 1):
        loss = lm_loss(model, data[step % len(data)])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if end == "checkpoint" and step == 2:
            offload.save_checkpoint(root / "ckpt", model, optimizer)
            torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "at_step2.pt")
        print(f"step {step}", flush=True)
    if end == "raise":
        raise RuntimeError("an error in the user's script")
    if end != "return":
        sys.exit(3)  # never signalled


if __name__ == "__main__":
    main()
