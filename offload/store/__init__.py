"""The tiered store: shards in host memory and on NVMe under a hard host budget, asynchronous
moves and a trace-driven prefetch queue. Knows shards, not modules (the homes map units to
shards).

Owns: every shard's home bytes (NVMe extents, host tensors), the host pool's buffers while a
shard's copy is cached in one, and the counters of every byte moved between host and NVMe.
"""

from offload.store.fetch import Fetch
from offload.store.state import LEGAL_TRANSITIONS, ShardState, Tier
from offload.store.store import TieredStore

__all__ = ["Tier", "ShardState", "LEGAL_TRANSITIONS", "TieredStore", "Fetch"]
