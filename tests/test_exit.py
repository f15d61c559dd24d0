"""Exits are clean, however a training script ends (issue 13, part 1).

A child process trains with params and optimizer state on NVMe and never calls
``optimizer.close()``; it ends by returning, by an uncaught exception, by SIGINT or by SIGTERM.
Each must exit with its normal status (0, 1, killed by SIGINT via KeyboardInterrupt, killed by
SIGTERM), print no ``terminate called`` abort, and leave no swap file or directory behind. The
children run concurrently (one module fixture) to keep the suite fast. Children get a default
SIGINT disposition whatever this process inherited (a shell's background job ignores SIGINT,
and Python then never installs its KeyboardInterrupt handler in the child).

The rest checks the registry of ``offload.io.lifecycle`` in-process: what is open, the SIGTERM
handler present only while something is open, and a forked child that never touches its
parent's files.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from children import ROOT, TIMEOUT, start_worker, wait_for_step

from offload.io import AsyncIO, NvmeStore, lifecycle


def swap_left(root: Path) -> list[str]:
    """Files and directories left under the NVMe paths (the paths themselves may stay)."""
    return sorted(
        str(p.relative_to(root)) for d in ("nvme_p", "nvme_o") for p in (root / d).glob("*")
    )


# (name, how it ends, placements, signal sent after step 2 or None, expected returncode)
CASES = [
    ("return", "return", ("nvme", "nvme"), None, 0),
    ("return_params_only", "return", ("nvme", "cpu"), None, 0),
    ("raise", "raise", ("nvme", "nvme"), None, 1),
    ("sigint", "wait", ("nvme", "nvme"), signal.SIGINT, -signal.SIGINT),
    ("sigterm", "wait", ("nvme", "nvme"), signal.SIGTERM, -signal.SIGTERM),
]


@pytest.fixture(scope="module")
def endings(tmp_path_factory):
    """Runs every case at once; returns name -> (returncode, stderr, files left, root)."""
    procs = {}
    for name, end, places, _, _ in CASES:
        root = tmp_path_factory.mktemp(name)
        procs[name] = (start_worker(root, end, *places), root)
    for name, _, _, sig, _ in CASES:
        if sig is not None:
            proc = procs[name][0]
            wait_for_step(proc, 2)  # signalled mid-training: IO and a background step in flight
            proc.send_signal(sig)
    out = {}
    for name, (proc, root) in procs.items():
        try:
            _, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        out[name] = (proc.returncode, err, swap_left(root), root)
    return out


@pytest.mark.parametrize("name, expected", [(c[0], c[4]) for c in CASES], ids=[c[0] for c in CASES])
def test_exit_status_and_no_swap_left(endings, name, expected):
    code, err, left, root = endings[name]
    assert "terminate called" not in err, err[-3000:]
    assert code == expected, f"exit status {code}, expected {expected}:\n{err[-3000:]}"
    assert left == [], f"swap space left behind: {left}"
    assert (root / "nvme_p").is_dir()  # the configured path itself stays


def test_uncaught_exception_prints_the_usual_traceback(endings):
    err = endings["raise"][1]
    assert "Traceback (most recent call last)" in err
    assert err.rstrip().endswith("RuntimeError: an error in the user's script")


def test_sigint_is_a_keyboard_interrupt(endings):
    assert "KeyboardInterrupt" in endings["sigint"][1]


@pytest.mark.slow
def test_thread_fallback_exits_cleanly_too(tmp_path):
    proc = start_worker(tmp_path, "return", env=dict(os.environ, OFFLOAD_NATIVE="0"))
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err[-3000:]
    assert swap_left(tmp_path) == []


# ---- the registry, in-process ----------------------------------------------------------------
def test_registry_tracks_until_close_and_sigterm_handler_only_while_open(tmp_path):
    before = signal.getsignal(signal.SIGTERM)  # ours only if an earlier test left one open
    assert before is signal.SIG_DFL or lifecycle.open_resources()
    aio = AsyncIO()
    store = NvmeStore(tmp_path, aio=aio)
    assert {id(r) for r in lifecycle.open_resources()} >= {id(aio), id(store)}
    assert signal.getsignal(signal.SIGTERM) is lifecycle._on_sigterm
    store.close()
    aio.close()
    assert not any(r is aio or r is store for r in lifecycle.open_resources())
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_user_sigterm_handler_is_left_alone(tmp_path):
    def mine(signum, frame):
        pass

    old = signal.signal(signal.SIGTERM, mine)
    try:
        with AsyncIO() as aio, NvmeStore(tmp_path, aio=aio):
            assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, old)


def test_at_exit_closes_what_is_open(tmp_path):
    aio = AsyncIO()
    store = NvmeStore(tmp_path, aio=aio)
    store.allocate("k", 8192)
    store.write("k", torch.ones(2048))  # in flight, never waited
    lifecycle._at_exit()
    assert not os.path.exists(store.directory)
    with pytest.raises(RuntimeError, match="closed"):
        aio.write(torch.ones(4), tmp_path / "x")
    assert not lifecycle.open_resources()


def test_a_forked_child_never_removes_its_parents_files(tmp_path):
    aio = AsyncIO()
    store = NvmeStore(tmp_path, aio=aio)
    store.allocate("k", 4096)
    store.write("k", torch.ones(1024)).wait()
    pid = os.fork()
    if pid == 0:  # the child: close, abandon, exit handlers; then leave without cleanup
        code = 0
        try:
            if lifecycle.open_resources():
                code = 2  # the registry should be empty here
            store.close()
            store.abandon()
            aio.close()
            lifecycle._at_exit()
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.path.isdir(store.directory) and os.listdir(store.directory)
    out = torch.empty(1024)
    store.read("k", out).wait()  # the parent's engine still works
    assert torch.equal(out, torch.ones(1024))
    store.close()
    aio.close()


FORKED_CHILD_USES_THE_MODEL = """
import os, sys, torch, torch.nn as nn
import offload
torch.set_num_threads(1)
class Block(nn.Module):
    def __init__(s): super().__init__(); s.fc = nn.Linear(64, 64)
    def forward(s, x): return x + s.fc(x)
