"""Builds the native extension ``offload._C`` from ``csrc/``.

The extension includes no PyTorch headers and does not link against torch: Python passes raw
pointers (``tensor.data_ptr()``), element counts and dtype codes. So ``pip install .`` works
with build isolation, builds in seconds and survives torch upgrades. SIMD code paths are
compiled with per-function target attributes and chosen at run time (never ``-march=native``).
"""

import os
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Compile the translation units in parallel (OFFLOAD_BUILD_JOBS, default: all cores).
ParallelCompile("OFFLOAD_BUILD_JOBS", default=0).install()

SOURCES = sorted(os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".cpp"))

extra_compile = ["-O3", "-Wall", "-Wextra", "-fvisibility=hidden", "-std=c++17"]
libraries = []
if sys.platform.startswith("linux"):
    libraries.append("pthread")

if os.environ.get("OFFLOAD_SKIP_NATIVE") == "1":
    ext_modules = []
else:
    ext_modules = [
        Pybind11Extension(
            "offload._C",
            SOURCES,
            include_dirs=["csrc"],
            extra_compile_args=extra_compile,
            libraries=libraries,
            cxx_std=17,
        )
    ]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
