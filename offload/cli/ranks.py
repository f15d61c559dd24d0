"""Several data-parallel ranks on this machine for a command (``--nproc N``): the command
starts itself again under ``torchrun --standalone --nproc-per-node N``, and each rank joins
the process group (gloo on the CPU, NCCL on CUDA). ``offload demo`` and ``offload finetune``
share it; a command started by the user's own ``torchrun`` joins the same way.

Note: signals
    ``launch`` waits for torchrun, a child of its own. A SIGTERM (what a scheduler sends:
    Slurm's scancel, Kubernetes, ``timeout``) ended that process alone, and torchrun and the
    ranks trained on in the background, writing OUT (a resume started then raced them for the
    directory); a Ctrl-C made it SIGKILL torchrun, leaving the ranks without it. Now SIGTERM
    is passed on to torchrun, which stops the ranks (each rank's own handler closes its engine,
    removing its swap files), and the command ends with 143 once they have; a terminal's
    Ctrl-C reaches torchrun itself (the same process group) and is waited out (130), one sent
    to this process alone is passed on after 5 s; and torchrun has SIGTERM as its parent death
    signal, so a command killed outright (SIGKILL, the out-of-memory killer) takes it, and
    with it the ranks, along."""

from __future__ import annotations

import datetime
import os
import signal
import sys


def launch(command: str, nproc: int, argv: list[str]) -> int:
    """Runs ``offload COMMAND`` with ``argv`` (without its ``--nproc``) as ``nproc`` ranks under
    torchrun; its exit status."""
    import subprocess  # noqa: PLC0415

    rest, skip = [], False
    for a in argv:  # the same arguments without --nproc
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [
        sys.executable,
        "-m",
        "offload.cli.ranks",  # torchrun, a rank's failure said as one line (torchrun())
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "offload.cli.main",
        command,
        *rest,
    ]
    print(f"offload {command}: {nproc} ranks: {' '.join(cmd[1:])}", file=sys.stderr)
    # Signals (Note: signals below): torchrun ends with this process, however it ends; a
    # SIGTERM goes on to torchrun; a Ctrl-C reaches torchrun too and is waited out
    proc = subprocess.Popen(cmd, preexec_fn=_end_with(os.getpid()))
    said: list[int] = []

    def forward(signum, frame) -> None:
        said.append(signum)
        proc.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                status = proc.wait()
                break
            except KeyboardInterrupt:
                said.append(signal.SIGINT)
                try:
                    status = proc.wait(5)
                    break
                except subprocess.TimeoutExpired:  # sent to this process alone: passed on
                    proc.send_signal(signal.SIGINT)
                except KeyboardInterrupt:
                    pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    if said:
        return 128 + said[0]  # a shell's status for a process a signal ended (130, 143)
    return status


def _end_with(parent: int):
    """torchrun's ``preexec_fn``: the kernel sends it SIGTERM when ``parent`` (this process)
    ends, even by SIGKILL (Linux's parent death signal; elsewhere nothing is set up). libc is
    loaded here, before the fork: only the call runs in the child."""
    import ctypes  # noqa: PLC0415

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def setup() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent ended before that: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


def join_group(device: str, timeout: float | None = None) -> tuple[int, int, bool]:
    """Under torchrun (``WORLD_SIZE`` > 1): joins the process group for ``device`` ("auto":
    CUDA when there is one), unless one is initialized already. ``(rank, world, joined)``:
    ``joined`` says this call made the group (its caller destroys it at the end).

    ``timeout`` (seconds): the group's own, the config's ``distributed.timeout``. offload's
    waits end at that timeout, but a collective they leave pending cannot be cancelled and
    holds the process's exit (``destroy_process_group``) until the group's timeout, 30
    minutes by default: a rank whose peer is stuck said so after ``distributed.timeout`` and
    then did not end."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from offload.dist import env_int, init_process_group  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if env_int("WORLD_SIZE", 1) <= 1:
        return 0, 1, False
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda and device in ("auto", "cuda") and "LOCAL_RANK" in os.environ:
        # this rank's GPU is current before NCCL starts: torch's own uses of the group before
        # wrap (a barrier) otherwise guess cuda:0 on every rank (wrap sets it too)
        torch.cuda.set_device(env_int("LOCAL_RANK", 0))
    if timeout is None:
        init_process_group("nccl" if cuda else "gloo")
    else:
        init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size(), True


def torchrun(argv: list[str], command: str) -> int:
    """``torchrun ARGV`` (``torch.distributed.run``) in this process, as ``launch`` runs it:
    when a rank fails, torchrun stops the others and raised ``ChildFailedError``, which
    printed its traceback and a 20-line summary after the rank's own error and ended with
    status 1 (one process ends a refused flag with 2). Here the rank that failed first is
    named in one line and its exit status is the command's (1 for a rank ended by a
    signal, which is named)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415
    from torch.distributed.run import parse_args, run  # noqa: PLC0415

    try:
        run(parse_args(argv))
    except SignalException as exc:  # (Note: signals) torchrun stopped the ranks: no traceback
        name = _signal_name(int(exc.sigval))
        print(f"offload {command}: {name}: the ranks were stopped", file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        status = failure.exitcode
        if status > 0:
            how = f"exited with status {status} (its error is above)"
        else:  # (killed: the kernel's OOM killer sends SIGKILL)
            how = f"was ended by {_signal_name(-status)}"
        print(
            f"offload {command}: rank {rank} {how}; the other ranks were stopped",
            file=sys.stderr,
        )
        return status if status > 0 else 1
    return 0


def _signal_name(number: int) -> str:
    import signal  # noqa: PLC0415

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


if __name__ == "__main__":  # launch()'s torchrun: ARGV ends with "-m offload.cli.main COMMAND"
    sys.exit(torchrun(sys.argv[1:], sys.argv[sys.argv.index("offload.cli.main") + 1]))
