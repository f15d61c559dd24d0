"""The threads the native kernels run on (csrc/compute_threads.h): torch's GNU OpenMP team when
torch loaded libgomp, offload's own pool otherwise, in a forked child, or when asked; the same
bits on either, for any thread count; never a second OpenMP runtime."""

from __future__ import annotations

import collections
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from offload import _native
from offload.homes.optim import Units
from offload.optim import accumulate_grad, adam_step
from offload.runtime.schedule import _Worker

pytestmark = pytest.mark.skipif(not _native.available(), reason="native extension unavailable")

N = (3 << 20) + 65  # 13 tasks of the split, with a SIMD tail


def _loaded_gomps() -> set[str]:
    return {
        line.split()[-1]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if Path(line.split()[-1]).name.startswith("libgomp")
    }


def _step(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    v = torch.rand(n, generator=gen)
    g = torch.randn(n, generator=gen).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    adam_step(p, g, m, v, step=3, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, out=out)
    acc = torch.randn(n, generator=gen)
    found, sumsq = accumulate_grad(acc, g, scale=0.5)
    return p, m, v, out, acc, torch.tensor([float(found), sumsq], dtype=torch.float64)


def test_the_kernels_join_the_libgomp_torch_loaded_and_no_other():
    gomps = _loaded_gomps()
    assert len(gomps) <= 1, f"two OpenMP runtimes in one process: {gomps}"
    backend = _native.compute_backend()
    if gomps:  # a torch built on GNU OpenMP (the PyPI wheels)
        assert backend == f"openmp {gomps.pop()}"
    else:
        assert backend == "pool"
    with _native.compute_backend_set("pool"):
        assert _native.compute_backend() == "pool"
    assert _native.compute_backend() == backend


def test_an_unknown_backend_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match=r"'team' is not known; allowed: 'auto', 'openmp', 'pool'"):
        _native.get().set_compute_backend("team")


def test_without_a_loaded_libgomp_the_pool_runs_and_openmp_is_refused():
    code = textwrap.dedent(
        """
        from offload import _C
        assert _C.compute_backend() == "pool", _C.compute_backend()
        try:
            _C.set_compute_backend("openmp")
        except ValueError as exc:
            print("refused:", exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused: compute backend 'openmp' needs GNU OpenMP (libgomp)" in out.stdout


_LATE_GOMP = """
import ctypes, glob, importlib.util, os
from offload import _C
_C.set_num_threads(2)
n = 1 << 20
acc, grad = (ctypes.c_float * n)(), (ctypes.c_float * n)(*([1.0] * 8))
if {kernel_first}:  # a kernel call that finds no libgomp
    _C.accumulate_grad(ctypes.addressof(acc), ctypes.addressof(grad), n, 0, 1.0, False)
else:  # a query that finds none
    assert _C.compute_backend() == "pool"
torch_dir = importlib.util.find_spec("torch").submodule_search_locations[0]
ctypes.CDLL(sorted(glob.glob(os.path.join(torch_dir, "lib", "libgomp*.so*")))[0])
print("after loading libgomp:", _C.compute_backend())
"""


@pytest.mark.skipif(not _loaded_gomps(), reason="this torch does not run on GNU OpenMP")
@pytest.mark.parametrize(("kernel_first", "then"), [(True, "pool"), (False, "openmp")])
def test_a_kernel_call_that_finds_no_libgomp_keeps_to_the_pool(kernel_first, then):
    """A kernel call has torch loaded, so one that finds no libgomp decides for good (a torch on
    another OpenMP would otherwise walk the loaded objects on every call); a query made before
    torch is imported decides nothing."""
    code = _LATE_GOMP.format(kernel_first=kernel_first)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"after loading libgomp: {then}", out.stdout


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_same_bits_on_the_team_and_on_the_pool(threads):
    before = _native.get_num_threads()
    backends = ["pool"] + (["openmp"] if _native.compute_backend().startswith("openmp") else [])
    results = {}
    try:
        _native.set_num_threads(threads)
        for backend in backends:
            with _native.compute_backend_set(backend):
                results[backend] = _step(N, seed=5)
        _native.set_num_threads(1)
        results["one thread"] = _step(N, seed=5)
    finally:
        _native.set_num_threads(before)
    for name, got in results.items():
        for a, b in zip(got, results["one thread"], strict=True):
            assert torch.equal(a, b), name


def test_callers_on_several_threads_each_get_their_own_team():
    """The step's updater thread and the training thread may call kernels at once: each starts
    its own region (libgomp gives every thread its team); results as when called one by one."""
    want = [_step(N, seed=s) for s in range(4)]
    got: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            for _ in range(3):
                got[seed] = _step(N, seed=seed)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not errors, errors
    assert not any(w.is_alive() for w in workers), "a kernel call did not return"
    for seed in range(4):
        for a, b in zip(got[seed], want[seed], strict=True):
            assert torch.equal(a, b)


def test_a_thread_can_keep_to_the_pool_alone():
    seen: list[str] = []

    def background() -> None:
        _native.use_pool_in_this_thread()
        seen.append(_native.compute_backend())
        seen.append("same bits" if all(map(torch.equal, _step(N, 7), want)) else "other bits")

    want = _step(N, 7)
    before = _native.compute_backend()
    worker = threading.Thread(target=background)
    worker.start()
    worker.join(timeout=120)
    assert seen == ["pool", "same bits"]
    assert _native.compute_backend() == before  # the other threads keep the process's setting


def test_the_update_worker_runs_its_kernels_on_the_pool():
    """offload's update worker runs beside the training thread's backward: on a libgomp team of
    its own, whose workers spin after each region, the step in backward was 11% slower."""
    seen: list[str] = []

    class Optim:
        def step_units(self, source, hyper, on_unit_done) -> None:
            seen.append(_native.compute_backend())

    worker = _Worker(Optim(), collections.defaultdict(float), lambda err, what: RuntimeError(what))
    worker.start([], Units([]), hyper=None)
    worker.join()
    assert seen == ["pool"]


def test_a_forked_child_runs_the_kernels_on_the_pool():
    """libgomp's team does not survive fork: a child that started a region on it would wait
    forever for its parent's threads. The child runs on the pool. (Its inputs are made before
    the fork and compared with numpy: torch's own parallel ops would hang in the child.)"""
    code = textwrap.dedent(
        """
        import os, numpy, torch
        from offload import _native
        from offload.optim import adam_step
        _native.set_num_threads(2)
        n = 1 << 21
        def inputs():
            return torch.ones(n), torch.full((n,), 0.5), torch.zeros(n), torch.zeros(n)
        def step(p, g, m, v):
            adam_step(p, g, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
            return p
        want = step(*inputs()).numpy()  # the parent's team (if torch loaded libgomp) ran a region
        mine = inputs()
        before = _native.compute_backend()
        pid = os.fork()
        if pid == 0:
            ok = _native.compute_backend() == "pool"
            ok = ok and numpy.array_equal(step(*mine).numpy(), want)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        print("parent", before, "child exit", os.waitstatus_to_exitcode(status))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith("child exit 0"), out.stdout
