"""A child for ``tests/test_interrupts.py``: Ctrl-C at random moments of training, caught, and
training goes on, as in a notebook where a cell is interrupted and run again.

``python _notebook_worker.py ROOT SEED ACCUM``: params and optimizer state on NVMe under
ROOT, the default config (the step in backward) with ``gradient_accumulation_steps`` ACCUM
(and clipping when ACCUM > 1). Every other step a timer sends SIGINT at a random moment
(seeded) within about a step; the loop catches the KeyboardInterrupt, calls ``zero_grad()``
and goes on. Any other exception, or a step that does not end, fails the run. At the end, two
uninterrupted steps, then one JSON line: the interrupts caught, the shards still pinned at idle
and the pool buffers without an owner (none may be), whether the weights are finite; then
``close()``.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_models import lost_buffers, nvme_recipe, pinned_shards  # noqa: E402

from offload.api.wrap import engine_of  # noqa: E402

STEPS = 24


def main() -> None:
    root, seed, accum = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where it waits
    rng = random.Random(seed)
    model, opt, one_step = nvme_recipe(root, accum)
    one_step(0)  # (counts the backwards, and warms up: slower than the rest)
    start = time.perf_counter()
    one_step(1)
    step_time = time.perf_counter() - start  # from the first step on, timers fell after most
    caught = 0
    for s in range(2, STEPS):
        timer = None
        if s % 2 == 0:
            timer = threading.Timer(
                rng.uniform(0.0, 1.2 * step_time), os.kill, (os.getpid(), signal.SIGINT)
            )
            timer.start()
        try:
            try:
                one_step(s)
            except KeyboardInterrupt:
                caught += 1
                opt.zero_grad()
            finally:
                if timer is not None:
                    timer.cancel()
                    timer.join()
        except KeyboardInterrupt:  # the timer fired in zero_grad() above: the same again
            caught += 1
            opt.zero_grad()
    one_step(0)
    one_step(1)
    opt.synchronize()
    pinned = pinned_shards(engine_of(model)) + lost_buffers(engine_of(model))
    finite = all(math.isfinite(float(v.float().abs().sum())) for v in model.state_dict().values())
    print(json.dumps({"caught": caught, "pinned": pinned, "finite": finite}), flush=True)
    opt.close()


if __name__ == "__main__":
    main()
