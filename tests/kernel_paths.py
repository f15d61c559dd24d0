"""Shared by the native kernel tests: run a block on the native path or the torch fallback, or at
one SIMD level."""

from __future__ import annotations

import contextlib

import pytest

from offload import _native


@contextlib.contextmanager
def kernel_path(name: str):
    """'native' (skipped without the extension) or 'fallback' (torch)."""
    if name == "fallback":
        with _native.force_fallback():
            yield
        return
    if not _native.available():
        pytest.skip(f"native extension unavailable: {_native.reason()}")
    yield


@contextlib.contextmanager
def simd_level(level: str):
    """The native kernels at one SIMD level (restored after)."""
    mod = _native.get()
    before = mod.simd_level()
    mod.set_simd_level(level)
    try:
        yield
    finally:
        mod.set_simd_level(before)


def simd_levels() -> list[str]:
    """The SIMD levels this CPU supports (none without the extension)."""
    return _native.get().supported_simd_levels() if _native.available() else []
