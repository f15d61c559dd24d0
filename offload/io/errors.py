"""The error class of ``offload.io``.

Note: errors are ``OSError`` subclasses on purpose. Every failure of this package is about a
file or a byte budget, so callers can catch ``OSError`` for all of them and read ``errno`` and
``filename`` (the path or key involved). Plain IO failures (ENOSPC, EIO, EACCES, ...) are raised
as ``OSError(errno, message, path)``, which Python maps to its usual subclasses
(``PermissionError``, ``FileNotFoundError``, ...); :class:`OffloadIOError` is raised for the
package's own conditions (a shard that was never fully written, a checksum mismatch, an
exhausted buffer pool).
"""

from __future__ import annotations


class OffloadIOError(OSError):
    """An IO-tier failure that is not a plain syscall error: ``errno`` says which kind.

    ``ENODATA``: a shard (``filename`` names the key and file) was never completely written.
    ``EBADMSG``: a shard's checksum did not match on read.
    ``ETIMEDOUT``: a buffer pool stayed exhausted for its whole timeout (also a ``TimeoutError``
    via :class:`PoolExhaustedError`).
    """


class PoolExhaustedError(OffloadIOError, TimeoutError):
    """``BufferPool.acquire`` timed out: every buffer stayed in use for the whole timeout."""
