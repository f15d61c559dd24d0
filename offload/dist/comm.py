"""Collectives between the ranks of one process group, asynchronous and counted.

Note: one object per wrapped model
    ``wrap`` makes one :class:`Comm` for the model's process group: :class:`LocalComm` with one
    rank (every operation is a local copy or nothing; offload then runs exactly as without a
    group), :class:`TorchComm` over ``torch.distributed`` otherwise (gloo on the CPU, NCCL on
    CUDA; no transport of our own). Every operation is issued asynchronously
    (``async_op=True``) and returns a :class:`Handle`; waiting on the handle is the only way to
    use the result, so a caller issues the next unit's collective, computes, and waits later.

    Every rank must issue the same collectives in the same order. The runtime guarantees it by
    issuing them only at points every rank reaches in the same order (a unit's gather, its
    backward's end, the step) and by deciding every look-ahead from what all ranks saw, never
    from timing.

Note: what is counted
    Per operation kind: ``bytes``, ``calls`` and ``wait_seconds`` (the time a caller blocked in
    :meth:`Handle.wait`). The bytes are the tensor volume the textbook counts (the ZeRO paper's
    Psi): an all-gather counts the gathered tensor, a reduce-scatter the tensor it reduces, an
    all-reduce twice its tensor (a reduce-scatter and an all-gather), a broadcast its tensor.
    A ring algorithm sends and receives (N - 1) / N of that on each rank. Objects (small
    metadata at wrap and for checkpoints) are not counted.

Note: NCCL, gloo and where tensors are (the device interface)
    NCCL reduces device tensors only, gloo is used with host tensors. A tensor not on the
    backend's device is staged: copied there before the collective is issued and the result
    copied back when the handle is waited (``Handle`` runs the copy-back). So a host home can
    all-gather through NCCL and a device tensor through gloo; callers pass tensors where they
    live. With NCCL, ``Work.wait`` orders the caller's current CUDA stream after the collective
    and does not block the host; a staged copy-back then runs on that stream too.

Note: failures and timeouts
    A collective whose peers stopped (a rank raised and exited: gloo reports the closed
    connection at once) or that does not complete within ``distributed.timeout`` seconds raises
    :class:`CollectiveError`, naming the operation, what it was for, this rank and the timeout.
    Nothing in offload waits on another rank without a timeout.

    The error also names the rank that failed, when it can be known (:class:`Peers`): which
    peer closed a connection is not in the backend's error (gloo gives an address and port),
    so the ranks say it through the default group's key-value store, which every rank reaches
    (under torchrun its agent's, which outlives every rank, one key space per restart; with a
    plain ``env://`` rendezvous rank 0's process hosts it, so rank 0's own failure is read
    only while that process still runs). At wrap each rank records who it is (pid, host:
    ``offload.io._owner``'s owner record); a process that ends on an uncaught exception
    records that exception as it exits (an ``atexit`` handler reading ``sys.last_value``,
    which Python sets before the handlers run). A failure then names each peer that raised,
    with its exception, and each peer on this host whose process is gone with nothing said
    (killed: SIGKILL, the out-of-memory killer; or aborted: SIGABRT, which gloo raises in a
    rank whose collective does not match the others', a call made on some ranks only; a
    process that is not our child does not tell which). A CollectiveError itself is not recorded: it
    is the consequence, not the cause. A closed connection waits up to ``SAY_WAIT`` seconds for
    a peer to say it (a script's ``finally: destroy_process_group()`` closes the connections
    before the exception reaches the exit), a timeout not at all (the peers had the whole
    timeout); a store that cannot be read leaves the message as it was.

Note: the end of a process
    ``destroy_process_group`` destroys a group only when nothing else holds it; a group still
    alive when the interpreter finalizes can abort the process (exit status 134, "terminate
    called without an active exception"): a gloo worker thread that finishes a collective frees
    its tensors, which needs the GIL, and CPython ends a thread that asks for the GIL while
    finalizing with a forced unwind that C++ turns into ``std::terminate``. So a closed engine
    holds no group (:meth:`TorchComm.close`). torch itself can hold the default group:
    ``torch.distributed.nn.functional`` takes ``group.WORLD`` as a default argument, which is
    the group itself when that module is first imported after ``init_process_group`` (as the
    first ``torch.optim.Optimizer`` made does, by importing ``torch._dynamo``). A script
    imports ``torch.distributed.nn`` before ``init_process_group`` to avoid it, as offload's
    own launchers do (``offload demo``, the tests' rank worker).
"""

