"""A child for ``tests/test_interrupts.py``: a Ctrl-C at each point where Python could deliver
one during a training step, one point per trial, and training goes on.

``python _ctrl_c_points.py ROOT FRAMES FIRST STRIDE [ACCUM [PHASE [AGAIN]]]``: params and
optimizer
state on NVMe under ROOT, the default config (the step in backward) with
``gradient_accumulation_steps`` ACCUM (and clipping when ACCUM > 1). Trial ``n`` (``FIRST``,
``FIRST + STRIDE``, ... until the phase has fewer points) wraps a fresh model, runs two steps,
then a third in which the main thread raises KeyboardInterrupt at its ``n``-th signal point,
catches it, calls ``zero_grad()``, runs one more step, waits for the update, and closes the
engine. With PHASE ``save``, ``load`` or ``export`` the Ctrl-C lands instead in a
``save_checkpoint``, a ``load_checkpoint`` of the checkpoint saved after the second step, or an
``export``; then a whole load of it must give its values back, the next step must run, and a
save or an export after it must leave no temporary file behind (an export: its values, the
model's). PHASE ``pretrained``: a ``save_pretrained`` over an earlier one, whose directory must
hold one save or the other whole. PHASE ``close`` and ``restore``: ``close()`` and
``close(restore=True)``, each called again after. With PHASE ``wrap`` or ``weights`` it lands in
``offload.wrap`` (:func:`wrap_trial`). The IO engine is the native one, or the thread
fallback under ``OFFLOAD_NATIVE=0``. With AGAIN > 0 a second Ctrl-C follows the first, at the
AGAIN-th function the unwinding starts (:class:`Injector`); AGAIN ``NxK`` (``1x3``): K more,
each at the N-th function start after the last (a key held down, or pressed in a burst). Any other
exception, a shard still pinned, a pool buffer without an owner, a file left in ROOT or a
wait longer than a minute (which exits with every thread's stack) fails the trial. Prints one JSON line: the trials, and the
failures with where their Ctrl-C landed.

The points are where CPython 3.11 runs a pending signal's handler on the main thread: right
after a call returns, at a backward jump, at a function's start; in the frames of ``FRAMES``:
``threading`` (threading.py only: where a Ctrl-C breaks the primitives,
``offload._interrupts``, Note: waits), ``all`` (offload's, threading's and contextlib's) or
``buffers`` (the stores' and the buffer pool's: where a pool buffer changes hands), and only while SIGINT's handler is the one that raises (not inside ``interrupts_deferred``).
A Ctrl-C landing elsewhere (torch's C++, a native call) is delivered at one of them.
"""

from __future__ import annotations

import _signal
import contextlib
import dis
import faulthandler
import json
import os
import shutil
import signal
import sys
import threading
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from engine_models import (  # noqa: E402
    batches,
    lm_loss,
    lost_buffers,
    make_model,
    nvme_recipe,
    pinned_shards,
    placement_config,
)
from safetensors.torch import load_file, save_file  # noqa: E402

import offload  # noqa: E402
from offload.api.wrap import engine_of  # noqa: E402

OFFLOAD = os.path.dirname(offload.__file__)
FRAMES = {
    "threading": (threading.__file__,),
    "all": (OFFLOAD, threading.__file__, contextlib.__file__),
    "buffers": tuple(os.path.join(OFFLOAD, p) for p in ("store", "io/buffer_pool.py")),
}
PHASES = ("step", "save", "load", "export", "pretrained", "close", "restore", "wrap", "weights")
"""What the Ctrl-C lands in: the third step; or, after a checkpoint of the second, a
``save_checkpoint``, a ``load_checkpoint`` of it or an ``export`` (fp32), a ``save_pretrained``
over the one saved after the first step (the directory must hold one save or the other, whole),
``close()`` (then closed again: no thread or file may be left), or ``close(restore=True)`` (then
again: the model must hold the values it had, with no thread or file left, and train as a plain
model); or ``offload.wrap`` of a live model, or of one on the meta device with ``weights=`` a
file (:func:`wrap_trial`)."""
CALLS = {dis.opmap["CALL"], dis.opmap["CALL_FUNCTION_EX"]}
JUMP_BACK = dis.opmap["JUMP_BACKWARD"]


_HANDLERS: dict = {}


def _handler(code, offset: int):
    """The exception handler covering ``offset`` in ``code`` (None: none). CPython raises a
    signal delivered after a call at the call's instruction; this injector can only raise at
    the next one, which where the call ends a ``with`` or ``try`` body (``return f(x)``
    inside ``with lock:``) lies outside the body's handler: raised there, the ``with``'s exit
    never runs (a lock left held), which no real Ctrl-C does. Those points are skipped."""
    table = _HANDLERS.get(code)
    if table is None:
        table = _HANDLERS[code] = dis._parse_exception_table(code)
    for entry in table:
        if entry.start <= offset < entry.end:
            return entry.target
    return None


