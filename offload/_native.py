"""The one place that loads the compiled extension ``offload._C``.

Every native entry point has a torch fallback with the same results. The fallback is used when
the extension failed to build or import, or when ``OFFLOAD_NATIVE=0`` is set; either way it is
announced once through ``logging`` (never silently). Callers ask :func:`get` for the module and
take their torch path when it returns ``None``.
"""

from __future__ import annotations

import logging
import os
import threading
from types import ModuleType

logger = logging.getLogger("offload.native")

_lock = threading.Lock()
_loaded = False
_module: ModuleType | None = None
_reason = ""
_announced = False
_forced_off = False  # set by force_fallback() in tests


def _load() -> None:
    global _loaded, _module, _reason
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        flag = os.environ.get("OFFLOAD_NATIVE", "1").strip().lower()
        if flag in ("0", "false", "off", "no"):
            _module, _reason = None, "disabled by OFFLOAD_NATIVE=0"
        else:
            try:
                from offload import _C  # noqa: PLC0415

                _module, _reason = _C, ""
            except ImportError as exc:  # extension not built, or built for another Python
                _module, _reason = None, f"offload._C could not be imported ({exc})"
        _loaded = True


def _announce() -> None:
    global _announced
    if not _announced:
        _announced = True
        logger.warning(
            "offload native extension not in use: %s; using the torch fallback "
            "(same results, slower)",
            _reason or "fallback forced",
        )


def get() -> ModuleType | None:
    """The extension module, or ``None`` when the torch fallback must be used."""
    _load()
    if _module is None or _forced_off:
        _announce()
        return None
    return _module


def available() -> bool:
    """Whether the extension is loaded and enabled (does not announce anything)."""
    _load()
    return _module is not None and not _forced_off


def reason() -> str:
    """Why the fallback is used ('' when the extension is in use)."""
    _load()
    if _forced_off:
        return "fallback forced"
    return _reason


class force_fallback:
    """Context manager (tests, benchmarks): run with the torch fallback even if native is built."""

    def __enter__(self) -> force_fallback:
        global _forced_off
        self._prev = _forced_off
        _forced_off = True
        return self

    def __exit__(self, *exc: object) -> None:
        global _forced_off
        _forced_off = self._prev


def simd_level() -> str:
    """SIMD level the native kernels use ('none' without the extension)."""
    mod = get() if available() else None
    return mod.simd_level() if mod is not None else "none"


def set_num_threads(n: int) -> None:
    """Threads of the native compute pool (CPU Adam, gradient kernels), caller included."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_threads must be an integer >= 1, got {n!r}")
    mod = get() if available() else None
    if mod is not None:
        mod.set_num_threads(n)


def get_num_threads() -> int:
    mod = get() if available() else None
    return mod.get_num_threads() if mod is not None else (os.cpu_count() or 1)


def compute_backend() -> str:
    """The threads the calling thread's native kernels run on: ``"openmp <path>"`` (torch's
    GNU OpenMP team, the default when torch loaded libgomp), ``"pool"`` (offload's own threads)
    or ``"none"`` (no extension). ``csrc/compute_threads.h`` says why."""
    mod = get() if available() else None
    if mod is None:
        return "none"
    backend = mod.compute_backend()
    return f"openmp {mod.compute_backend_library()}" if backend == "openmp" else backend


def use_pool_in_this_thread() -> None:
    """The calling thread's kernels run on offload's own pool from now on: for a background
    thread that runs beside the training thread's compute (``csrc/compute_threads.h``)."""
    mod = get() if available() else None
    if mod is not None:
        mod.use_pool_in_this_thread()


class compute_backend_set:
    """Context manager (tests, benchmarks): run the kernels on ``"openmp"`` or ``"pool"``
    threads, then go back to ``"auto"``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> compute_backend_set:
        self.mod = get()
        if self.mod is None:
            raise RuntimeError(f"compute backend {self.name!r}: the native extension is not in use")
        self.mod.set_compute_backend(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        self.mod.set_compute_backend("auto")