from __future__ import annotations

import atexit
import datetime
import json
import pickle
import sys
import threading
import time
from collections.abc import Callable

import torch

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


class CollectiveError(RuntimeError):
    """A collective failed or timed out: another rank raised, stopped or is stuck."""


class Handle:
    """One collective in flight (or already complete); :meth:`wait` is the only way to its
    result. Idempotent: a second wait returns at once."""

    __slots__ = ("_work", "_finish", "_comm", "_op", "_what")

    def __init__(self, comm, op: str, what: str, work=None, finish: Callable | None = None):
        self._comm, self._op, self._what = comm, op, what
        self._work, self._finish = work, finish

    def wait(self) -> None:
        work, self._work = self._work, None
        if work is not None:
            t0 = time.perf_counter()
            try:
                done = work.wait(timeout=datetime.timedelta(seconds=self._comm.timeout))
            except Exception as exc:  # noqa: BLE001 - every backend error is said the same way
                raise self._comm.failure(self._op, self._what, exc) from exc
            finally:
                self._comm.waited(self._op, time.perf_counter() - t0)
            if done is False:
                raise self._comm.failure(self._op, self._what, None)
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()

    def done(self) -> bool:
        return self._work is None or bool(self._work.is_completed())


def completed(comm, op: str, what: str = "") -> Handle:
    return Handle(comm, op, what)


class Comm:
    """Interface (see the module Notes); ``rank`` and ``world`` are in the model's group."""

    rank: int = 0
    world: int = 1
    global_rank: int = 0  # in the default group (names per-rank directories)
    timeout: float = 1800.0
    backend: str = "local"
    name = "collectives"  # how telemetry files its counters

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {op: {"bytes": 0, "calls": 0, "wait_seconds": 0.0} for op in OPS}

    # -- operations ----------------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, what: str = "") -> Handle:
        """``out`` becomes every rank's ``inp`` back to back, in rank order (``inp`` may be this
        rank's slot of ``out``)."""
        raise NotImplementedError

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, what: str = "") -> Handle:
        """``out`` becomes the sum over ranks of this rank's ``world``-th part of ``inp``."""
        raise NotImplementedError

    def all_reduce(self, t: torch.Tensor, op: str = "sum", what: str = "") -> Handle:
        """``t`` becomes the sum (``op="sum"``) or maximum (``"max"``) over ranks, in place."""
        raise NotImplementedError

    def broadcast(self, t: torch.Tensor, src: int, what: str = "") -> Handle:
        """``t`` becomes rank ``src``'s ``t``, in place."""
        raise NotImplementedError

    def all_gather_object(self, obj, what: str = "") -> list:
        """Every rank's ``obj`` (small, picklable), in rank order; blocking, with the
        timeout."""
        raise NotImplementedError

    def check_in(self, row: torch.Tensor, what: str = "") -> torch.Tensor:
        """Every rank's ``row`` (a few int64, the same length on every rank), concatenated in
        rank order; blocking, with the timeout, not counted (``offload.runtime.agree``)."""
        raise NotImplementedError

    def barrier(self, what: str = "") -> None:
        """Returns once every rank has called it (with this comm's timeout)."""
        self.all_reduce(torch.zeros(1), what=what or "barrier").wait()

    # -- counting ------------------------------------------------------------------------------
    def count(self, op: str, nbytes: int) -> None:
        with self._lock:
            entry = self._counts[op]
            entry["bytes"] += nbytes
            entry["calls"] += 1

    def waited(self, op: str, seconds: float) -> None:
        with self._lock:
            if op in self._counts:  # (objects are not counted: module Note)
                self._counts[op]["wait_seconds"] += seconds

    def stats(self) -> dict:
        """``{"collectives": {op: {bytes, calls, wait_seconds}}}``, cumulative."""
        with self._lock:
            return {"collectives": {op: dict(v) for op, v in self._counts.items()}}

    def failure(self, op: str, what: str, exc: BaseException | None) -> CollectiveError:
        timed_out = exc is None or "timed out" in str(exc).lower()
        why = (
            f"did not complete within {self.timeout:g} s (distributed.timeout)"
            if timed_out
            else f"failed ({exc})"
        )
        # a peer that closed its connections says why as it exits; after a timeout it had
        # the whole timeout to (module Note on failures)
        known = self.failed_peers(wait=0.0 if timed_out else SAY_WAIT)
        return CollectiveError(
            f"offload: {op}{f' of {what}' if what else ''} on rank {self.rank} of {self.world} "
            f"{why}: {known + '; ' if known else ''}another rank raised, stopped or is stuck "
            "(its own error says why); every rank must run the same forwards, backwards and "
            "steps"
        )

    def failed_peers(self, wait: float = 0.0) -> str:
        """What is known of the other ranks' failures (module Note on failures), or "",
        waiting up to ``wait`` seconds for a failed rank to say it."""
        return ""

    def close(self) -> None:
        """The engine closed: lets go of what ties this object to other processes."""


