"""The native extension under AddressSanitizer and UndefinedBehaviorSanitizer (issue 13, part 6).

``OFFLOAD_SANITIZE=1 python setup.py build_ext`` builds ``offload._C`` instrumented, under
``build/sanitize`` (the normal in-place build is left alone). This test builds it, assembles a
throw-away tree (this checkout's Python sources and tests, the instrumented extension), proves
the sanitizer is live there (an out-of-bounds kernel call must be reported), then runs the tests
that drive native code in it: any ASan report or UBSan "runtime error" fails them (undefined
behaviour is built fatal, or reported; ``csrc/ubsan.supp`` silences pybind11's one false
positive). Python is not instrumented, so the ASan runtime is preloaded, with
libstdc++ (ASan must find ``__cxa_throw`` at start-up, and the interpreter does not link it),
and leak detection is off (the interpreter does not free everything at exit).

Slow: the build takes a minute or two, the tests run 2-3x slower instrumented.
``pytest -m slow tests/test_sanitizers.py``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NATIVE_TESTS = [
    "tests/test_native.py",
    "tests/test_cpu_adam.py",
    "tests/test_grad_kernels.py",
    "tests/test_aio.py",
    "tests/test_nvme_store.py",
    "tests/test_buffer_pool.py",
    "tests/test_soak.py",  # 150 steps through every native path: kernels, IO, the pool
    "tests/test_exit.py",
]
# test_exit's training children (five concurrent processes) add minutes and no native coverage
DESELECT = [
    f"--deselect=tests/test_exit.py::{name}"
    for name in (
        "test_exit_status_and_no_swap_left",
        "test_uncaught_exception_prints_the_usual_traceback",
        "test_sigint_is_a_keyboard_interrupt",
    )
]

OVERFLOW = """
import torch
from offload import _native
C = _native.get()
p, g, m, v = (torch.zeros(1000) for _ in range(4))
C.adam_step(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 1100, 0, 0, -1,
            1.0, 1.0, 0.0, 0.1, 0.999, 0.001, 1.0, 1e-8, -1e-3)  # 100 elements too many
"""


def runtime(name: str) -> str:
    path = subprocess.run(
        ["gcc", f"-print-file-name={name}"], capture_output=True, text=True
    ).stdout.strip()
    if not os.path.isabs(path):
        pytest.skip(f"gcc does not know {name}")
    return path


def digest(paths: list[Path]) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


@pytest.mark.slow
def test_native_tests_pass_under_asan_and_ubsan(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    preload = f"{runtime('libasan.so')} {runtime('libstdc++.so')}"
    in_place = sorted((ROOT / "offload").glob("_C*.so"))
    before = digest(in_place)

    build = subprocess.run(
        # --inplace is refused; --force: the flags may have changed, not the sources
        [sys.executable, "setup.py", "build_ext", "--inplace", "--force", "-q"],
        cwd=ROOT,
        env=dict(os.environ, OFFLOAD_SANITIZE="1"),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    built = sorted((ROOT / "build" / "sanitize").glob("lib*/offload/_C*.so"))
    assert built, "no instrumented extension under build/sanitize"
    assert b"__asan_report" in built[-1].read_bytes()
    assert digest(in_place) == before, "the sanitizer build replaced the normal one"

    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(ROOT / "offload", tree / "offload", ignore=ignore)
    shutil.copytree(ROOT / "tests", tree / "tests", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tree)
    shutil.copy(built[-1], tree / "offload")
    env = dict(
        os.environ,
        LD_PRELOAD=preload,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
        UBSAN_OPTIONS=f"print_stacktrace=1:suppressions={ROOT / 'csrc' / 'ubsan.supp'}",
        PYTHONPATH=str(tree),
    )
    env.pop("OFFLOAD_NATIVE", None)

    canary = subprocess.run(
        [sys.executable, "-c", OVERFLOW], cwd=tree, env=env, capture_output=True, text=True
    )
    # the kind ASan names depends on the load: on an AVX-512 machine (a 64-byte load across the
    # end) "unknown-crash", not the "heap-buffer-overflow" this once asserted; either way the
    # report locates the access past the 1000 floats
    reported = "ERROR: AddressSanitizer" in canary.stderr
    located = "to the right of 4000-byte region" in canary.stderr
    assert canary.returncode != 0 and reported and located, canary.stderr[-3000:]

    # -s: a report is written to fd 2 and the process ends; pytest's capture would lose it
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *DESELECT]
        + NATIVE_TESTS,
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    output = run.stdout + run.stderr
    assert "ERROR: AddressSanitizer" not in output, output[-6000:]
    assert "runtime error:" not in output, output[-6000:]
    assert run.returncode == 0, output[-6000:]
    print(run.stdout.strip().splitlines()[-1])