class Injector:
    """Raises KeyboardInterrupt on the main thread at its ``target``-th signal point; with
    ``again`` (> 0), a second time at the ``again``-th start of a function of ``roots`` after
    it (a user pressing Ctrl-C twice in quick succession: the second lands in what the first
    one's unwinding runs; a function's start is one of the points where CPython delivers a
    signal), and again until ``repeats`` have followed the first, each ``again`` starts after
    the last (a key held down). CPython drops a trace function that raises, so the second is placed by a profile
    function, which sees calls only, and the later ones by the profile and trace functions in
    turn (:meth:`_later`)."""

    def __init__(
        self, roots: tuple[str, ...], target: int, again: tuple[int, int] = (0, 1)
    ) -> None:
        self.roots, self.target = roots, target
        self.again, self.repeats = again  # every ``again`` function starts, ``repeats`` times
        self.calls = 0  # function starts seen since the last Ctrl-C
        self.again_fired: str | None = None  # where the later ones fired, " then "-joined
        self.count = 0
        self.fired: str | None = None
        self.stack = ""  # where it fired
        self._last: dict[int, tuple] = {}  # frame id -> its last opcode and its offset

    def __enter__(self) -> Injector:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)
        sys.setprofile(None)

    def _profile(self, frame, event, arg):
        if event == "call":
            self._later(frame, lambda: sys.settrace(self._traced))

    def _traced(self, frame, event, arg):
        if event == "call":
            self._later(frame, lambda: sys.setprofile(self._profile))

    def _later(self, frame, arm_other) -> None:
        """The Ctrl-Cs after the first, at function starts. CPython drops a profile or trace
        function that raises, so each one arms the other kind for the next before it raises."""
        if not frame.f_code.co_filename.startswith(self.roots):
            return
        if _signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return  # held back (interrupts_deferred): delivered at the block's end, as it was
        self.calls += 1
        if self.calls == self.again:
            self.calls, self.repeats = 0, self.repeats - 1
            if self.repeats:
                arm_other()
            where = frame.f_code.co_filename.replace(OFFLOAD, "offload")
            here = f"{where}:{frame.f_lineno} in {frame.f_code.co_name}"
            self.again_fired = f"{self.again_fired} then {here}" if self.again_fired else here
            if os.environ.get("CTRL_C_POINTS_VERBOSE"):
                stack = "".join(traceback.format_stack(frame, limit=8))
                print(f"fired again: {here}\n{stack}", file=sys.stderr)
            raise KeyboardInterrupt

    def _call(self, frame, event, arg):
        if self.fired is None and frame.f_code.co_filename.startswith(self.roots):
            frame.f_trace_opcodes = True
            self._last.pop(id(frame), None)
            return self._opcode
        return None

    def _opcode(self, frame, event, arg):
        if event != "opcode" or self.fired is not None:
            return self._opcode
        code, at = frame.f_code, frame.f_lasti
        op = code.co_code[at]
        before, before_at = self._last.get(id(frame), (None, None))
        self._last[id(frame)] = op, at
        if before is None:  # the function's start (its RESUME, outside every handler)
            point = _handler(code, at) is None
        else:
            same = _handler(code, before_at) == _handler(code, at)
            point = (before in CALLS or before == JUMP_BACK) and same
        if point and _signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self.count += 1
            if self.count == self.target:
                where = frame.f_code.co_filename.replace(OFFLOAD, "offload")
                self.fired = f"{where}:{frame.f_lineno} in {frame.f_code.co_name}"
                self.stack = "".join(traceback.format_stack(frame, limit=12))
                if os.environ.get("CTRL_C_POINTS_VERBOSE"):
                    print(f"fired {self.target}: {self.fired}\n{self.stack}", file=sys.stderr)
                if self.again:
                    sys.setprofile(self._profile)
                raise KeyboardInterrupt
        return self._opcode


