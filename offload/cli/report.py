"""``offload report``: what this machine offers to offload, as text or ``--json``.

Native extension (loaded, or why not), SIMD levels, compute threads, CPU, torch version, CUDA
devices and whether pinned memory works, total and available RAM and the mlock limit, and for
one directory (``--path``, default the temp dir) its filesystem, free space and whether O_DIRECT
works there. Every probe catches its own failure and reports it, so the command always exits 0.

Note: the O_DIRECT probe
    O_DIRECT needs the buffer address, the file offset and the length aligned (4096 bytes covers
    every common device). The probe creates a temporary file in the directory, opens it with
    ``O_DIRECT``, writes 4096 bytes from an anonymous ``mmap`` (page-aligned, unlike a Python
    ``bytes``), reads them back into a second ``mmap`` and compares. tmpfs and some network or
    overlay filesystems refuse the ``open`` with EINVAL; that is reported with the errno name.
"""

from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import platform
import shutil
import sys
import tempfile
from typing import Any

from offload.config.sizes import format_size

_PROBE_BYTES = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--path",
        default=None,
        metavar="DIR",
        help="directory to probe for O_DIRECT and free space (default: the temp dir, "
        f"{tempfile.gettempdir()})",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    report = collect(args.path or tempfile.gettempdir())
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report), end="")
    return 0


def collect(path: str) -> dict[str, Any]:
    """The report as plain JSON-able data (see the module doc for what is probed)."""
    from offload import __version__

    return {
        "offload": {
            "version": __version__,
            "python": f"{platform.python_version()} ({platform.python_implementation()})",
            "platform": platform.platform(),
        },
        "native": _native_info(),
        "cpu": _cpu_info(),
        "torch": _torch_info(),
        "memory": _memory_info(),
        "disk": _disk_info(path),
    }


def _guard(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # a probe must never take the report down
        return {"error": f"{type(exc).__name__}: {exc}"}


def _native_info() -> dict[str, Any]:
    # torch loaded first, as in training: which threads the kernels run on depends on it
    import torch  # noqa: F401, PLC0415

    from offload import _native

    loaded = _native.available()
    info: dict[str, Any] = {
        "loaded": loaded,
        "reason": "" if loaded else _native.reason(),
        "module": None,
        "simd_level": "none",
        "detected_simd_level": "none",
        "supported_simd_levels": [],
        "compute_threads": _native.get_num_threads(),
        "compute_backend": _native.compute_backend(),
        "abi_version": None,
        "entry_points": [],
    }
    if loaded:
        mod = _native.get()
        info.update(
            module=getattr(mod, "__file__", None),
            simd_level=mod.simd_level(),
            detected_simd_level=mod.detect_simd_level(),
            supported_simd_levels=list(mod.supported_simd_levels()),
            abi_version=getattr(mod, "ABI_VERSION", None),
            entry_points=sorted(
                n
                for n in dir(mod)
                if not n.startswith("_") and n.isidentifier() and callable(getattr(mod, n))
            ),
        )
    return info


def _cpu_info() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "logical_cores": os.cpu_count(), "usable_cores": usable}


def _torch_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError as exc:
        return {"version": None, "error": f"torch not importable: {exc}"}
    cuda = bool(torch.cuda.is_available())
    count = torch.cuda.device_count() if cuda else 0
    devices = [torch.cuda.get_device_name(i) for i in range(count)]
    return {
        "version": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "cuda_device_count": count,
        "cuda_devices": devices,
        "pinned_memory": _guard(_pinned_probe, torch, cuda),
    }


def _pinned_probe(torch: Any, cuda: bool) -> dict[str, Any]:
    if not cuda:
        return {"works": False, "detail": "needs a CUDA device; none available"}
    try:
        t = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
        ok = bool(t.is_pinned())
        return {"works": ok, "detail": "1 MiB page-locked" if ok else "is_pinned() is false"}
    except Exception as exc:  # pinning can fail when host memory is short or the driver is broken
        return {"works": False, "detail": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}


def _memory_info() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        import psutil

        vm = psutil.virtual_memory()
        info.update(total_bytes=int(vm.total), available_bytes=int(vm.available))
    except ImportError:
        info.update(total_bytes=None, available_bytes=None, error="psutil not installed")
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        info["memlock_limit_bytes"] = None if soft == resource.RLIM_INFINITY else int(soft)
    except (ImportError, AttributeError, OSError):
        info["memlock_limit_bytes"] = None
    return info


def _disk_info(path: str) -> dict[str, Any]:
    path = os.path.abspath(os.path.expanduser(path))
    info: dict[str, Any] = {"path": path, "exists": os.path.isdir(path)}
    if not info["exists"]:
        info["o_direct"] = {"works": False, "detail": "not an existing directory"}
        return info
    usage = shutil.disk_usage(path)
    info.update(free_bytes=int(usage.free), total_bytes=int(usage.total))
    info["filesystem"] = _guard(_filesystem, path)
    info["o_direct"] = _guard(probe_o_direct, path)
    return info


