"""A child of ``test_interrupts.py``: trains the tiny model with params and optimizer state on
NVMe, the default config (the step in backward), ``WRAPS`` times over (a fresh wrap each, 4
steps of ``ACCUM`` micro-steps), while the test runs several of these at once on the machine's
cores: contended, the threads' timing varies the most. A wait of a minute without a step
done exits with every thread's stack (a deadlock between the update and the backward). Prints
one JSON line: the wraps trained.

``python _contended_steps.py ROOT WRAPS ACCUM``
"""

from __future__ import annotations

import faulthandler
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_models import nvme_recipe  # noqa: E402


def main() -> None:
    root, wraps, accum = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    for _ in range(wraps):
        shutil.rmtree(root, ignore_errors=True)
        model, opt, one_step = nvme_recipe(root, accum)
        try:
            for s in range(4):
                faulthandler.dump_traceback_later(60, exit=True)
                one_step(s)
                faulthandler.cancel_dump_traceback_later()
        finally:
            opt.close()
    print(json.dumps({"wraps": wraps}))


if __name__ == "__main__":
    main()