def trial(
    root: Path,
    roots: tuple[str, ...],
    n: int,
    accum: int,
    phase: str = "step",
    again: tuple[int, int] = (0, 1),
) -> dict:
    model, opt, one_step = nvme_recipe(root, accum)
    ckpt = root.with_name(f"{root.name}-ckpt")  # beside ROOT: the files-left check is ROOT's
    out: dict = {"n": n}
    try:
        one_step(0)
        hf = ckpt / "hf"
        if phase == "pretrained":  # a save for the stopped one to replace
            offload.save_pretrained(model, hf)
            first = {k: v.clone() for k, v in model.state_dict().items()}
        one_step(1)
        if phase != "step":  # a whole checkpoint, and the values it holds
            offload.save_checkpoint(ckpt, model, opt)
            saved = {k: v.clone() for k, v in model.state_dict().items()}
        injector = Injector(roots, n, again)
        try:
            with injector:
                if phase == "step":
                    one_step(2)
                elif phase == "save":
                    offload.save_checkpoint(ckpt, model, opt, keep_last=2)
                elif phase == "export":
                    offload.export(model, ckpt / "model.safetensors", dtype=torch.float32)
                elif phase == "pretrained":
                    offload.save_pretrained(model, hf)
                elif phase == "close":
                    opt.close()
                elif phase == "restore":
                    opt.close(restore=True)
                else:
                    offload.load_checkpoint(ckpt, model, opt)
        except KeyboardInterrupt:
            if phase not in ("close", "restore"):
                opt.zero_grad()
        out["at"], out["stack"] = injector.fired, injector.stack
        if injector.again_fired:
            out["again"] = injector.again_fired
        if phase == "close":  # a close after the stopped one finishes it: no thread, no file
            opt.close()
            alive = [t.name for t in threading.enumerate() if t.name.startswith("offload")]
            left = [str(p) for p in root.rglob("*") if p.is_file()]
            if alive or left:
                out["failed"] = f"after a second close: threads {alive}, files {left}"
            return out
        if phase == "restore":
            return _restored(out, root, model, opt, saved)
        if phase == "pretrained" and not any(_same(_files(hf), v) for v in (first, saved)):
            out["failed"] = "after a stopped save_pretrained, its directory holds neither save"
        if phase != "step":  # loaded whole (again), it holds what was saved
            offload.load_checkpoint(ckpt, model, opt)
            now = model.state_dict()
            differ = [k for k, v in saved.items() if not torch.equal(now[k], v)]
            if differ:
                out["failed"] = f"after a whole load, not the checkpoint's values: {differ}"
        one_step(3)
        opt.synchronize()
        pinned = pinned_shards(engine_of(model))
        if pinned:
            out["failed"] = f"pinned after the next step: {pinned}"
        lost = lost_buffers(engine_of(model))
        if lost:
            out["failed"] = f"buffers without an owner after the next step: {lost}"
        if phase == "save":  # a save after the stopped one publishes and leaves no temp
            offload.save_checkpoint(ckpt, model, opt)
        if phase == "export":  # a whole export after the stopped one holds the values
            offload.export(model, ckpt / "model.safetensors", dtype=torch.float32)
            now, exported = model.state_dict(), load_file(ckpt / "model.safetensors")
            differ = [k for k, v in now.items() if not torch.equal(exported[k], v)]
            if differ:
                out["failed"] = f"the export after a stopped one differs: {differ}"
        if phase == "pretrained":  # a whole save after the stopped one holds the values
            offload.save_pretrained(model, hf)
            if not _same(_files(hf), model.state_dict()):
                out["failed"] = "the save_pretrained after a stopped one differs"
        if phase in ("save", "export", "pretrained"):
            temp = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("."))
            if temp:
                out["failed"] = f"left in the checkpoint directory: {temp}"
    except BaseException as exc:  # noqa: BLE001 - anything but the interrupt fails the trial
        out["failed"] = "".join(traceback.format_exception(exc))[-2000:]
    finally:
        opt.close()
        shutil.rmtree(ckpt, ignore_errors=True)
    left = [str(p) for p in root.rglob("*") if p.is_file()]
    if left and "failed" not in out:
        out["failed"] = f"files left: {left}"
    return out


def _files(directory: Path) -> dict:
    """The tensors of a ``save_pretrained`` directory, every shard's."""
    out: dict = {}
    for f in directory.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def _same(saved: dict, values: dict) -> bool:
    """Whether a save holds ``values`` (a tied weight is saved once, under one name)."""
    return bool(saved) and all(k in values and torch.equal(v, values[k]) for k, v in saved.items())


def _hooked(model) -> list[str]:
    """The modules and parameters with a hook on them (offload's, when the model had none)."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_state_dict_hooks")
    kinds += ("_state_dict_pre_hooks", "_load_state_dict_pre_hooks")
    kinds += ("_load_state_dict_post_hooks",)
    out = [n or "<root>" for n, m in model.named_modules() if any(getattr(m, k) for k in kinds)]
    return out + [n for n, p in model.named_parameters() if p._post_accumulate_grad_hooks]


def _restored(out: dict, root: Path, model, opt, saved: dict) -> dict:
    """After a ``close(restore=True)`` stopped part way, another: the model holds the values it
    had (fp32, exactly), offload left no thread or file, and a plain step of torch's runs."""
    opt.close(restore=True)
    now = model.state_dict()
    differ = [k for k, v in saved.items() if not torch.equal(now[k], v)]
    alive = [t.name for t in threading.enumerate() if t.name.startswith("offload")]
    left = [str(p) for p in root.rglob("*") if p.is_file()]
    hooked = _hooked(model)
    if differ or alive or left or hooked:
        out["failed"] = (
            f"after a second close(restore=True): values changed {differ}, threads {alive}, "
            f"files {left}, hooks on {hooked}"
        )
        return out
    lm_loss(model, batches(1)[0]).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return out


