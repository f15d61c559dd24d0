"""A fresh virtual environment gets a working offload from one `pip install .`, with build
isolation on (pip builds the native extension in its own environment with setuptools, wheel and
pybind11 from pyproject.toml; torch is not needed to build). The venv sees the system's
site-packages only so that torch and the other runtime dependencies need not be downloaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    "build",
    "dist",
    "__pycache__",
    "*.so",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "reports",
    ".venv",
    "venv",
)


@pytest.mark.slow
def test_fresh_venv_pip_install(tmp_path: Path, request: pytest.FixtureRequest):
    # Minutes of building: run only when a -m expression selected it (`pytest -m slow`), even
    # while pyproject's addopts do not yet exclude slow tests by default.
    if not request.config.getoption("markexpr"):
        pytest.skip("slow: run with `pytest -m slow tests/test_install.py`")
    # A copy of the working tree, so the build writes nothing into the checkout and no built
    # extension (offload/_C*.so) sneaks in from it.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    assert not list(src.glob("offload/_C*"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OFFLOAD_NATIVE")}
    start = time.perf_counter()
    pip = subprocess.run(
        [str(py), "-m", "pip", "install", "--disable-pip-version-check", str(src)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    seconds = time.perf_counter() - start
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    assert "--no-build-isolation" not in " ".join(pip.args)
    print(f"\nfresh-venv `pip install .`: {seconds:.1f} s (load average {os.getloadavg()[0]:.1f})")

    # Run from outside the source tree so the installed copy is what gets imported.
    check = (
        "import offload, offload._C as c, offload._native as n;"
        "assert n.available(), n.reason();"
        "print(offload.__file__); print(c.__file__); print(c.simd_level())"
    )
    out = subprocess.run(
        [str(py), "-c", check], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert out.returncode == 0, out.stderr
    pkg_file, ext_file, simd = out.stdout.split()
    site = str(venv / "lib")
    assert pkg_file.startswith(site) and ext_file.startswith(site)
    assert simd in ("scalar", "avx2", "avx512", "neon")

    cli = subprocess.run(
        [str(venv / "bin" / "offload"), "report", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    report = json.loads(cli.stdout)
    assert report["native"]["loaded"] is True
    assert report["native"]["module"].startswith(site)