def _filesystem(path: str) -> dict[str, Any]:
    """The mount holding ``path`` (longest matching mount point in /proc/self/mounts)."""
    real = os.path.realpath(path)
    best = ("", "", "")
    with open("/proc/self/mounts", encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            source, mount, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[1]):
                best = (source, mount, fstype)
    return {"type": best[2] or None, "mount": best[1] or None, "source": best[0] or None}


def probe_o_direct(path: str) -> dict[str, Any]:
    """Whether an O_DIRECT 4096-byte write and read-back work in directory ``path``."""
    if not hasattr(os, "O_DIRECT"):
        return {"works": False, "detail": f"O_DIRECT does not exist on {sys.platform}"}
    fd, name = tempfile.mkstemp(prefix=".offload-odirect-", dir=path)
    os.close(fd)
    try:
        try:
            fd = os.open(name, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            return {"works": False, "detail": f"open(O_DIRECT) failed: {_errno(exc)}"}
        try:
            out, back = mmap.mmap(-1, _PROBE_BYTES), mmap.mmap(-1, _PROBE_BYTES)
            pattern = bytes(range(256)) * (_PROBE_BYTES // 256)
            out.write(pattern)
            try:
                written = os.pwrite(fd, out, 0)
                read = os.preadv(fd, [back], 0)
            except OSError as exc:
                return {"works": False, "detail": f"aligned O_DIRECT IO failed: {_errno(exc)}"}
            if written != _PROBE_BYTES or read != _PROBE_BYTES or back[:] != pattern:
                return {"works": False, "detail": f"short or corrupt IO ({written}/{read} bytes)"}
            return {"works": True, "detail": "4096-byte aligned write and read-back"}
        finally:
            os.close(fd)
    finally:
        os.unlink(name)


def _errno(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"{name} ({exc.strerror})"


def _size(n: Any) -> str:
    return format_size(n) if isinstance(n, int) else "unknown"


def _yes(flag: Any) -> str:
    return "yes" if flag else "no"


def render(r: dict[str, Any]) -> str:
    """The report as aligned text."""
    rows: list[tuple[str, str]] = []

    def head(title: str) -> None:
        rows.append((title, ""))

    def row(key: str, value: Any) -> None:
        rows.append(("  " + key, str(value)))

    o, n, c, t, m, d = (r[k] for k in ("offload", "native", "cpu", "torch", "memory", "disk"))
    head(f"offload {o['version']}")
    row("python", o["python"])
    row("platform", o["platform"])
    head("native extension")
    if n.get("loaded"):
        row("status", f"loaded ({n['module']})")
        row(
            "simd level",
            f"{n['simd_level']} (detected {n['detected_simd_level']}; supported: "
            f"{', '.join(n['supported_simd_levels'])})",
        )
    else:
        row("status", f"fallback: torch implementations in use ({n.get('reason')})")
        row("simd level", "none (fallback)")
    if n.get("entry_points"):
        row("entry points", ", ".join(n["entry_points"]))
    row("compute threads", f"{n.get('compute_threads')} on {n.get('compute_backend')}")
    head("cpu")
    row("model", c.get("model"))
    row("cores", f"{c.get('usable_cores')} usable of {c.get('logical_cores')} logical")
    head("torch")
    if t.get("version") is None:
        row("version", t.get("error"))
    else:
        row("version", f"{t['version']} ({t['threads']} intra-op threads)")
        row("cuda build", t["cuda_build"] or "none (CPU-only build)")
        row("cuda available", _yes(t["cuda_available"]))
        row(
            "cuda devices",
            f"{t['cuda_device_count']}"
            + (f" ({', '.join(t['cuda_devices'])})" if t["cuda_devices"] else ""),
        )
        pin = t["pinned_memory"]
        row("pinned memory", f"{_yes(pin.get('works'))} ({pin.get('detail', pin.get('error'))})")
    head("memory")
    row("total RAM", _size(m.get("total_bytes")))
    row("available RAM", _size(m.get("available_bytes")))
    lim = m.get("memlock_limit_bytes")
    row(
        "memlock limit",
        ("unlimited" if lim is None else _size(lim)) + " (RLIMIT_MEMLOCK, caps mlock()ed memory)",
    )
    head(f"disk at {d['path']}")
    if not d["exists"]:
        row("status", "not an existing directory")
    else:
        fs = d.get("filesystem", {})
        if "error" in fs:
            row("filesystem", fs["error"])
        else:
            row("filesystem", f"{fs.get('type')} ({fs.get('source')} mounted on {fs.get('mount')})")
        row("free", f"{_size(d['free_bytes'])} of {_size(d['total_bytes'])}")
    od = d["o_direct"]
    row("O_DIRECT", f"{'works' if od.get('works') else 'no'} ({od.get('detail', od.get('error'))})")
    width = max(len(k) for k, v in rows if v) + 2
    return "".join(f"{k}\n" if not v else f"{k.ljust(width)}{v}\n" for k, v in rows)
