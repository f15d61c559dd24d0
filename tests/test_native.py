"""The native loader: extension present, fallback switch announced, thread and SIMD controls."""

import logging
import os
import subprocess
import sys

import pytest

from offload import _native


def test_extension_builds_and_reports_simd():
    assert _native.available(), _native.reason()
    mod = _native.get()
    assert mod.simd_level() in mod.supported_simd_levels()
    assert "scalar" in mod.supported_simd_levels()


def test_set_simd_level_rejects_unknown_names():
    mod = _native.get()
    with pytest.raises(ValueError, match="allowed: scalar, avx2, avx512, neon"):
        mod.set_simd_level("sse9")
    mod.set_simd_level("scalar")
    try:
        assert mod.simd_level() == "scalar"
    finally:
        mod.set_simd_level("auto")
    assert mod.simd_level() == mod.detect_simd_level()


def test_thread_count_is_configurable():
    before = _native.get_num_threads()
    try:
        _native.set_num_threads(1)
        assert _native.get_num_threads() == 1
    finally:
        _native.set_num_threads(before)
    with pytest.raises(ValueError, match="num_threads"):
        _native.set_num_threads(0)


def test_env_switch_falls_back_and_announces_once():
    code = (
        "import logging; logging.basicConfig(level=logging.INFO);"
        "from offload import _native;"
        "assert _native.get() is None; assert _native.get() is None;"
        "print('reason=' + _native.reason())"
    )
    env = dict(os.environ, OFFLOAD_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "reason=disabled by OFFLOAD_NATIVE=0" in out.stdout
    assert out.stderr.count("native extension not in use") == 1


def test_force_fallback_context(caplog):
    with caplog.at_level(logging.WARNING, logger="offload.native"):
        with _native.force_fallback():
            assert _native.get() is None
            assert not _native.available()
        assert _native.available()
