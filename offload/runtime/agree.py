"""The ranks' check that they reached the same call (stages 1-3 with more than one rank).

Note: why the ranks check in
    Every rank must call the same forwards, backwards, norms and steps in the same order
    (``README``, Many GPUs). Where one does not (an evaluation forward on rank 0 only, a rank
    that runs one micro-step fewer, one that skips ``clip_grad_norm_`` or ``step()``), its next
    collective meets another kind on the other ranks: gloo then waited for
    ``distributed.timeout`` (1800 s by default) or aborted one process on the sizes, and at
    stage 3 a rank that skipped ``step()`` trained on, its share of the params one update
    behind the others' (2.4e-2 off after 3 steps of the probe, no error). So each of those
    calls first all-gathers one fixed row per rank (:data:`WIDTH` int64: the call, how many
    checks came before it, the step, the backwards since it, grad mode, and a digest of the
    backward's order of reductions, which it carries for ``ScatteredGrads``), the same collective
    whatever the call, so ranks at different calls pair and each sees what the others do;
    where the rows differ every rank raises :class:`RankDivergenceError` naming each rank's
    call, before that call changes anything.

    Checked: every forward of the model at stage 3 (its units are gathered one by one) and, at
    stages 1-2, those before the step's first backward (they gather the units' updated shares;
    none of a model with nothing trainable, which never gathers there, so ranks may run
    different numbers of its forwards); each step's backward at stages 2-3 (its reductions go
    out unit by unit; stage 1 reduces at the step, so ranks may run different numbers of
    micro-steps there, but for the step in backward, which reduces in the step's last backward
    as stages 2-3 do); the gradient norm; ``step()``. One small blocking collective each, not
    counted with the training's collectives (``offload.dist``, Note: what is counted). A unit
    skipped inside a forward is seen by the backward's check, whose digest of the order of
    reductions then differs: :meth:`offload.runtime.grads.ScatteredGrads.backward_begins`
    gathers the orders to name the units (``UnitOrderError``); it gathered them at every
    backward before, so a backward costs one collective where it cost two.

    The cost, on a busy 2-core machine over gloo (2 ranks, the 4-block stack of the tests,
    accumulation 2, clipping): a check takes 0.3-1.3 ms; per step stage 3 makes 6 (2
    forwards, 2 backwards, the norm, the step) where its backwards made 4 collectives of
    objects before, stage 2 makes 5 for 4, stage 1 3 for none. The median step of that toy
    (25 steps, runs alternated) went from 34-47 ms to 41-80 ms at stage 3, 25-29 to 29-48 at
    stage 2, 17-24 to 19-29 at stage 1: within the machine's noise at best, a few ms at
    worst, against steps of seconds on a real model. With NCCL each check is a
    host-synchronizing all-gather of 48 bytes per rank, as the backward's order check was
    (not run on a GPU).
"""

from __future__ import annotations

import enum

import torch

from offload.runtime.phase import PhaseError

WIDTH = 6  # int64 per rank: call, checks before it, step, backwards, grad mode, detail


class Call(enum.IntEnum):
    """The calls the ranks check in at (module Note)."""

    FORWARD = 1
    """A forward of the model (the root module called)."""
    BACKWARD = 2
    """A backward of the step (stages 2-3)."""
    NORM = 3
    """The gradient norm: ``clip_grad_norm_``, ``grad_norm`` or an fp16 overflow check."""
    STEP = 4
    """``optimizer.step()``."""


class RankDivergenceError(PhaseError):
    """The ranks reached different calls (module Note); raised on every rank, before the
    call changes anything."""


def _says(row: list[int], counted: bool) -> str:
    call, seq, step, backwards, grad, _ = row
    what = {
        Call.FORWARD: "a forward of the model" + ("" if grad else " under no_grad"),
        Call.BACKWARD: "a backward",
        Call.NORM: "the gradient norm (clip_grad_norm_)",
        Call.STEP: "optimizer.step()",
    }[Call(call)]
    took = backwards if counted else ("some" if backwards else "none")
    return f"{what} (step {step + 1}, backwards into it: {took}, check {seq})"


class Agreement:
    """Checks the ranks in at a call (module Note); one per wrapped model."""

    def __init__(self, comm, count_backwards: bool = True) -> None:
        self.comm = comm
        # stage 1 reduces at the step: only whether a rank took any backward must agree
        self.count_backwards = count_backwards
        self.seq = 0  # checks made so far (every rank makes the same ones)

    def check(
        self, call: Call, step: int, backwards: int, grad: bool = True, detail: int = 0
    ) -> bool:
        """Raises :class:`RankDivergenceError` on every rank where the ranks are at different
        calls; returns whether their ``detail`` (a digest the caller compares itself: the
        backward's order of reductions) was the same too."""
        if self.comm.world == 1:
            return True
        if not self.count_backwards:
            backwards = min(backwards, 1)
        mine = [int(call), self.seq, step, backwards, int(grad), detail]
        self.seq += 1
        what = f"the ranks' check at {call.name.lower()}"
        rows = self.comm.check_in(torch.tensor(mine, dtype=torch.int64), what)
        rows = [[int(v) for v in r] for r in rows.view(self.comm.world, WIDTH)]
        if all(r[:-1] == mine[:-1] for r in rows):
            return all(r[-1] == mine[-1] for r in rows)
        me = self.comm.rank
        groups: dict[tuple, list[int]] = {}  # ranks at one call, together (many ranks)
        for r, row in enumerate(rows):
            groups.setdefault(tuple(row[:-1]), []).append(r)
        each = "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} at "
            f"{_says([*row, 0], self.count_backwards)}"
            for row, ranks in groups.items()
        )
        backwards = (
            "the same number of backwards per step (here each backward reduces the gradients: "
            "stages 2-3, and stage 1 with offload_optimizer.step_in_backward, whose update runs "
            "in the step's last backward; at stage 1 step_in_backward false lets ranks run "
            "fewer micro-steps)"
            if self.count_backwards
            else "at least one backward per step"
        )
        raise RankDivergenceError(
            f"offload: the ranks reached different calls (rank {me} of {self.comm.world}): "
            f"{each}. Every rank must run the same forwards (an evaluation or logging forward "
            "too: run it on every rank, each on its own slice, or on a copy from "
            f"model.state_dict() taken on every rank), {backwards}, and clip_grad_norm_, "
            "step() and zero_grad() alike. Nothing was changed by this call on any rank; the "
            "run cannot go on in step (end it on every rank)"
        )