model = nn.Sequential(*(Block() for _ in range(12)))
cfg = {{"device": "cpu", "dtype": "fp32", "wrap": {{"module_classes": ["Block"]}},
       "offload_param": {{"device": "nvme", "nvme_path": {root!r}, "buffer_count": 2,
                         "buffer_size": "64KiB", "persistence_threshold": 0}},
       "offload_optimizer": {{"device": "nvme", "nvme_path": {root!r}}}}}
model, opt = offload.wrap(model, cfg)
x = torch.randn(4, 64)
{before}
pid = os.fork()
if pid == 0:  # uses the model, fails, and exits through the interpreter's finalization
    {child}
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
model(x).sum().backward()  # the parent trains on
opt.step()
opt.close()
print("parent done", flush=True)
"""


@pytest.mark.parametrize("child", ["evaluates", "trains", "evaluates before any step"])
def test_a_forked_child_that_uses_a_model_on_nvme_fails_and_exits(tmp_path, child):
    """A child forked after wrap (a DataLoader worker calling a teacher model, a fork pool)
    that runs the model waited forever for a read the parent's IO threads were to do, and,
    once that raised, hung again at exit destroying the engine's condition variables (the
    parent's waiters counted in them). It is an error naming the fork now, the child exits,
    and the parent trains on."""
    use = {  # (the update the parent's step left running, or the IO engine's reads)
        "evaluates": "with torch.no_grad(): model(x)",
        "trains": "model(x).sum().backward(); opt.step()",
        "evaluates before any step": "with torch.no_grad(): model(x)",
    }[child]
    step = "model(x).sum().backward(); opt.step(); opt.zero_grad()"
    before = "with torch.no_grad(): model(x)" if child.endswith("any step") else step
    code = FORKED_CHILD_USES_THE_MODEL.format(root=str(tmp_path), before=before, child=use)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "child 1" in out.stdout and "parent done" in out.stdout, out.stdout
    assert "forked from the process that made its" in out.stderr, out.stderr[-3000:]


# ---- native code on a daemon thread when the interpreter finalizes ---------------------------
# A daemon thread blocks inside a native call (AioEngine.submit opening a FIFO for reading, GIL
# released) until the __del__ of a garbage cycle opens the FIFO for writing. Automatic
# collection is held off, so that __del__ runs in the interpreter's last collection, after
# CPython decided that daemon threads must exit. The native call then returns and takes the GIL
# back, which ends the thread with pthread_exit: deterministic, no timing involved.
DAEMON_RETURNS_DURING_FINALIZATION = """
import ctypes, gc, os, threading, time
from offload import _native
C = _native.get()
fifo = {fifo!r}
os.mkfifo(fifo)

def reader():
    engine = C.AioEngine(1 << 20, 4, 1, False)
    buf = bytearray(4096)
    addr = ctypes.addressof((ctypes.c_char * 4096).from_buffer(buf))
    engine.submit(False, fifo, addr, 4096, 0)  # blocks in open() until a writer comes

class OpensTheFifoAtFinalization:
    def __init__(self):
        self.os, self.time, self.fifo = os, time, fifo
    def __del__(self):
        fd = self.os.open(self.fifo, self.os.O_WRONLY)  # lets the reader's open() return
        self.time.sleep(0.5)  # the reader's native call returns meanwhile
        self.os.close(fd)

threading.Thread(target=reader, daemon=True).start()
time.sleep(0.3)  # the reader is blocked in submit()
gc.set_threshold(1 << 30)  # no automatic collection before the interpreter's last one
trigger = OpensTheFifoAtFinalization()
trigger.cycle = trigger
del trigger
print("main thread done", flush=True)
"""


def test_a_daemon_thread_leaving_a_native_call_at_exit_does_not_abort(tmp_path):
    """CPython ends a daemon thread that takes the GIL back during finalization with
    pthread_exit; the native binding must let that unwind through (csrc/gil.h) rather than
    abort with "terminate called without an active exception" (status 134)."""
    from offload import _native

    if not _native.available():
        pytest.skip("native extension not built")
    code = DAEMON_RETURNS_DURING_FINALIZATION.format(fifo=str(tmp_path / "fifo"))
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=str(tmp_path),  # sys.path[0] of "-c" is the cwd: never another checkout
        timeout=TIMEOUT,
    )
    assert "main thread done" in out.stdout, out.stderr[-2000:]
    assert "terminate called" not in out.stderr, out.stderr[-2000:]
    assert out.returncode == 0, out.stderr[-2000:]