class LocalComm(Comm):
    """One rank: gathering is a copy, reducing changes nothing; nothing is counted."""

    def all_gather(self, out, inp, what=""):
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return completed(self, "all_gather", what)

    def reduce_scatter(self, out, inp, what=""):
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return completed(self, "reduce_scatter", what)

    def all_reduce(self, t, op="sum", what=""):
        return completed(self, "all_reduce", what)

    def broadcast(self, t, src, what=""):
        return completed(self, "broadcast", what)

    def all_gather_object(self, obj, what: str = "") -> list:
        return [obj]

    def check_in(self, row: torch.Tensor, what: str = "") -> torch.Tensor:
        return row.clone()

    def barrier(self, what: str = "") -> None:
        pass


_RAISED = "offload/raised/{}"  # store key: the uncaught exception a rank's process ended on
_WHO = "offload/who/{}"  # store key: a rank's owner record (pid, host, start time)
_EXITING: list = []  # the Peers of each store this process's groups used; told at exit
SAY_WAIT = 3.0  # seconds a failed collective waits for a failed rank to say why


class Peers:
    """The ranks' records in the group's store (module Note on failures): who each rank is,
    and the exception a rank's process ended on."""

    def __init__(self, store, global_rank: int) -> None:
        self.store, self.global_rank = store, global_rank

    @staticmethod
    def of_default_group(global_rank: int) -> Peers | None:
        from torch.distributed import distributed_c10d  # noqa: PLC0415

        try:
            store = distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store (a backend without one): names nothing
            return None
        peers = Peers(store, global_rank)
        from offload.io import _owner  # noqa: PLC0415

        try:
            store.set(_WHO.format(global_rank), json.dumps(_owner.this_process(keep=False)))
        except Exception:  # noqa: BLE001
            return None
        atexit.unregister(_say_uncaught_at_exit)  # (once, and after the handlers before it)
        atexit.register(_say_uncaught_at_exit)
        _EXITING[:] = [p for p in _EXITING if p.store is not store] + [peers]
        return peers

    def _read(self, key: str) -> str | None:
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store's host is gone too: nothing known
            return None

    def describe(self, ranks: dict[int, int], wait: float) -> str:
        """What the other ranks (``ranks``: group rank -> global rank) said or are, waiting up
        to ``wait`` seconds for one to say it (module Note on failures: a failing rank's
        ``finally`` can close its connections before it exits)."""
        deadline = time.monotonic() + wait
        while ranks:
            said = [x for x in (self._one(rank, g) for rank, g in ranks.items()) if x]
            if said or time.monotonic() >= deadline:
                return "; ".join(said)
            time.sleep(0.05)
        return ""

    def _one(self, rank: int, global_rank: int) -> str:
        from offload.io import _owner  # noqa: PLC0415

        raised = self._read(_RAISED.format(global_rank))
        if raised is not None:
            return f"rank {rank} raised {raised}"
        who = self._read(_WHO.format(global_rank))
        try:
            record = json.loads(who) if who is not None else None
        except ValueError:
            record = None
        if isinstance(record, dict) and _owner.judge(record).gone:
            if (raised := self._read(_RAISED.format(global_rank))) is not None:
                return f"rank {rank} raised {raised}"  # (it said so as it ended)
            return (  # which signal is not known here (not our child): both common ones
                f"rank {rank} (pid {record.get('pid')} on this host) ended without an error "
                "(a signal: SIGKILL, as the out-of-memory killer sends, or SIGABRT, as gloo "
                "aborts a rank whose collective differs from the other ranks', e.g. a call "
                "made on some ranks only; its own output says which)"
            )
        return ""

    def say_raised(self, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        try:
            self.store.set(_RAISED.format(self.global_rank), text)
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def _say_uncaught_at_exit() -> None:
    """The process ends on an uncaught exception (``sys.last_value``): every group it joined
    hears of it before its connections close (module Note on failures)."""
    exc = getattr(sys, "last_value", None)
    if exc is None or isinstance(exc, CollectiveError):
        return
    said = set()
    for peers in _EXITING:
        if id(peers.store) not in said:
            said.add(id(peers.store))
            peers.say_raised(exc)


def _all_gather_fn():
    import torch.distributed as dist  # noqa: PLC0415

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    import torch.distributed as dist  # noqa: PLC0415

    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TorchComm(Comm):
    """The ranks of a ``torch.distributed`` process group (see the module Notes)."""

    def __init__(self, group, timeout: float) -> None:
        import torch.distributed as dist  # noqa: PLC0415

        super().__init__()
        self._dist = dist
        self._group, self._closed = group, False
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self.timeout = float(timeout)
        self.backend = str(dist.get_backend(group)).lower()
        if self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._ag, self._rs = _all_gather_fn(), _reduce_scatter_fn()
        others = [r for r in range(self.world) if r != self.rank]
        self._others = {
            r: dist.get_global_rank(group, r) if group is not None else r for r in others
        }
        self._peers = Peers.of_default_group(self.global_rank)

    def use_device(self, device: torch.device) -> None:
        """NCCL's tensors go to ``device``, this rank's compute device (``wrap`` says it once
        the config's device is resolved: at ``__init__`` the current device may not have been
        set to this rank's yet, and every rank would have staged onto ``cuda:0``)."""
        if self.backend == "nccl":
            self.device = device

    @property
    def group(self):
        if self._closed:
            raise RuntimeError(
                "offload: a collective after the engine was closed (optimizer.close()); its "
                "process group was let go"
            )
        return self._group

    def failed_peers(self, wait: float = 0.0) -> str:
        return self._peers.describe(self._others, wait) if self._peers is not None else ""

    def close(self) -> None:
        """Drops the reference to a group given to ``wrap`` (module Note on exit)."""
        self._group, self._closed = None, True

    # A tensor elsewhere than the backend's device goes through a staged copy (module Note).
    def _here(self, t: torch.Tensor) -> bool:
        return t.device == self.device and t.is_contiguous()

    def _staged_in(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._here(t) else t.to(self.device, copy=True).contiguous()

    def _issue(self, op, what, nbytes, run, out=None, staged_out=None) -> Handle:
        self.count(op, nbytes)
        try:
            work = run()
        except Exception as exc:  # noqa: BLE001 - a peer already gone fails at issue time
            raise self.failure(op, what, exc) from exc
        finish = None
        if out is not None and staged_out is not None and staged_out is not out:
            finish = lambda: out.copy_(staged_out)  # noqa: E731
        return Handle(self, op, what, work, finish)

    def all_gather(self, out, inp, what=""):
        if out.numel() != inp.numel() * self.world:
            raise ValueError(f"all_gather: {out.numel()} != {self.world} x {inp.numel()}")
        o = out if self._here(out) else torch.empty_like(out, device=self.device)
        i = self._staged_in(inp)
        return self._issue(
            "all_gather",
            what,
            out.numel() * out.element_size(),
            lambda: self._ag(o, i, group=self.group, async_op=True),
            out,
            o,
        )

    def reduce_scatter(self, out, inp, what=""):
        if inp.numel() != out.numel() * self.world:
            raise ValueError(f"reduce_scatter: {inp.numel()} != {self.world} x {out.numel()}")
        o = out if self._here(out) else torch.empty_like(out, device=self.device)
        i = self._staged_in(inp)
        return self._issue(
            "reduce_scatter",
            what,
            inp.numel() * inp.element_size(),
            lambda: self._rs(o, i, group=self.group, async_op=True),
            out,
            o,
        )

    def all_reduce(self, t, op="sum", what=""):
        red = {"sum": self._dist.ReduceOp.SUM, "max": self._dist.ReduceOp.MAX}[op]
        s = t if self._here(t) else t.to(self.device, copy=True)
        return self._issue(
            "all_reduce",
            what,
            2 * t.numel() * t.element_size(),
            lambda: self._dist.all_reduce(s, op=red, group=self.group, async_op=True),
            t,
            s,
        )

    def broadcast(self, t, src, what=""):
        s = t if self._here(t) else t.to(self.device, copy=True)
        root = self._dist.get_global_rank(self.group, src) if self.group is not None else src
        return self._issue(
            "broadcast",
            what,
            t.numel() * t.element_size(),
            lambda: self._dist.broadcast(s, src=root, group=self.group, async_op=True),
            t,
            s,
        )

    def all_gather_object(self, obj, what: str = "") -> list:
        """Two all-gathers of bytes (the lengths, then the pickles padded to the longest),
        each waited with the timeout. ``torch.distributed.all_gather_object`` blocks with none:
        a checkpoint that one rank never joined held the others for the group's own timeout
        (30 minutes by default) instead of ``distributed.timeout``. Not counted (module Note)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = torch.zeros(self.world, dtype=torch.int64)
        self._gather_bytes(sizes, torch.tensor([data.numel()], dtype=torch.int64), what)
        width = int(sizes.max())
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: data.numel()] = data
        everyone = torch.empty(width * self.world, dtype=torch.uint8)
        self._gather_bytes(everyone, mine, what)
        rows = everyone.view(self.world, width)
        return [pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(self.world)]

    def check_in(self, row: torch.Tensor, what: str = "") -> torch.Tensor:
        out = torch.empty(row.numel() * self.world, dtype=row.dtype)
        self._gather_bytes(out, row, what, op="check_in")
        return out

    def _gather_bytes(
        self, out: torch.Tensor, inp: torch.Tensor, what: str, op: str = "all_gather_object"
    ) -> None:
        o = out if self._here(out) else torch.empty_like(out, device=self.device)
        i = self._staged_in(inp)
        try:
            work = self._ag(o, i, group=self.group, async_op=True)
        except Exception as exc:  # noqa: BLE001 - a peer already gone fails at issue time
            raise self.failure(op, what, exc) from exc
        finish = (lambda: out.copy_(o)) if o is not out else None
        Handle(self, op, what, work, finish).wait()
