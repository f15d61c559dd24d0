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

import datetime
import pickle
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
        why = (
            f"did not complete within {self.timeout:g} s (distributed.timeout)"
            if exc is None or "timed out" in str(exc).lower()
            else f"failed ({exc})"
        )
        return CollectiveError(
            f"offload: {op}{f' of {what}' if what else ''} on rank {self.rank} of {self.world} "
            f"{why}: another rank raised, stopped or is stuck (its own error says why); every "
            "rank must run the same forwards, backwards and steps"
        )

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

    def barrier(self, what: str = "") -> None:
        pass


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

    @property
    def group(self):
        if self._closed:
            raise RuntimeError(
                "offload: a collective after the engine was closed (optimizer.close()); its "
                "process group was let go"
            )
        return self._group

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

    def _gather_bytes(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> None:
        o = out if self._here(out) else torch.empty_like(out, device=self.device)
        i = self._staged_in(inp)
        try:
            work = self._ag(o, i, group=self.group, async_op=True)
        except Exception as exc:  # noqa: BLE001 - a peer already gone fails at issue time
            raise self.failure("all_gather_object", what, exc) from exc
        finish = (lambda: out.copy_(o)) if o is not out else None
        Handle(self, "all_gather_object", what, work, finish).wait()
