"""A payload lane's frames as they come off the socket (``FrameParser``), the pooled buffers
their payloads are read into (``LaneBuffers``), and the results some payloads are read straight
into instead (``Landings``): the receiving half of the lane's format,
``[u32 length][encoded header][payload]`` (lanes/tcp/outbound.py).

The parser reads through a function it is given, so the same code parses on the lane's reader
thread (lanes/tcp/threads.py, blocking reads) and in tests. The pool is shared by a worker's lanes,
taken from on their reader threads and given back on whichever thread drops a payload's last view:
``list.pop`` and ``append`` are atomic, and a pool found empty allocates.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import weakref
from collections.abc import Callable

import numpy as np

from ringserve import wire
from ringserve.errors import ProtocolError
from ringserve.selection import WIDE_CHUNKS
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.lanes.tcp.sockets import PREFIX, LaneClosed
from ringserve.worker.dataplane.values import CHUNK_HINT

log = logging.getLogger("ringserve.worker")

POOLED_MIN = 256 << 10  # smaller payloads take a fresh buffer: cheap, and no chunk-sized block held
KEEP = 8  # free buffers the pool keeps
MAX_HEADER = 64 << 10  # an encoded frame header: a few hundred bytes (an abort's descriptors, a few KiB)
STAGING = 256 << 10  # the staging buffer: room for the largest header and then some
STAGED_READ = 64 << 10  # read at most this much into it at once: many small frames, and at most this
# much of a large payload copied out of it (the rest goes straight into the payload's own buffer)


# A payload smaller than this is copied from a pooled buffer rather than landed: the copy costs
# less than registering its region.
LAND_MIN = POOLED_MIN
Op = tuple[int, str]  # (view, collective key)
Spot = tuple[int, int]  # (slot, chunk): a frame forwarded round a ring keeps its author's header


class Landings:
    """Results that payloads may be read straight into: the regions of a collective's allgather
    frames (programs/__init__.py's ``Land``), offered by the loop before they can arrive, each claimed by a
    lane's reader thread when its frame's header names it, then filled by the socket's own copy.
    That spares the copy from a pooled buffer into the result (values.py's ``Raw.take`` sees that
    the payload already is its place): measured, that copy was 11% of a 64 MiB allreduce's CPU
    between hosts.

    A frame lands only if everything about it is as offered (view, key, slot, chunk, dtype, element
    count, bytes); anything else takes a pooled buffer and meets the usual checks. Its sender is not
    part of that (a frame forwarded round the ring names its author): a program receives each
    (slot, chunk) of a collective once, from one rank. The loop still checks the checksum, the
    descriptor and the sender before the frame is used: a damaged frame fails its collective as
    before (its region held bytes of a failed collective).
    When the collective ends, what was not claimed is withdrawn; a payload still being read into its
    region is waited for (``withdrawn``), and its lane is stopped if it does not finish, so no thread
    writes into a result after its collective has returned.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[Op, dict[Spot, tuple[np.ndarray, int, int]]] = {}
        self._reading: dict[Op, dict[Spot, Callable[[], None]]] = {}  # claimed, being read; how to stop its lane
        self.landed = 0  # payloads read straight into their place (for tests and the benchmarks)

    def offer(self, view: int, key: str, frames: list[tuple[int, int, np.ndarray]], dtype: int) -> None:
        """On the loop: frames (slot, chunk) of ``key`` may land in their regions."""
        spots = {(slot, chunk): (region.view(np.uint8), dtype, region.size) for slot, chunk, region in frames
                 if region.nbytes >= LAND_MIN and region.flags.c_contiguous and region.flags.writeable}
        if spots:
            with self._lock:
                self._open.setdefault((view, key), {}).update(spots)

    def claim(self, header: wire.FrameHeader, stop: Callable[[], None]) -> np.ndarray | None:
        """On a reader thread: the region the payload of ``header`` is to be read into, if one was
        offered and fits; ``stop`` ends the lane if the read never finishes."""
        op, spot = (header.view_id, header.op_key), (header.step, header.chunk)
        with self._lock:
            spots = self._open.get(op)
            found = spots.get(spot) if spots is not None else None
            if found is None:
                return None
            region, dtype, count = found
            if header.dtype != dtype or header.count != count or header.lane_bytes != region.nbytes:
                return None
            del spots[spot]  # type: ignore[union-attr]
            self._reading.setdefault(op, {})[spot] = stop
        return region

    def read(self, header: wire.FrameHeader, whole: bool = True) -> None:
        """On a reader thread: the payload of a claimed region was read (``whole``), or its lane failed."""
        op, spot = (header.view_id, header.op_key), (header.step, header.chunk)
        with self._lock:
            reading = self._reading.get(op)
            if reading is not None:
                reading.pop(spot, None)
                if not reading:
                    del self._reading[op]
            self.landed += whole

    def withdraw(self, view: int, key: str) -> bool:
        """On the loop, when a collective ends: forgets its unclaimed regions; False while a
        thread still reads into one of its regions."""
        with self._lock:
            self._open.pop((view, key), None)
            return (view, key) not in self._reading

    async def withdrawn(self, view: int, key: str, grace_s: float) -> None:
        """Waits until no thread reads into a region of ``key``: ``grace_s`` for the reads to end,
        then their lanes are stopped (a stalled sender), and the threads leave the socket at once."""
        loop = asyncio.get_running_loop()
        deadline, stopped = loop.time() + grace_s, False
        while True:
            with self._lock:
                reading = list(self._reading.get((view, key), {}).values())
            if not reading:
                return
            if not stopped and loop.time() > deadline:
                log.warning("collective %r ended while a payload lane was still reading into its result: "
                            "stopping that lane", key)
                for stop in reading:
                    stop()
                stopped, deadline = True, loop.time() + grace_s
            elif stopped and loop.time() > deadline:
                log.error("collective %r: a payload lane's thread did not leave its result within %.1f s", key,
                          2 * grace_s)
                return
            await asyncio.sleep(0.001)


class LaneBuffers:
    """Chunk-sized receive buffers, reused once no view of them is left; and the worker's
    ``Landings``, which its lanes share."""

    def __init__(self, size: int, *, keep: int = KEEP) -> None:
        self.size = size
        self.keep = keep
        self._free: list[np.ndarray] = []
        self.made = 0  # buffers allocated (for tests)
        self.landings = Landings()

    def take(self, nbytes: int) -> np.ndarray:
        """A writable array of ``nbytes`` bytes; its buffer comes back once it and its views die."""
        if nbytes < POOLED_MIN or nbytes > self.size:
            return np.empty(nbytes, dtype=np.uint8)
        try:
            buf = self._free.pop()  # atomic: the lanes' reader threads share the pool
        except IndexError:
            buf = self._new()
        view = buf[:nbytes]
        weakref.finalize(view, self._give_back, buf)
        return view

    def _new(self) -> np.ndarray:
        self.made += 1
        return np.empty(self.size, dtype=np.uint8)

    def _give_back(self, buf: np.ndarray) -> None:
        if len(self._free) < self.keep:
            self._free.append(buf)


class FrameParser:
    """The frames of an attached lane, read as they come (``pump``): headers through a staging
    buffer, a payload straight into its own buffer, each frame handed on once complete, until the
    lane ends (its end marker), breaks, or, with a non-blocking ``read``, has nothing more for now.
    The reader's thread runs it with blocking reads (lanes/tcp/threads.py)."""

    def __init__(self, read: Callable[[memoryview, bool, bool], int | None], buffers: LaneBuffers, max_bytes: int,
                 where: str, deliver: Callable[[Received], None], broken: Callable[[BaseException], None],
                 ended: Callable[[], None], stop: Callable[[], None] | None = None) -> None:
        # (view, whole payload?, into a landed result?) -> bytes read, 0 at the end, None: none yet
        self._read = read
        self._buffers = buffers
        self._stop = stop  # ends the lane (from the loop); None: payloads never land (laneframes.Landings)
        self._landing = False  # the payload being read is a landed one
        self._max_bytes = max_bytes
        self._where = where
        self._deliver = deliver
        self._broken = broken
        self._ended = ended
        self._stage = memoryview(bytearray(STAGING))
        self._start = self._end = 0  # the staged bytes not parsed yet
        self._header: wire.FrameHeader | None = None  # of the frame whose payload is being read
        self._raw = b""
        self._payload: np.ndarray | None = None
        self._got = 0
        self._done = False

    def pump(self) -> None:
        """Reads and hands on every frame the socket holds now."""
        if self._done:
            return
        try:
            while self._step():
                pass
        except (OSError, ssl.SSLError, LaneClosed, ProtocolError) as exc:
            self._done = True
            self._unland()
            self._broken(exc)
        except Exception as exc:  # a bug on the receiving side: the lane stops, the stream's end says so
            log.exception("the payload lane from %s failed", self._where)
            self._done = True
            self._unland()
            self._broken(ProtocolError(f"The payload lane from {self._where} failed: {type(exc).__name__}: {exc}"))

    def _unland(self) -> None:
        """A landed payload's read ended without the whole of it."""
        if self._landing and self._header is not None:
            self._landing = False
            self._buffers.landings.read(self._header, whole=False)

    def _step(self) -> bool:
        """One step: a frame parsed from what is staged, or more bytes read; False once the
        socket has nothing more for now (or the lane ended).

        Raises:
            LaneClosed: the lane ended in the middle of a frame.
            ProtocolError: a frame is malformed or too large.
        """
        if self._payload is not None:
            view = memoryview(self._payload)[self._got:]  # type: ignore[arg-type]
            n = self._read(view, True, self._landing)
            if n is None:
                return False
            if n == 0:
                raise LaneClosed(f"the lane closed {view.nbytes} bytes short of a payload")
            self._got += n
            if self._got == self._payload.nbytes:
                self._hand_on()
            return True
        if self._parse():
            return not self._done
        if self._start and self._end + STAGED_READ > self._stage.nbytes:  # room after what is staged
            kept = self._end - self._start
            self._stage[:kept] = self._stage[self._start : self._end]
            self._start, self._end = 0, kept
        n = self._read(self._stage[self._end : self._end + STAGED_READ], False, False)
        if n is None:
            return False
        if n == 0:
            if self._end > self._start:
                raise LaneClosed("the lane closed in the middle of a frame's header")
            raise LaneClosed("the lane closed without its end marker")
        self._end += n
        return True

    def _parse(self) -> bool:
        """Starts the next frame if its header is staged; False if more bytes are needed."""
        staged = self._end - self._start
        if staged < PREFIX:
            return False
        size = int.from_bytes(self._stage[self._start : self._start + PREFIX], "little")
        if not 0 < size <= MAX_HEADER:
            raise ProtocolError(f"A frame on the payload lane from {self._where} has a header of {size} bytes.")
        if staged < PREFIX + size:
            if PREFIX + size > self._stage.nbytes - self._start:  # make room for the whole header
                self._stage[: staged] = self._stage[self._start : self._end]
                self._start, self._end = 0, staged
            return False
        raw = bytes(self._stage[self._start + PREFIX : self._start + PREFIX + size])
        self._start += PREFIX + size
        header, _ = wire.decode(raw)
        if header.kind == wire.BYE:
            self._done = True
            self._ended()
            return True
        nbytes = header.lane_bytes
        if nbytes > self._max_bytes:
            raise ProtocolError(f"A frame on the payload lane from {self._where} names {nbytes} bytes; a payload "
                                f"holds at most {self._max_bytes} (the widest frame, {WIDE_CHUNKS} chunks, and its "
                                f"header){CHUNK_HINT}.")
        self._header, self._raw = header, raw
        region = (self._buffers.landings.claim(header, self._stop)
                  if self._stop is not None and nbytes >= LAND_MIN else None)
        self._landing = region is not None
        self._payload = region if region is not None else self._buffers.take(nbytes)
        have = min(self._end - self._start, nbytes)
        self._payload[:have] = np.frombuffer(self._stage, dtype=np.uint8, count=have, offset=self._start)
        self._start += have
        self._got = have
        if have == nbytes:
            self._hand_on()
        return True

    def _hand_on(self) -> None:
        assert self._header is not None and self._payload is not None
        payload, self._payload = self._payload, None
        header, self._header = self._header, None
        if self._landing:
            self._landing = False
            self._buffers.landings.read(header)
        payload.flags.writeable = False  # a landed one is the view offered, not the result itself
        self._deliver(Received(header, memoryview(payload), self._raw))  # type: ignore[arg-type]
