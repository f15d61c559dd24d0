"""Builds the native extension ``offload._C`` from ``csrc/``.

The extension includes no PyTorch headers and does not link against torch: Python passes raw
pointers (``tensor.data_ptr()``), element counts and dtype codes. So ``pip install .`` works
with build isolation, builds in seconds and survives torch upgrades. SIMD code paths are
compiled with per-function target attributes and chosen at run time (never ``-march=native``).

``OFFLOAD_SANITIZE=1 python setup.py build_ext`` builds it with AddressSanitizer and
UndefinedBehaviorSanitizer under ``build/sanitize`` and never in place, so the normal build is
left alone. Undefined behaviour is fatal, except a null reference, which is reported so that
``UBSAN_OPTIONS=suppressions=csrc/ubsan.supp`` can silence pybind11's one false positive.
Python itself is not instrumented, so the ASan runtime must be preloaded (with libstdc++, which
ASan needs at start-up): ``LD_PRELOAD="$(gcc -print-file-name=libasan.so)
$(gcc -print-file-name=libstdc++.so)"`` and ``ASAN_OPTIONS=detect_leaks=0`` (the interpreter
does not free everything at exit). ``tests/test_sanitizers.py`` does all of it.
"""

import os
import sys

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Compile the translation units in parallel (OFFLOAD_BUILD_JOBS, default: all cores).
ParallelCompile("OFFLOAD_BUILD_JOBS", default=0).install()

SOURCES = sorted(os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".cpp"))

extra_compile = ["-O3", "-Wall", "-Wextra", "-fvisibility=hidden", "-std=c++17"]
extra_link = []
libraries = []
if sys.platform.startswith("linux"):
    libraries += ["pthread", "dl"]  # dl: dlopen/dlsym before glibc 2.34 (csrc/compute_threads.cpp)

SANITIZE = os.environ.get("OFFLOAD_SANITIZE") == "1"
if SANITIZE:
    sanitizers = [
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=all",
        "-fsanitize-recover=null",  # reported, not fatal: one check is suppressed (ubsan.supp)
        "-fno-omit-frame-pointer",
        "-g",
    ]
    extra_compile += [*sanitizers, "-O1"]
    extra_link += sanitizers


class BuildExt(build_ext):
    """pybind11's build_ext; a sanitizer build never lands in place (see the docstring)."""

    def finalize_options(self) -> None:
        if SANITIZE:
            self.inplace = 0
        super().finalize_options()


if os.environ.get("OFFLOAD_SKIP_NATIVE") == "1":
    ext_modules = []
else:
    ext_modules = [
        Pybind11Extension(
            "offload._C",
            SOURCES,
            include_dirs=["csrc"],
            extra_compile_args=extra_compile,
            extra_link_args=extra_link,
            libraries=libraries,
            cxx_std=17,
        )
    ]

setup(
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExt},
    options={"build": {"build_base": os.path.join("build", "sanitize")}} if SANITIZE else {},
)
