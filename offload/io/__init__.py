"""Async IO between host tensors and fast local disks: the bottom layer of the offload runtime.

``AsyncIO`` moves bytes (O_DIRECT, native engine or thread fallback), ``aligned_empty`` and
``BufferPool`` provide 4096-aligned (pinned with CUDA) host buffers, ``NvmeStore`` keeps named
shards in preallocated files.
"""

from offload.io.aligned import aligned_empty
from offload.io.async_io import AsyncIO, IOHandle
from offload.io.buffer_pool import BufferPool
from offload.io.errors import OffloadIOError
from offload.io.nvme_store import NvmeStore

__all__ = ["AsyncIO", "IOHandle", "aligned_empty", "BufferPool", "NvmeStore", "OffloadIOError"]
