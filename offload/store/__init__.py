"""The tiered store: shards across device, host and NVMe with hard budgets, async moves and a
trace-driven prefetch queue. Knows shards, not modules (the engine maps units to shards).
"""

from offload.store.fetch import Fetch
from offload.store.state import LEGAL_TRANSITIONS, ShardState, Tier
from offload.store.store import TieredStore

__all__ = ["Tier", "ShardState", "LEGAL_TRANSITIONS", "TieredStore", "Fetch"]
