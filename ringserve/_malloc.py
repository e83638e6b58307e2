"""glibc allocator tuning for the data path.

Every chunk that arrives or leaves is a fresh ``bytes`` of about a MiB. glibc serves allocations of
that size with mmap by default and unmaps them on free, so each chunk costs page faults and
zero-filling in the kernel: measured here, that doubled the kernel time of a 64 MiB allreduce.
Raising the mmap threshold keeps those buffers in the heap and reuses them. It is a process-wide
setting, applied once when a worker starts, and switched off with RINGSERVE_TUNE_MALLOC=0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger("ringserve.worker")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# 32 MiB is glibc's largest mmap threshold on 64-bit; chunks stay far below it.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20

_done = False


def tune() -> bool:
    """Raises glibc's mmap and trim thresholds once per process; returns whether it applied."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    ok: bool = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    _done = ok
    if not ok:
        log.info("mallopt refused the allocator thresholds; the data path keeps glibc's defaults")
    return ok


# A coordinator's large allocations (parameter blobs, 1 MiB chunks) are rare and must go back to
# the system when freed. glibc's default threshold adapts upwards after each large free, after
# which such blocks come from the heap, which a few live objects on top keep from shrinking.
COORDINATOR_MMAP_THRESHOLD_BYTES = 256 << 10


def return_large_frees() -> bool:
    """For a coordinator process: blocks of 256 KiB and more get their own mapping, unmapped when
    freed, so that memory taken by a flood of puts is given back. Process-wide, so only the
    ``ringserve coordinator`` command applies it (a worker's process keeps ``tune``'s setting)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, COORDINATOR_MMAP_THRESHOLD_BYTES) == 1)
    except (OSError, AttributeError):  # not glibc
        return False


def trim() -> bool:
    """Gives the heap's free pages back to the system (glibc's malloc_trim); False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
