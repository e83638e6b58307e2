"""Result buffers that a new-result collective reuses, once nobody can reach them any more.

``out = rs.allreduce(x)`` hands the caller a new array per call. Above glibc's mmap threshold
(32 MiB at most, see _malloc.py) every such array is a fresh mapping that the kernel faults in and
zero-fills page by page as the ring writes it, and unmaps when the caller drops it: measured here,
a 64 MiB world-2 allreduce took 1.3-1.8x as long with a new result as in place. Below the
threshold the heap reuses freed blocks by itself; above it only keeping the buffer does.

A result handed to the caller is theirs: the pool keeps a reference to each buffer it handed out
and gives one out again only when that reference is the only one left (``sys.getrefcount``). Any
view of the buffer (the reshaped result, a slice, ``torch.from_numpy`` of it, a memoryview) holds a
reference to it, so a buffer that anything can still read or write is never reused. Nothing
but this check decides: no call frees or returns a buffer. A buffer's contents are stale when it is
handed out again, which the collectives allow, as with ``np.empty``: they write every element.

The pool holds at most ``capacity`` bytes of buffers, in use or not, so what it keeps alive after
the caller dropped its results is bounded by ``capacity`` (0: no pool). To make room it forgets the
oldest buffers, free ones first; forgetting a buffer in use costs nothing: the caller's reference
frees it as usual. In the loop ``out = rs.allreduce(x)`` the last result is still alive while the
next call runs, so that loop cycles through two buffers.

The pool belongs to one worker and is used on its event loop only.
"""

from __future__ import annotations

import sys

import numpy as np

MIN_BYTES = 256 << 10  # below this an allocation is cheap: the heap reuses freed blocks
TRACKED = 16  # the most buffers the pool looks through on each call


class ResultPool:
    """Flat byte buffers, reused once unreachable from outside the pool.

    >>> pool = ResultPool(1 << 30)
    >>> a = pool.array(np.dtype(np.float32), 1 << 20)
    >>> b = pool.array(np.dtype(np.float32), 1 << 20)  # a is alive: a new buffer
    >>> del a
    >>> c = pool.array(np.dtype(np.float32), 1 << 20)  # a's buffer again
    """

    def __init__(self, capacity: int, *, min_bytes: int = MIN_BYTES, tracked: int = TRACKED) -> None:
        if capacity < 0:
            raise ValueError(f"A result pool's capacity ({capacity}) must be at least 0 bytes.")
        self.capacity = capacity
        self.min_bytes = min_bytes
        self.tracked = tracked
        self._held: list[np.ndarray] = []  # oldest first
        self.reused = 0  # buffers handed out again (for tests and benchmarks)

    @property
    def held_bytes(self) -> int:
        return sum(b.nbytes for b in self._held)

    def _free(self, i: int) -> bool:
        # Two references: the list's, and getrefcount's own argument. Any view, export or
        # name elsewhere adds one.
        return sys.getrefcount(self._held[i]) == 2

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        """A flat array of ``count`` elements of ``dtype``, its contents undefined (as np.empty)."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        if nbytes < self.min_bytes or nbytes > self.capacity:
            return np.empty(count, dtype=dtype)
        for i in range(len(self._held)):
            if self._held[i].nbytes == nbytes and self._free(i):
                buf = self._held.pop(i)
                self._held.append(buf)  # the most recently used last
                self.reused += 1
                return buf.view(dtype)
        self._make_room(nbytes)
        buf = np.empty(nbytes, dtype=np.uint8)
        self._held.append(buf)
        return buf.view(dtype)

    def _make_room(self, nbytes: int) -> None:
        """Forgets the oldest buffers, free ones first, until ``nbytes`` more fit."""
        total = self.held_bytes
        while self._held and (total + nbytes > self.capacity or len(self._held) >= self.tracked):
            free = [i for i in range(len(self._held)) if self._free(i)]
            total -= self._held.pop(free[0] if free else 0).nbytes

    def clear(self) -> None:
        """Forgets every buffer (the worker stops)."""
        self._held.clear()
