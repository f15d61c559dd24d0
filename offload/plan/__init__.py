"""The plan: everything decided once at wrap and read-only afterwards.

Owns: the units and their flat layouts (``FlatLayout``, each rank's share by ``ShardSpec``),
the pieces they stream in, the placement (param home, optimizer-state home, step schedule,
buffer arithmetic) and who owns the master and the gradient bytes (``ownership.py``'s Note).
Nothing here allocates or moves data; the runtime and the homes are built from a plan.
"""

from offload.plan.layout import ALIGN, PAGE_ELEMS, FlatLayout, Segment, ShardSpec
from offload.plan.ownership import GradOwner, GradReduce, MasterOwner
from offload.plan.placement import (
    DTYPES,
    NVME_OPT_BUFFERS,
    URGENT_READS,
    Placement,
    Schedule,
    check_host_buffers,
    make_placement,
    resolve_device,
)
from offload.plan.plan import Plan, make_plan, split
from offload.plan.units import Residency, Unit, build_units, select_units

__all__ = [
    "ALIGN",
    "DTYPES",
    "NVME_OPT_BUFFERS",
    "PAGE_ELEMS",
    "FlatLayout",
    "GradOwner",
    "GradReduce",
    "MasterOwner",
    "Placement",
    "Plan",
    "Residency",
    "Schedule",
    "Segment",
    "ShardSpec",
    "URGENT_READS",
    "Unit",
    "build_units",
    "check_host_buffers",
    "make_placement",
    "make_plan",
    "resolve_device",
    "select_units",
    "split",
]
