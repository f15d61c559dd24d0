"""``/proc/self/smaps`` for tests: a field of the mapping that holds an address."""

from __future__ import annotations


def mapping_field(addr: int, field: str) -> list[str]:
    """The values after ``field`` (e.g. ``"VmFlags:"``, ``"AnonHugePages:"``) in the entry of
    the mapping that holds ``addr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == field:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds 0x{addr:x}")
