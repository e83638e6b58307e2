"""The same-host fast path: payloads in a shared-memory ring instead of the gRPC stream.

Between two workers on one host, a payload sent over gRPC is copied five times (into the frame,
into gRPC's buffer, into and out of the kernel, out of gRPC's buffer into ``bytes``) and, on
2 cores shared by 4 workers, those copies are the wall time. So each sender offers, in its HELLO,
a ring of fixed-size slots in a memfd; a receiver on the same host maps it through
``/proc/<pid>/fd/<fd>`` and answers by writing the ring's token back into it. From then on the
sender copies a payload once, into a free slot, and sends only the frame's header over the stream,
naming the slot. The receiver reads the payload in place and frees the slot when the last view of
it is dropped.

The stream stays the single source of order, failure and authentication: a frame names its slot
only after the slot was written, the header still carries the checksum, and whenever the ring is
unattached, full, or the payload is larger than a slot, the payload simply travels in the frame.
Nothing ever waits for a slot. A receiver on another host (other boot_id) or in another process
namespace cannot open the path, or finds a different token there, and never attaches, unless
both share a directory (``shared_dir``: a tmpfs volume of the containers of one host) where the
sender hands the memfd over a Unix socket to whoever sends the token (links/fdpass.py). The receiver
tries that first when it is offered, then /proc, and keeps the stream if neither works.

Each slot has one state byte: the sender sets it to 1 before it names the slot, the receiver sets
it to 0 when done. One writer per transition, and the stream orders them, so no atomics are
needed, given x86's ordering: a store is never seen before the loads that precede it (the
receiver's reads of the slot). Weakly ordered CPUs (ARM) give no such promise without a fence,
which Python cannot issue, so the fast path is only offered on x86-64.

A ring keeps the pages of the most slots ever in use at once, and on 2 cores a sender runs well
ahead of a receiver that waits for a core: a 64 MiB allreduce of 4 workers had all 32 slots in use
(64 MiB of pages per ring, in the RSS of both ends). So a sender gives the pages back
(``MADV_REMOVE``, which punches them out of the memfd, and so out of the receiver's mapping too)
once its ring has been idle, no payload put and every slot free, for ``release_after_s`` (it
looks every ``release_after_s``, so the pages go within twice that). Not sooner: writing into released pages faults them in again, 0.6 ms a MiB here against 0.1 ms into
resident ones, so a training loop keeps its pages from one step to the next, and a burst (a
broadcast of the parameters, a checkpoint's sync) leaves nothing behind.

Both sides unmap their ring when they close it: the sender when its link ends, the receiver when
its stream ends and the last payload view handed out is dropped (a collective may still hold
one), so a view change leaves no mappings behind.

A receiver maps only what a verified predecessor offers, and only a sealed memfd of ringserve's
(its name, its seals, its size and its token are all checked), so a hostile HELLO cannot make
a worker write into any other file, nor shrink the ring under it (which would raise SIGBUS).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import mmap
import os
import platform
import stat
import weakref

import numpy as np

from ringserve import wire
from ringserve._proto import peer_pb2
from ringserve.errors import ProtocolError
from ringserve.worker.dataplane.links import fdpass
from ringserve.worker.dataplane.links.fdpass import RingServer

log = logging.getLogger("ringserve.worker")

TOKEN_BYTES = 16
_ECHO = TOKEN_BYTES
_STATES = 64
_DATA = 4096
FREE, WRITTEN = 0, 1
NAME = "ringserve-ring"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(fcntl, "F_SEAL_SHRINK") else 0


def boot_id() -> str:
    """This host's boot id: equal for every process (and container) of one running kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def supported() -> bool:
    """Whether this process can offer and map rings: Linux memfds with seals, on x86-64."""
    return (hasattr(os, "memfd_create") and bool(_SEALS) and platform.machine() in ("x86_64", "AMD64")
            and bool(boot_id()))


def _size(slots: int, slot_bytes: int) -> int:
    return _DATA + slots * slot_bytes


def _is_ring(link: str) -> bool:
    return link.startswith(f"/memfd:{NAME} ")


