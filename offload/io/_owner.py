"""Who owns a swap directory, and reclaiming those whose owner is gone.

Note: the owner record. Each private directory an :class:`~offload.io.NvmeStore` makes holds
``owner.json``: the pid, the process start time (``/proc/<pid>/stat`` field 22, clock ticks
since boot: a pid reused by a later process has a later start), the boot id, the host name, the
pid namespace, and whether the store was made with ``keep``. It is written under a temporary
name and renamed, so a reader sees a whole record or none.

Note: reclaiming. A store made on an ``nvme_path`` first looks at the ``offload-*`` directories
already there, and in the other directories it is given (``NvmeStore(reclaim=...)``: wrap gives
``nvme_path`` and each ``rank-NNNNN`` under it, where runs at every rank count swap, so a run
resumed at another rank count reclaims what the killed one left). A directory is removed only when its record proves the owner gone: the same
host and pid namespace and either another boot, or no such pid, or the pid held by a process
that started at another time, or a zombie (killed, not yet reaped; its files are closed). A
directory without a readable record, with ``keep``, of another host or pid namespace (a shared
or container-mounted disk), or whose owner cannot be inspected, is left alone. The winner of an
atomic rename to ``.offload-reclaim-*`` removes it, so two processes starting at once never
both count or remove the same bytes; a ``.offload-reclaim-*`` directory is garbage by
definition (a reclaimer, or a store closing its own directory, died half way: a store renames
its directory so before deleting it) and is removed too. What was freed is logged as a
WARNING (the path, the bytes on disk, the dead pid).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from dataclasses import dataclass

logger = logging.getLogger("offload.io")

RECORD = "owner.json"
PREFIX = "offload-"
RECLAIMING = ".offload-reclaim-"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _proc_stat(pid: int) -> tuple[str, int]:
    """``(state, start time in ticks)`` of ``pid`` from ``/proc``; OSError when it is gone."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()  # the name in (...) may hold spaces
    return fields[0].decode(), int(fields[19])  # fields 3 and 22 of proc(5)


def _boot_id() -> str:
    try:
        return _read("/proc/sys/kernel/random/boot_id")
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def this_process(keep: bool) -> dict:
    """The owner record of the calling process."""
    pid = os.getpid()
    try:
        start = _proc_stat(pid)[1]
    except OSError:
        start = None  # no /proc: such a record is never judged dead
    return dict(
        pid=pid,
        start_ticks=start,
        boot_id=_boot_id(),
        host=socket.gethostname(),
        pid_namespace=_pid_namespace(),
        keep=bool(keep),
    )


def write_record(directory: str, keep: bool) -> None:
    """Writes ``owner.json`` (0600) into ``directory`` atomically."""
    tmp = os.path.join(directory, RECORD + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(this_process(keep), f)
    os.replace(tmp, os.path.join(directory, RECORD))


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a directory's owner is provably gone, and why (for the log)."""

    gone: bool
    why: str


def judge(record: dict) -> Verdict:
    """Decides from an owner record; anything uncertain is "not gone"."""
    try:
        pid, start = int(record["pid"]), record["start_ticks"]
        host, boot, pidns = record["host"], record["boot_id"], record["pid_namespace"]
    except (KeyError, TypeError, ValueError):
        return Verdict(False, "owner record unreadable")
    if record.get("keep"):
        return Verdict(False, "kept on purpose (keep=True)")
    if host != socket.gethostname():
        return Verdict(False, f"owned by host {host!r}")
    if boot and boot != _boot_id():
        return Verdict(True, f"process {pid} ran before the machine rebooted")
    if pidns != _pid_namespace() or start is None:
        return Verdict(False, f"process {pid} cannot be inspected from here")
    try:
        state, now_start = _proc_stat(pid)
    except FileNotFoundError:
        return Verdict(True, f"process {pid} no longer exists")
    except OSError:
        return Verdict(False, f"process {pid} cannot be inspected")
    if now_start != start:
        return Verdict(True, f"process {pid} ended (its pid now belongs to a newer process)")
    if state in ("Z", "X"):
        return Verdict(True, f"process {pid} was killed (a zombie, not yet reaped)")
    return Verdict(False, f"process {pid} is running")


def disk_bytes(directory: str) -> int:
    """Bytes the files under ``directory`` occupy on disk (allocated blocks)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def reclaim(nvme_path: str) -> list[tuple[str, int]]:
    """Removes the swap directories under ``nvme_path`` whose owner is gone; returns
    ``(directory, bytes freed)`` for each and logs them."""
    freed: list[tuple[str, int]] = []
    try:
        entries = list(os.scandir(nvme_path))
    except OSError:
        return freed
    for entry in entries:
        if entry.name.startswith(RECLAIMING) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)  # a reclaimer died half way
            continue
        if not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            with open(os.path.join(entry.path, RECORD)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            logger.debug("offload.io: %s has no owner record; left alone", entry.path)
            continue
        verdict = judge(record if isinstance(record, dict) else {})
        if not verdict.gone:
            logger.debug("offload.io: %s left alone: %s", entry.path, verdict.why)
            continue
        claimed = os.path.join(nvme_path, RECLAIMING + entry.name)
        try:
            os.rename(entry.path, claimed)
        except OSError:
            continue  # another process claimed it first, or it just went away
        nbytes = disk_bytes(claimed)
        shutil.rmtree(claimed, ignore_errors=True)
        freed.append((entry.path, nbytes))
        logger.warning(
            "offload.io: reclaimed %d bytes (%.1f MiB) of swap space at %s: %s",
            nbytes,
            nbytes / 2**20,
            entry.path,
            verdict.why,
        )
    return freed