def wrap_trial(
    root: Path,
    roots: tuple[str, ...],
    n: int,
    accum: int,
    phase: str,
    again: tuple[int, int] = (0, 1),
) -> dict:
    """PHASE ``wrap``: the Ctrl-C lands in ``offload.wrap``. Stopped there, the model must be
    as it was (its values, no hook of offload's, no swap file), and wrapping it again must
    train. PHASE ``weights``: the same for a model on the meta device wrapped with its values
    from a file (what ``from_pretrained`` does), which must stay on the meta device."""
    cfg = placement_config("nvme", "nvme", root)
    cfg["gradient_accumulation_steps"] = accum
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weights = None
    if phase == "weights":
        weights = root.with_name(f"{root.name}-weights.safetensors")
        save_file(before, weights)
        with torch.device("meta"):
            model = make_model()
    out: dict = {"n": n}
    opt = None
    try:
        injector = Injector(roots, n, again)
        try:
            with injector:
                model, opt = offload.wrap(model, cfg, weights=weights)
        except KeyboardInterrupt:
            pass
        out["at"], out["stack"] = injector.fired, injector.stack
        if injector.again_fired:
            out["again"] = injector.again_fired
        if opt is None:
            now = model.state_dict()
            if weights is None:
                differ = [k for k, v in before.items() if not torch.equal(now[k], v)]
            else:  # nothing was put on a device
                differ = [k for k, v in now.items() if not v.is_meta]
            hooked = _hooked(model)
            left = [str(p) for p in root.rglob("*") if p.is_file() or p.name.startswith("offload-")]
            if differ or hooked or left:
                out["failed"] = (
                    f"after a stopped wrap: values changed {differ}, hooks on {hooked}, "
                    f"files {left}"
                )
                return out
            model, opt = offload.wrap(model, cfg, weights=weights)
            now = model.state_dict()
            differ = [k for k, v in before.items() if not torch.equal(now[k], v)]
            if differ:
                out["failed"] = f"wrapped again after a stopped wrap, not its values: {differ}"
                return out
        data = batches(4)
        for m in range(accum):
            (lm_loss(model, data[m]) / accum).backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        pinned = pinned_shards(engine_of(model))
        if pinned:
            out["failed"] = f"pinned after a step: {pinned}"
    except BaseException as exc:  # noqa: BLE001 - anything but the interrupt fails the trial
        out["failed"] = "".join(traceback.format_exception(exc))[-2000:]
    finally:
        if opt is not None:
            opt.close()
        if weights is not None:
            weights.unlink()
    left = [str(p) for p in root.rglob("*") if p.is_file()]
    if left and "failed" not in out:
        out["failed"] = f"files left: {left}"
    return out


def main() -> None:
    root, frames = Path(sys.argv[1]), sys.argv[2]
    first, stride = int(sys.argv[3]), int(sys.argv[4])
    accum = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    phase = sys.argv[6] if len(sys.argv) > 6 else "step"
    every, _, repeats = (sys.argv[7] if len(sys.argv) > 7 else "0").partition("x")
    again = int(every), int(repeats or 1)
    if phase not in PHASES:
        raise SystemExit(f"PHASE: got {phase!r}; allowed: {', '.join(PHASES)}")
    trials, failures = 0, []
    n = first
    while True:
        faulthandler.dump_traceback_later(60, exit=True)  # a hang shows where it waits
        run = wrap_trial if phase in ("wrap", "weights") else trial
        result = run(root / f"t{n}", FRAMES[frames], n, accum, phase, again)
        faulthandler.cancel_dump_traceback_later()
        if os.environ.get("CTRL_C_POINTS_VERBOSE"):
            failed = f"\nFAILED: {result['failed']}" if "failed" in result else ""
            then = f" then {result['again']}" if "again" in result else ""
            print(f"trial {n}: {result.get('at')}{then}{failed}", file=sys.stderr, flush=True)
        if result.get("at") is None and "failed" not in result:
            break  # the step has fewer points than n
        trials += 1
        if "failed" in result:
            failures.append(result)
        n += stride
    print(json.dumps({"trials": trials, "failures": failures}))


if __name__ == "__main__":
    main()