class OutboundRing:
    """The sender's side: a memfd of ``slots`` slots of ``slot_bytes`` each.

    ``release_after_s``: give the pages back once the ring has been idle this long (0: never);
    the timer runs on the event loop that ``put`` is called on.
    """

    def __init__(self, slots: int, slot_bytes: int, *, release_after_s: float = 0.0) -> None:
        if slots < 1 or slots > _DATA - _STATES or slot_bytes < 1:
            raise ValueError(f"A shared ring needs 1..{_DATA - _STATES} slots of at least one byte.")
        self.slots, self.slot_bytes = slots, slot_bytes
        self.token = os.urandom(TOKEN_BYTES)
        self._fd = os.memfd_create(NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, _size(slots, slot_bytes))
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _SEALS)  # its size is fixed for good
            self._map = mmap.mmap(self._fd, _size(slots, slot_bytes))
        except OSError:
            os.close(self._fd)
            raise
        self._map[:TOKEN_BYTES] = self.token
        self._states = np.frombuffer(self._map, dtype=np.uint8, count=slots, offset=_STATES)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8, offset=_DATA)
        self._attached = False
        self._server: RingServer | None = None
        self.release_after_s = release_after_s
        self._touched = 0  # slots below this may hold pages: written since the last release
        self._puts = 0  # payloads put, ever; the idle check compares it with its last look
        self._puts_seen = 0
        self._timer: asyncio.TimerHandle | None = None
        self.released_bytes = 0  # bytes of slots given back, resident or not, ever (for tests and benchmarks)

    def serve(self, server: RingServer) -> None:
        """Offers this ring's memfd on ``server`` too, for receivers in other PID namespaces."""
        self._server = server
        server.add(self.token, self._fd)

    def offer(self) -> peer_pb2.SharedRing:
        """What goes into the HELLO."""
        return peer_pb2.SharedRing(pid=os.getpid(), fd=self._fd, token=self.token, boot_id=boot_id(),
                                   slots=self.slots, slot_bytes=self.slot_bytes,
                                   socket=self._server.name if self._server is not None else "")

    @property
    def attached(self) -> bool:
        """Whether the receiver has mapped the ring (it wrote the token back)."""
        if not self._attached and self._fd >= 0:
            self._attached = bytes(self._map[_ECHO : _ECHO + TOKEN_BYTES]) == self.token
        return self._attached

    def put(self, payload: bytes | memoryview | np.ndarray) -> int | None:
        """Copies payload into a free slot and returns its index; None if it must go in the frame."""
        if not self.attached:
            return None
        data = np.frombuffer(payload, dtype=np.uint8) if not isinstance(payload, np.ndarray) else payload
        nbytes = data.nbytes
        if nbytes == 0 or nbytes > self.slot_bytes:
            return None
        # The lowest free slot: the memfd's pages are only allocated when first written, so a
        # ring costs the memory of the most slots ever in use at once, not of all of them.
        slot = int(np.argmin(self._states))
        if self._states[slot] != FREE:
            return None
        start = slot * self.slot_bytes
        target = self._bytes[start : start + nbytes]
        if data.dtype == np.uint8 and data.ndim == 1:
            target[:] = data
        else:
            target.view(data.dtype)[:] = data.reshape(-1)
        self._states[slot] = WRITTEN
        self._puts += 1
        if slot >= self._touched:
            self._touched = slot + 1
        if self._timer is None and self.release_after_s > 0:
            self._arm()
        return slot

    def release(self) -> int:
        """Gives back the pages of every slot written since the last release, if every slot is
        free (none is named in a frame the receiver may still read); returns the bytes released."""
        if self._fd < 0 or not self._touched or self._states.any():
            return 0
        end = min(_DATA + self._touched * self.slot_bytes, len(self._map))
        length = -(-(end - _DATA) // mmap.PAGESIZE) * mmap.PAGESIZE  # _DATA is a whole page
        self._map.madvise(mmap.MADV_REMOVE, _DATA, min(length, len(self._map) - _DATA))
        released, self._touched = end - _DATA, 0
        self.released_bytes += released
        return released

    def _arm(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # put outside a loop (a test): no timer, release() by hand
            return
        self._timer = loop.call_later(self.release_after_s, self._idle_check)

    def _idle_check(self) -> None:
        """Releases the pages if nothing was put since the last look and every slot is free; else
        looks again later. Once released, the next put arms the timer again."""
        self._timer = None
        if self._fd < 0 or not self._touched:
            return
        if self._puts != self._puts_seen or self._states.any():
            self._puts_seen = self._puts
            self._arm()
            return
        self.release()

    def close(self) -> None:
        """Closes the memfd and unmaps the ring; the memory goes once the receiver unmaps it too."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._fd >= 0:
            if self._server is not None:
                self._server.remove(self.token)  # before the fd's number can name another file
                self._server = None
            os.close(self._fd)
            self._fd = -1
            self._attached = False
            del self._states, self._bytes  # the views that pin the mapping
            self._map.close()

    @property
    def closed(self) -> bool:
        return self._fd < 0


class InboundRing:
    """The receiver's side: the predecessor's ring, mapped here."""

    def __init__(self, offer: peer_pb2.SharedRing, mapping: mmap.mmap) -> None:
        self.slots, self.slot_bytes = offer.slots, offer.slot_bytes
        self._map = mapping
        self._states = np.frombuffer(mapping, dtype=np.uint8, count=self.slots, offset=_STATES)
        self._leases: dict[int, weakref.ref[np.ndarray]] = {}
        self._pid = os.getpid()  # a forked child (a DataLoader worker) inherits the mapping: it frees nothing
        self._closing = False

    @classmethod
    def attach(cls, offer: peer_pb2.SharedRing, *, shared_dir: str = "", timeout_s: float = 5.0) -> InboundRing | None:
        """Maps the ring a HELLO offers, or returns None where this process cannot share it.

        The memfd comes from the sender's ring server in ``shared_dir`` when the offer names one
        (this may block for ``timeout_s``: call it on a thread then), else through /proc.
        """
        if not offer.token or offer.boot_id != boot_id() or not supported():
            return None
        if not (0 < offer.slots <= _DATA - _STATES) or not (0 < offer.slot_bytes <= 1 << 30):
            return None
        fd = None
        if offer.socket and shared_dir:
            fd = fdpass.fetch(shared_dir, offer.socket, offer.token, timeout_s)
        if fd is None:
            fd = _open_by_pid(offer)
        if fd is None:
            return None
        try:
            mapping = _map_ring(fd, _size(offer.slots, offer.slot_bytes))
        finally:
            os.close(fd)
        if mapping is None:
            return None
        if mapping[:TOKEN_BYTES] != offer.token:  # some other process's file at that path
            mapping.close()
            return None
        mapping[_ECHO : _ECHO + TOKEN_BYTES] = offer.token
        return cls(offer, mapping)

    def payload(self, header: wire.FrameHeader) -> memoryview:
        """A view of the payload a frame names; its slot is freed once no view of it is left."""
        slot, nbytes = header.shm_slot, header.shm_bytes
        if slot >= self.slots or not 0 < nbytes <= self.slot_bytes:
            raise ProtocolError(
                f"A frame names {nbytes} bytes in slot {slot} of a shared ring of {self.slots} slots "
                f"of {self.slot_bytes} bytes."
            )
        if slot in self._leases:
            raise ProtocolError(f"A frame names slot {slot} of the shared ring while it is still in use.")
        start = _DATA + slot * self.slot_bytes
        view = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=start)
        view.flags.writeable = False  # the sender's memory: read, never written
        self._leases[slot] = weakref.ref(view, functools.partial(self._free, slot))
        return memoryview(view)  # type: ignore[arg-type]

    @property
    def closed(self) -> bool:
        return self._map.closed

    def close(self) -> None:
        """Unmaps the ring now, or, while payload views are still alive, once the last is dropped."""
        self._closing = True
        if not self._leases:
            self._unmap()

    def _unmap(self) -> None:
        if self._map.closed:
            return
        self._states = np.zeros(0, dtype=np.uint8)  # drops the view that pins the mapping
        # A view of a payload that outlived its lease (kept by a caller) refuses the close: the GC unmaps.
        with contextlib.suppress(BufferError):
            self._map.close()

    def _free(self, slot: int, _: object = None) -> None:
        self._leases.pop(slot, None)
        if not self._closing:
            if os.getpid() == self._pid:
                self._states[slot] = FREE
        elif not self._leases:
            # Called while the last view dies, which still pins the mapping: unmap just after.
            with contextlib.suppress(RuntimeError):  # no loop (a test, a thread): the GC unmaps it
                asyncio.get_running_loop().call_soon(self._unmap)


def _open_by_pid(offer: peer_pb2.SharedRing) -> int | None:
    """The sender's memfd through /proc/<pid>/fd/<fd>, opened only if it names a ring."""
    path = f"/proc/{offer.pid}/fd/{offer.fd}"
    try:
        if not _is_ring(os.readlink(path)):  # never open anything but a ring
            return None
        return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        log.debug("shared ring %s not reachable: %s", path, exc)
        return None


def _map_ring(fd: int, size: int) -> mmap.mmap | None:
    """Maps ``fd`` if it is a sealed ring of ``size`` bytes: what was opened (or received), not
    what a path named a moment before."""
    try:
        info = os.fstat(fd)
        if (not _is_ring(os.readlink(f"/proc/self/fd/{fd}")) or not stat.S_ISREG(info.st_mode)
                or info.st_size != size or fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS):
            return None
        return mmap.mmap(fd, size)
    except OSError:
        return None
