"""Ctrl-C held back over the lines that must not stop half way (offload/_interrupts.py)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from children import ROOT, default_sigint

from offload._interrupts import interrupts_deferred, wait


def _waiter(frame) -> str:
    """The first caller of ``frame`` outside ``threading`` and ``offload._interrupts``."""
    while frame.f_code.co_filename in (threading.__file__, _interrupts_file()):
        frame = frame.f_back
    return frame.f_code.co_name


def _interrupts_file() -> str:
    import offload._interrupts

    return offload._interrupts.__file__


def _child(script: str, *args, timeout: float, **env: str) -> dict:
    """Runs a child of this directory with SIGINT at its default (the Ctrl-C children), ``env``
    added to its environment: its last stdout line, a JSON result; a nonzero exit fails with
    its stderr's end."""
    worker = Path(__file__).resolve().parent / script
    proc = subprocess.run(
        [sys.executable, str(worker), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
        preexec_fn=default_sigint,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler at the next line


def test_signal_signal_runs_a_pending_ctrl_c_before_it_swaps_the_handler(python_ctrl_c):
    """Why a cleanup cannot hold back a second Ctrl-C already pending at its entry (so the step's
    blocks keep the first one out of it, and the wrap's is tried again: offload.api.wrap, Note: a
    wrap that stops): a deferral must call ``signal.signal``, and CPython runs the pending
    handler (the default, which raises) before it installs the new one. The interrupt is set
    from C and the swap follows from C (``map``), so no Python line runs in between."""
    import ctypes
    import functools
    import operator

    noted = []
    pending = functools.partial(ctypes.pythonapi.PyErr_SetInterruptEx, ctypes.c_int(2))
    swap = functools.partial(signal.signal, signal.SIGINT, lambda s, f: noted.append(s))
    with pytest.raises(KeyboardInterrupt):
        list(map(operator.call, [pending, swap]))
    assert noted == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_inside_the_block_comes_out_when_the_outermost_block_ends(python_ctrl_c):
    ran = []
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            _ctrl_c()
            ran.append("after the first")
            with interrupts_deferred():
                _ctrl_c()
                ran.append("inner")
            ran.append("after the inner block")
    assert ran == ["after the first", "inner", "after the inner block"]
    assert signal.getsignal(signal.SIGINT) is handler
    with interrupts_deferred():  # nothing noted is left over for the next block
        ran.append("next")
    assert ran[-1] == "next"


def test_the_handler_installed_before_gets_the_signal_once():
    got = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        with interrupts_deferred():
            _ctrl_c()
            _ctrl_c()
            assert got == []
        assert got == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_error_in_the_block_goes_up_with_no_signal_noted():
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(ValueError, match="inside"), interrupts_deferred():
        raise ValueError("inside")
    assert signal.getsignal(signal.SIGINT) is handler


def test_off_the_main_thread_and_with_an_ignored_signal_the_block_runs_as_it_is():
    seen = []

    def worker():
        with interrupts_deferred():
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [signal.getsignal(signal.SIGINT)]  # no handler installed from there
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupts_deferred():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            _ctrl_c()  # ignored, as before the block
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
@pytest.mark.parametrize("seed, accum", [(1, 1), (2, 1), (3, 1), (4, 2), (5, 2)])
def test_ctrl_c_anywhere_then_training_goes_on(tmp_path, seed, accum):
    """A notebook: Ctrl-C at a random moment of every other step (``_notebook_worker.py``),
    caught, ``zero_grad()``, and the loop goes on. Training must never hang or raise anything
    but the interrupt, end with no shard pinned and finite weights, and close with no swap file
    left. This stress found three bugs: the engine left in the backward for good, the units a
    failed backward took told to the next one's update, and gradient pins leaked by an
    interrupted absorb. ``pytest -m slow tests/test_interrupts.py``."""
    result = _child("_notebook_worker.py", tmp_path, seed, accum, timeout=300)
    assert result["caught"] >= 1, result  # the timers did interrupt
    assert result["pinned"] == [] and result["finite"], result
    left = [p for d in ("nvme_p", "nvme_o") for p in (tmp_path / d).iterdir()]
    assert left == [], left


@pytest.mark.parametrize("where", ["copied", "released"])
def test_a_ctrl_c_as_a_gathered_piece_changes_hands_leaves_it_held_once(
    tmp_path, monkeypatch, python_ctrl_c, where
):
    """A gather (``NvmeParams._stream_in``) copies each pinned piece to the device, moves it
    from the pieces fetching to the copies in flight, and releases it once its copy is done.
    A Ctrl-C right after the copy (``copied``: at the gather's next call, which came after the
    piece had left the first list) left the piece in neither, so the failed gather's cleanup
    did not release it: pinned for good (``_ctrl_c_points.py``, 2026-12-07: ``param.u0.0``
    after the next step). One as a copy's release returned (``released``), before the piece
    left the copies, had the cleanup release it a second time: a release without a fetch
    (another holder's pin, had there been one). The Ctrl-C is sent at exactly that point in
    the third step's forward; after ``zero_grad()`` and two more steps nothing
    may stay pinned, and no release may have found no pin."""
    from engine_models import nvme_recipe, pinned_shards

    from offload.api.wrap import engine_of
    from offload.device.copier import Transfers
    from offload.homes.params import NvmeParams
    from offload.store import Tier, TieredStore

    model, opt, one_step = nvme_recipe(tmp_path, 1)
    runtime = engine_of(model)
    fired, unmatched = [], []
    main = threading.main_thread()

    def from_gather() -> bool:
        callers = {sys._getframe(k).f_code.co_name for k in range(2, 5)}
        gather = {"_stream_in", "_give_back_oldest"}
        return threading.current_thread() is main and bool(callers & gather)

    try:
        one_step(0)
        one_step(1)
        if where == "copied":  # the Ctrl-C at the gather's first call after a copy
            real_copy, real_key, copied = Transfers.to_device, NvmeParams.key, []

            def to_device(self, pairs):
                event = real_copy(self, pairs)
                copied.append(from_gather())
                return event

            def key(unit, lo):
                name = real_key(unit, lo)
                if not fired and copied and copied[-1] and from_gather():
                    fired.append(name)
                    _ctrl_c()  # delivered as the call returns
                return name

            monkeypatch.setattr(Transfers, "to_device", to_device)
            monkeypatch.setattr(NvmeParams, "key", staticmethod(key))
        real_release = TieredStore.release

        def release(self, key, tier=Tier.HOST, **kw):
            try:
                real_release(self, key, tier, **kw)
            except RuntimeError as e:
                unmatched.append(str(e))
                raise
            if where == "released" and not fired and key.startswith("param.") and from_gather():
                fired.append(key)
                _ctrl_c()  # delivered as the release returns

        monkeypatch.setattr(TieredStore, "release", release)
        with pytest.raises(KeyboardInterrupt):
            one_step(2)
        assert fired
        opt.zero_grad()
        one_step(3)
        one_step(4)
        opt.synchronize()
        assert unmatched == []
        assert pinned_shards(runtime) == []
    finally:
        monkeypatch.undo()
        opt.close()


@pytest.mark.parametrize("where", ["release", "lock", "borrow", "taken", "borrow-taken"])
def test_a_ctrl_c_right_after_a_gradient_is_summed_leaves_no_pin(
    tmp_path, monkeypatch, python_ctrl_c, where
):
    """The step in backward sums a unit's gradient piece into its pinned buffer, then hands the
    buffer to the update or releases it. A Ctrl-C landing in between (at the release's first
    line, or as the backward takes the hand-over's lock) left the piece neither handed over
    nor released: pinned for good (``_notebook_worker.py``, one run in many: ``grad.u3.0``).
    The same at the release that ends ``TieredStore.borrow`` (the gradients summed on NVMe,
    outside a hand-over: ``borrow``, in the first step, which counts the backwards). And
    as the piece's ``TieredStore.take`` returned, in either (``taken``, ``borrow-taken``;
    ``_ctrl_c_points.py``, 2026-12-07): the pinned copy it returned was lost with its pin.
    The Ctrl-C is sent at exactly that point here; after ``zero_grad()`` and two more steps
    nothing may stay pinned."""
    from engine_models import batches, lm_loss, make_model, pinned_shards, placement_config

    import offload
    from offload.api.wrap import engine_of
    from offload.homes.grads import HeldNvmeGrads
    from offload.store import Tier, TieredStore

    cfg = placement_config("nvme", "nvme", tmp_path)
    if where == "release":  # a pool that holds no grad piece for the update: each is released
        cfg["offload_optimizer"]["buffer_count"] = 7
    model, opt = offload.wrap(make_model(), cfg)
    runtime = engine_of(model)
    data = batches(4)

    def one_step(s: int) -> None:
        lm_loss(model, data[s % len(data)]).backward()
        opt.step()
        opt.zero_grad()

    fired = []
    main = threading.main_thread()
    try:
        owner = runtime.grads.owner
        assert isinstance(owner, HeldNvmeGrads)
        if not where.startswith("borrow"):
            one_step(0)  # counts the backwards
            one_step(1)  # the step in backward from now on
        if where in ("taken", "borrow-taken"):
            real_take = TieredStore.take

            def take(self, key, tier=Tier.HOST, **kw):
                buf = real_take(self, key, tier, **kw)
                if not fired and key.startswith("grad.") and threading.current_thread() is main:
                    fired.append(key)
                    _ctrl_c()  # delivered as take returns
                return buf

            monkeypatch.setattr(TieredStore, "take", take)
        elif where in ("release", "borrow"):
            real_release = TieredStore.release

            def release(self, key, tier=Tier.HOST, **kw):
                if not fired and key.startswith("grad.") and kw.get("dirty"):
                    if threading.current_thread() is main:
                        fired.append(key)
                        _ctrl_c()  # raised here, before the real release runs
                return real_release(self, key, tier, **kw)

            monkeypatch.setattr(TieredStore, "release", release)
        else:
            real_lock = owner._lock

            class Lock:  # the hand-over's lock; a Ctrl-C as the backward takes it for a piece
                def __enter__(self):
                    caller = sys._getframe(1)
                    if not fired and caller.f_code.co_name == "absorb":
                        if "buf" in caller.f_locals:  # not absorb's wait, before any pin
                            fired.append("lock")
                            _ctrl_c()
                    return real_lock.__enter__()

                def __exit__(self, *exc):
                    return real_lock.__exit__(*exc)

                def __getattr__(self, name):
                    return getattr(real_lock, name)

            monkeypatch.setattr(owner, "_lock", Lock())
        with pytest.raises(KeyboardInterrupt):
            one_step(2)
        assert fired
        opt.zero_grad()
        monkeypatch.undo()
        one_step(3)
        one_step(4)
        opt.synchronize()
        assert pinned_shards(runtime) == []
    finally:
        opt.close()


def test_a_ctrl_c_in_a_completion_callback_is_not_the_request_s_error(python_ctrl_c):
    """A Ctrl-C landing in an IO completion's callback on the main thread was caught as the
    request's error: the callbacks after it never ran, and every later wait raised the
    KeyboardInterrupt again, on the update's thread too, whose pins then leaked. It comes out
    of that wait once the callbacks have run, and the request succeeded."""
    from offload.io.async_io import IOHandle

    ran = []
    handle = IOHandle(None, None, "/nowhere", "a test request")
    handle.add_done_callback(lambda: (_ctrl_c(), ran.append(1)))
    handle.add_done_callback(lambda: ran.append(2))
    with pytest.raises(KeyboardInterrupt):
        handle.wait()
    assert ran == [1, 2]
    handle.wait()  # done, without error, for every later waiter


def test_a_ctrl_c_as_a_completion_s_bookkeeping_begins_loses_none_of_it(python_ctrl_c, monkeypatch):
    """A Ctrl-C landing after the handle was marked finished but before its callbacks ran
    (as the deferred block that runs them was entered) lost them: the NVMe store's record of
    a written range among them, so the next read of that range raised "never completely
    written" (found by ``_ctrl_c_points.py``: a speculative update's shadow extent). The
    handle stays unfinished until its bookkeeping has begun, and the next wait finishes it."""
    import offload.io.async_io as async_io

    real = async_io.interrupts_deferred
    sent = []

    def ctrl_c_first():
        if not sent:
            sent.append(1)
            _ctrl_c()  # raised as this call returns: before the block is entered
        return real()

    monkeypatch.setattr(async_io, "interrupts_deferred", ctrl_c_first)
    ran = []
    handle = async_io.IOHandle(None, None, "/nowhere", "a test request")
    handle.add_done_callback(lambda: ran.append(1))
    with pytest.raises(KeyboardInterrupt):
        handle.wait()
    handle.wait()
    assert sent and ran == [1]


@pytest.mark.parametrize("kind", ["event", "condition"])
def test_a_ctrl_c_during_a_wait_leaves_the_primitive_whole(python_ctrl_c, kind):
    """Real SIGINTs into a loop of zero-length waits, which spends its time inside the
    primitive's Python code (``threading.py``). With ``Event.wait`` itself, 3000 of them left
    the event's lock held for good 277 times and raised ``RuntimeError: release unlocked lock``
    413 times (offload._interrupts, Note: waits; the demo's hang after Ctrl-C). Through
    ``wait``: only KeyboardInterrupt, and the lock free after each."""

    rng = random.Random(0)
    outcomes = []
    for _ in range(100):
        event = threading.Event()
        cond = threading.Condition(threading.Lock())
        lock = event._cond._lock if kind == "event" else cond._lock
        go = threading.Event()
        delay = rng.uniform(0.0002, 0.002)

        def ctrl_c_soon(go=go, delay=delay):
            go.wait()
            time.sleep(delay)
            _ctrl_c()

        sender = threading.Thread(target=ctrl_c_soon)
        sender.start()
        try:
            go.set()
            while True:
                if kind == "event":
                    wait(event, 0)
                else:  # (entered through its C lock, as offload's are: Condition.__enter__
                    with lock:  # is Python, and a Ctrl-C there leaves the lock held too)
                        wait(cond, 0)
        except KeyboardInterrupt:
            outcomes.append("KeyboardInterrupt")
        except RuntimeError as exc:
            outcomes.append(f"RuntimeError: {exc}")
        finally:
            while sender.is_alive():
                with contextlib.suppress(KeyboardInterrupt):
                    sender.join()
        if lock.locked():
            outcomes.append("lock left held")
    assert set(outcomes) == {"KeyboardInterrupt"}, collections.Counter(outcomes)


def test_a_ctrl_c_while_the_forward_waits_for_the_update_leaves_the_engine_closable(
    tmp_path, monkeypatch, python_ctrl_c
):
    """The demo's hang after Ctrl-C (CI, 2026-12-06): its forward waited for a unit's update
    on the update's ``threading.Event``; the Ctrl-C landed in ``Condition.__enter__`` right
    after it took the event's lock, so the lock stayed held, the update's thread blocked
    setting the event, and closing the engine joined that thread forever. The Ctrl-C is sent
    at exactly that point here (a real SIGINT: Python delivers it as the call that sends it
    returns, inside ``__enter__``); the step must raise KeyboardInterrupt and the engine close
    within seconds, leaving no swap file."""
    from engine_models import batches, lm_loss, make_model, placement_config

    import offload
    import offload.runtime.schedule as schedule
    from offload.homes.optim import NvmeOptim

    main = threading.main_thread()
    fired = []

    class CtrlCAfterTakingTheLock(threading.Condition):
        def __enter__(self):
            took = super().__enter__()
            if not fired and threading.current_thread() is main:
                fired.append(_waiter(sys._getframe(1)))
                _ctrl_c()
            return took

    class UpdateEvent(threading.Event):
        def __init__(self):
            super().__init__()
            self._cond = CtrlCAfterTakingTheLock(threading.Lock())

    real_step_units = NvmeOptim.step_units

    def slow_step_units(self, *args, **kw):  # the next forward waits for unit 0's update
        time.sleep(0.3)
        return real_step_units(self, *args, **kw)

    # the update after optimizer.step() runs into the next forward (the first step of the
    # default schedule, every step of this one)
    cfg = placement_config("nvme", "nvme", tmp_path)
    cfg["offload_optimizer"]["step_in_backward"] = False
    model, opt = offload.wrap(make_model(), cfg)
    data = batches(2)
    # the update's events, and no other (Thread.start waits on one of its own)
    names = {k: getattr(threading, k) for k in dir(threading) if not k.startswith("__")}
    with_fake_events = types.SimpleNamespace(**{**names, "Event": UpdateEvent})
    closed = threading.Event()
    try:
        for tokens in data:
            lm_loss(model, tokens).backward()
            opt.step()
            opt.zero_grad()
        monkeypatch.setattr(NvmeOptim, "step_units", slow_step_units)
        monkeypatch.setattr(schedule, "threading", with_fake_events)
        lm_loss(model, data[0]).backward()
        opt.step()  # its update starts, slowly
        with pytest.raises(KeyboardInterrupt):
            lm_loss(model, data[1]).backward()
        assert fired == ["wait_unit"]
    finally:
        closer = threading.Thread(target=lambda: (opt.close(), closed.set()), daemon=True)
        closer.start()
        closer.join(timeout=30)
    assert closed.is_set(), "the engine did not close within 30 s of the Ctrl-C"
    left = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert left == [], left


@pytest.mark.parametrize(
    "frames, first, stride, phase, native, again",
    [  # (heavy: CI runs it; slow: by hand, `pytest -m slow -k signal_point`)
        pytest.param(
            "threading",
            1,
            1,
            "step",
            "1",
            0,
            marks=pytest.mark.heavy,
            id="every-point-in-threading",
        ),
        pytest.param(
            "all", 1, 97, "step", "1", 0, marks=pytest.mark.slow, id="offload-and-threading-sampled"
        ),
        pytest.param(
            "threading", 1, 1, "save", "1", 0, marks=pytest.mark.heavy, id="save-threading"
        ),
        pytest.param(
            "threading", 1, 1, "load", "1", 0, marks=pytest.mark.heavy, id="load-threading"
        ),
        pytest.param("all", 1, 97, "wrap", "1", 0, marks=pytest.mark.heavy, id="wrap-sampled"),
        pytest.param("all", 1, 7, "close", "1", 0, marks=pytest.mark.heavy, id="close-sampled"),
        pytest.param(
            "all", 1, 37, "restore", "1", 0, marks=pytest.mark.heavy, id="restore-sampled"
        ),
        pytest.param(
            "all", 1, 47, "pretrained", "1", 0, marks=pytest.mark.heavy, id="pretrained-sampled"
        ),
        pytest.param(
            "all", 1, 211, "weights", "1", 0, marks=pytest.mark.heavy, id="weights-sampled"
        ),
        pytest.param(  # the IO engine without the native extension
            "threading", 1, 5, "step", "0", 0, marks=pytest.mark.heavy, id="fallback-engine-sampled"
        ),
        pytest.param(  # a second Ctrl-C as the first one unwinds (a user pressing it twice)
            "all", 5, 131, "step", "1", 1, marks=pytest.mark.heavy, id="twice-sampled"
        ),
        pytest.param(  # three more as it unwinds (a key held down)
            "all", 2, 97, "wrap", "1", "1x3", marks=pytest.mark.heavy, id="wrap-burst"
        ),
    ],
)
def test_a_ctrl_c_at_each_signal_point_of_a_step_then_training_goes_on(
    tmp_path, frames, first, stride, phase, native, again
):
    """``_ctrl_c_points.py``: one trial per point where Python can deliver a Ctrl-C on the
    main thread during a step (in ``threading``'s frames: where a Ctrl-C broke the
    primitives, offload._interrupts' Note on waits; or in offload's too, sampled), each caught,
    then ``zero_grad()``, one more step and ``close()``: no other error, nothing pinned, no
    pool buffer without an owner, no file left, no wait of a minute. This found the demo's hang after Ctrl-C and the windows
    where a Ctrl-C split one change of the store's in two (offload/store/store.py, Note:
    Ctrl-C and IO in flight). The same in a ``save_checkpoint``, a ``load_checkpoint`` (found
    the verification's executor hanging on a lock of its own, 2026-12-07), ``wrap`` (found the
    model's values lost) and ``close()`` (found its swap files left for good), each followed by
    their checks (the script's PHASE); in ``close(restore=True)``, ``save_pretrained``, a
    ``wrap`` with ``weights=`` (found a stopped wrap's close raising AttributeError) and a step
    with the thread IO engine; and a second Ctrl-C as the first one unwinds (AGAIN: found a
    gather's and the gradients' pieces pinned for good, the engine left in its step, and a
    stopped wrap's cleanup skipped, the model's values lost), or three more (a key held)."""
    result = _child(
        "_ctrl_c_points.py",
        tmp_path,
        frames,
        first,
        stride,
        1,
        phase,
        timeout=900,
        OFFLOAD_NATIVE=native,
    )
    assert result["trials"] >= 40, result  # the points were reached
    assert result["failures"] == [], json.dumps(result["failures"], indent=1)[-6000:]


def test_a_ctrl_c_as_the_store_lets_its_lock_go_for_a_wait_leaves_it_held_after(python_ctrl_c):
    """A store waiting for a transfer lets its (reentrant) lock go, every level of it, and
    takes it back after. A Ctrl-C delivered as the letting go returned (before the ``try``
    whose ``finally`` takes it back) left the lock released under callers holding it: their
    ``with`` then released a lock they no longer held (``RuntimeError``), or another thread's
    hold. The three lines are one block for a Ctrl-C now: it comes out once the lock is held
    again, at the level it had."""
    from types import SimpleNamespace

    from offload.store.prefetch import TracePrefetcher
    from offload.store.reclaim import Reclaimer
    from offload.store.shard import Transfer
    from offload.store.state import Tier
    from offload.store.stats import StoreCounters

    real = threading.RLock()

    class CtrlCAsItLetsGo:  # the store's RLock, a Ctrl-C sent as _release_save returns
        def _release_save(self):
            saved = real._release_save()
            _ctrl_c()
            return saved

        def _acquire_restore(self, saved):
            real._acquire_restore(saved)

        def _is_owned(self):
            return real._is_owned()

    pool = SimpleNamespace(buffer_count=1, buffer_size=4096)
    lock = CtrlCAsItLetsGo()
    reclaimer = Reclaimer("store", pool, TracePrefetcher(2), StoreCounters(), lock, None)
    done = SimpleNamespace(wait=lambda: None, done=lambda: True)
    with real, real:  # two levels, as a fetch inside a release's callback holds it
        with pytest.raises(KeyboardInterrupt):
            reclaimer.block_on(Transfer(Tier.NVME, Tier.HOST, 4096, done))
        assert real._is_owned()
    assert not real._is_owned() and real.acquire(blocking=False)
    real.release()


def test_a_ctrl_c_inside_a_transfer_s_completion_loses_no_buffer(tmp_path, python_ctrl_c):
    """Completing a transfer moves its shard's state after dropping the transfer. A Ctrl-C
    between the two (in the state move's logging call) left the shard in flight with no
    transfer: its buffer never came back, and in training a pool a buffer short deadlocked
    the next step's update against the backward (``_ctrl_c_points.py``, after ~12000
    trials). The completion is one block for a Ctrl-C now: every buffer comes back."""
    import torch
    from test_store import make_store

    from offload.store import Tier
    from offload.store.shard import Shard

    real_move = Shard._move
    sent = []

    def move(self, accepted, new, what):
        if what == "written_back" and not sent:
            sent.append(self.key)
            _ctrl_c()  # delivered as this call returns, inside the completion
        return real_move(self, accepted, new, what)

    with make_store(tmp_path, buffers=1) as store:  # (asserts every buffer came back)
        for key in ("a", "b"):
            store.register(key, 1000, torch.float32, Tier.NVME, init=torch.ones(1000))
        store.fetch("a", Tier.HOST).wait().add_(1.0)
        pinned = []
        Shard._move = move
        try:
            with pytest.raises(KeyboardInterrupt):
                # a's write-back completes here, or in the fetch of b (the only buffer: a's)
                store.release("a", Tier.HOST, dirty=True)
                pinned.append("b")
                store.fetch("b", Tier.HOST).wait()
        finally:
            Shard._move = real_move
        for key in pinned:  # (a fetch pins before its wait raises)
            store.release(key, Tier.HOST, discard=True)
        assert sent == ["a"]
        got = store.fetch("b", Tier.HOST).wait()  # a's buffer, free again
        assert torch.equal(got, torch.ones(1000))
        store.release("b", Tier.HOST)
        assert torch.equal(store.fetch("a", Tier.HOST).wait(), torch.full((1000,), 2.0))
        store.release("a", Tier.HOST)


def test_a_condition_s_wait_that_times_out_as_the_notify_comes_returns_to_its_caller():
    """A notify that comes as a slice of ``wait`` times out is spent on the waiter that is
    giving up (``Condition.wait`` returns False). Waiting slice after slice inside ``wait``
    then waited for another notify that never came, with the caller's predicate true: the
    update waited for a unit already in its feed, the backward for the update, in plain
    training (the Note: waits). ``wait`` returns to its caller after the slice now, which
    looks at its predicate again."""
    items = []

    class NotifiedAsItTimedOut(threading.Condition):
        def wait(self, timeout=None):
            if not items:
                items.append("unit")  # put, and notified, as this slice timed out
                return False
            return super().wait(timeout)

    cond = NotifiedAsItTimedOut(threading.Lock())
    took = threading.Event()

    def waiter():
        with cond:
            while not items:
                wait(cond)
        took.set()

    threading.Thread(target=waiter, daemon=True).start()
    assert took.wait(5.0), "the waiter waited on with its predicate true"


@pytest.mark.heavy
def test_training_in_contended_processes_never_deadlocks(tmp_path):
    """Four processes at once, each training the NVMe model 40 wraps of 4 steps
    (``_contended_steps.py``; heavy, 2-5 min here). With the wait that lost a notify as its
    slice timed out (the test above), 3 of 4 such processes deadlocked within 17-27 wraps
    here (the update waiting for a unit in its feed, the backward for the update), and this
    test failed after 131 s; with the fix it passed in 301 s (two Ctrl-C sweeps beside it)."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve().parent / "_contended_steps.py")]
            + [str(tmp_path / f"p{i}"), "40", str(1 + i % 2)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        for i in range(4)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=1500)
        assert proc.returncode == 0, err[-6000:]
        assert json.loads(out.strip().splitlines()[-1]) == {"wraps": 40}


@pytest.mark.parametrize("full", [False, True], ids=["free-buffer", "after-a-wait"])
def test_a_ctrl_c_as_the_pool_hands_out_a_buffer_loses_none(tmp_path, python_ctrl_c, full):
    """A fetch took a pool buffer, then gave it to its shard: a Ctrl-C delivered as the pool's
    call returned (CPython runs a pending handler there) left the buffer out of the pool with
    no owner, one buffer fewer for good (``_ctrl_c_points.py``'s ``buffers`` frames; a pool a
    buffer short deadlocked a step, as a lost completion's did). Taking and placing are one
    block for a Ctrl-C now, and a wait for room holds nothing: every buffer comes back. Also
    after waiting for a buffer another fetch held (``after-a-wait``)."""
    import threading

    import torch
    from test_store import make_store

    from offload.store import Tier

    with make_store(tmp_path, buffers=1, timeout=5.0) as store:  # (asserts every buffer back)
        for key in ("a", "b"):
            store.register(key, 1000, torch.float32, Tier.NVME, init=torch.ones(1000))
        pool = store._room.budget.pool
        sent = []

        class CtrlCAsItReturns:
            def __getattr__(self, name):
                got = getattr(pool, name)
                if name not in ("acquire", "try_acquire"):
                    return got

                def handed_out(*args, **kwargs):
                    buf = got(*args, **kwargs)
                    if buf is not None and not sent:
                        sent.append(name)
                        _ctrl_c()  # delivered as this call returns
                    return buf

                return handed_out

        if full:  # b holds the only buffer, released from another thread in a while
            store.take("b")
            threading.Timer(0.2, store.release, ("b", Tier.HOST)).start()
        store._room.budget.pool = CtrlCAsItReturns()
        try:
            with pytest.raises(KeyboardInterrupt):
                store.take("a")
        finally:
            store._room.budget.pool = pool
        assert sent
        assert torch.equal(store.take("a"), torch.ones(1000))  # the buffer, found again
        store.release("a", Tier.HOST)


def test_a_ctrl_c_as_a_gathered_unit_is_marked_leaves_no_false_write(
    tmp_path, monkeypatch, python_ctrl_c
):
    """A Ctrl-C after a unit's pieces were gathered (their pages lent to it) but before it was
    marked gathered left the unit marked released with its pages lent: the next forward's
    watch refused it as parameters written in place after wrap (``_ctrl_c_points.py``'s
    sampled sweep, in CI). The mark is inside the gather's ``try`` now: training goes on."""
    from engine_models import batches, lm_loss, make_model, placement_config

    import offload
    from offload.homes import params

    model, opt = offload.wrap(make_model(), placement_config("nvme", "nvme", tmp_path))
    data = batches(2)
    real_add = params._Gathered.add
    sent = []

    def add(self, index):
        if not sent and threading.current_thread() is threading.main_thread():
            sent.append(index)
            _ctrl_c()  # delivered as this call returns: before the unit is marked
        real_add(self, index)

    try:
        lm_loss(model, data[0]).backward()
        opt.step()
        opt.zero_grad()
        monkeypatch.setattr(params._Gathered, "add", add)
        with pytest.raises(KeyboardInterrupt):
            lm_loss(model, data[1]).backward()
        monkeypatch.undo()
        assert sent
        opt.zero_grad()
        for tokens in data:
            lm_loss(model, tokens).backward()
            opt.step()
            opt.zero_grad()
    finally:
        opt.close()


def test_map_in_threads_keeps_the_jobs_order_and_raises_a_job_s_error():
    from offload._interrupts import map_in_threads

    assert map_in_threads(lambda j, stop: j * j, list(range(20)), 3, "t") == [
        j * j for j in range(20)
    ]
    assert map_in_threads(lambda j, stop: j, [], 4, "t") == []
    assert map_in_threads(lambda j, stop: j, [7], 8, "t") == [7]

    def fails(j, stop):
        if j == 3:
            raise ValueError("job 3")
        return j

    with pytest.raises(ValueError, match="job 3"):
        map_in_threads(fails, list(range(10)), 2, "t")


def test_a_ctrl_c_in_map_in_threads_stops_its_jobs_within_a_piece(python_ctrl_c):
    """A Ctrl-C while the jobs run comes out within a piece of each job, every thread ended
    (``ThreadPoolExecutor``'s exit ran every queued job first: a Ctrl-C while a checkpoint
    was verified waited for the whole verification)."""
    from offload._interrupts import map_in_threads

    pieces = collections.Counter()

    def job(j, stop):
        for _ in range(2000):  # 10 s a job, in 5 ms pieces, unless stopped
            if stop.is_set():
                return None
            pieces[j] += 1
            time.sleep(0.005)
        return j

    timer = threading.Timer(0.3, _ctrl_c)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        map_in_threads(job, list(range(8)), 2, "offload-test-map")
    assert time.monotonic() - t0 < 2.0
    assert not [t for t in threading.enumerate() if t.name.startswith("offload-test-map")]
    assert set(pieces) == {0, 1}  # the queued jobs never started


@pytest.mark.parametrize("where", ["update", "store"])
def test_a_close_stopped_part_way_is_finished_by_the_next(tmp_path, monkeypatch, where):
    """A Ctrl-C in ``close()`` (as it waits for the last update, ``update``; or for a swap
    store's writes, ``store``) left the swap files and the IO threads for the process's life
    (a notebook's session): the engine was marked closed first, so a second ``close()`` did
    nothing (``_ctrl_c_points.py``, PHASE close: 379 of 387 trials). The next close now runs
    the steps left."""
    from engine_models import nvme_recipe

    from offload.api.wrap import engine_of
    from offload.io.nvme_store import NvmeStore

    model, opt, one_step = nvme_recipe(tmp_path, 1)
    one_step(0)
    one_step(1)
    runtime, stopped = engine_of(model), []
    real = runtime.flush_pending if where == "update" else NvmeStore._drain

    def stop(*args):
        if not stopped:
            stopped.append(where)
            raise KeyboardInterrupt
        return real(*args)

    if where == "update":
        monkeypatch.setattr(runtime, "flush_pending", stop)
    else:
        monkeypatch.setattr(NvmeStore, "_drain", stop)
    with pytest.raises(KeyboardInterrupt):
        opt.close()
    opt.close()
    assert stopped
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    assert [t.name for t in threading.enumerate() if t.name.startswith("offload")] == []


@pytest.mark.parametrize("param_dev,opt_dev", [("cpu", "cpu"), ("nvme", "nvme")])
def test_a_ctrl_c_as_the_step_moves_a_version_counter_then_training_goes_on(
    tmp_path, python_ctrl_c, monkeypatch, param_dev, opt_dev
):
    """``step()`` moves each stepped parameter's version counter and the version offload noted
    for it (offload/runtime/units.py, ``UnitRun.stepped``). A Ctrl-C between the two (found
    by the sampled sweep above, 2026-12-08) left a counter moved and not noted: the next
    forward refused it as a write of the user's ("written in place after offload.wrap").
    The moves are one block for a Ctrl-C: it comes out after them, and training goes on."""
    import torch
    from engine_models import batches, lm_loss, make_model, placement_config

    import offload

    real = torch.autograd.graph.increment_version
    sent = []

    def ctrl_c_after_the_first(tensor):
        real(tensor)
        if not sent:
            sent.append(True)
            _ctrl_c()  # delivered at the next line: the version's note

    model, opt = offload.wrap(make_model(), placement_config(param_dev, opt_dev, tmp_path))
    data = batches(3)
    try:
        lm_loss(model, data[0]).backward()
        monkeypatch.setattr(torch.autograd.graph, "increment_version", ctrl_c_after_the_first)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        monkeypatch.setattr(torch.autograd.graph, "increment_version", real)
        assert sent
        opt.zero_grad()
        for tokens in data[1:]:
            lm_loss(model, tokens).backward()
            opt.step()
            opt.zero_grad()
    finally:
        opt.close()
