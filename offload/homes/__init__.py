"""Where state lives between uses: the param homes, the optimizer-state homes and the gradient
owners, one object of each per wrapped model, chosen by the plan (``offload.plan``).

Owns: every byte of compute parameters (this rank's share), fp32 master, fp32 gradients and
Adam moments (see ``offload.plan.ownership``), and the moves between a home and the compute
device (through ``offload.device``) or NVMe (through ``offload.store``). A param home loads its
shard (``create``, ``load_shard``) and unshards a unit for compute (``unshard``) as separate
calls.
"""

from offload.homes.grads import GradHome, GradParts, GradRecord, Hyper
from offload.homes.optim import KINDS, OptimHome
from offload.homes.params import DeviceParams, HostParams, NvmeParams, ParamHome

__all__ = [
    "KINDS",
    "DeviceParams",
    "GradHome",
    "GradParts",
    "GradRecord",
    "HostParams",
    "Hyper",
    "NvmeParams",
    "OptimHome",
    "ParamHome",
]
