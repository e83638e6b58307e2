"""A payload lane's frames as they come off the socket (``FrameParser``), and the pooled buffers
their payloads are read into (``LaneBuffers``): the receiving half of the lane's format,
``[u32 length][encoded header][payload]`` (tcplane.py).

The parser reads through a function it is given, so the same code parses on the lane's reader
thread (lanethreads.py, blocking reads) and in tests. The pool is shared by a worker's lanes,
taken from on their reader threads and given back on whichever thread drops a payload's last view:
``list.pop`` and ``append`` are atomic, and a pool found empty allocates.
"""

from __future__ import annotations

import logging
import ssl
import weakref
from collections.abc import Callable

import numpy as np

from ringserve import wire
from ringserve.errors import ProtocolError
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.lanesock import PREFIX, LaneClosed

log = logging.getLogger("ringserve.worker")

POOLED_MIN = 256 << 10  # smaller payloads take a fresh buffer: cheap, and no chunk-sized block held
KEEP = 8  # free buffers the pool keeps
MAX_HEADER = 64 << 10  # an encoded frame header: a few hundred bytes (an abort's descriptors, a few KiB)
STAGING = 256 << 10  # the staging buffer: room for the largest header and then some
STAGED_READ = 64 << 10  # read at most this much into it at once: many small frames, and at most this
# much of a large payload copied out of it (the rest goes straight into the payload's own buffer)


class LaneBuffers:
    """Chunk-sized receive buffers, reused once no view of them is left."""

    def __init__(self, size: int, *, keep: int = KEEP) -> None:
        self.size = size
        self.keep = keep
        self._free: list[np.ndarray] = []
        self.made = 0  # buffers allocated (for tests)

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
    The reader's thread runs it with blocking reads (lanethreads.py)."""

    def __init__(self, read: Callable[[memoryview, bool], int | None], buffers: LaneBuffers, max_bytes: int,
                 where: str, deliver: Callable[[Received], None], broken: Callable[[BaseException], None],
                 ended: Callable[[], None]) -> None:
        self._read = read  # (view, whole payload?) -> bytes read, 0 at the end, None: none yet
        self._buffers = buffers
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
            self._broken(exc)
        except Exception as exc:  # a bug on the receiving side: the lane stops, the stream's end says so
            log.exception("the payload lane from %s failed", self._where)
            self._done = True
            self._broken(ProtocolError(f"The payload lane from {self._where} failed: {type(exc).__name__}: {exc}"))

    def _step(self) -> bool:
        """One step: a frame parsed from what is staged, or more bytes read; False once the
        socket has nothing more for now (or the lane ended).

        Raises:
            LaneClosed: the lane ended in the middle of a frame.
            ProtocolError: a frame is malformed or too large.
        """
        if self._payload is not None:
            view = memoryview(self._payload)[self._got:]  # type: ignore[arg-type]
            n = self._read(view, True)
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
        n = self._read(self._stage[self._end : self._end + STAGED_READ], False)
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
                                f"holds at most {self._max_bytes} (a chunk and its header).")
        self._header, self._raw = header, raw
        self._payload = self._buffers.take(nbytes)
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
        payload.flags.writeable = False
        self._deliver(Received(header, memoryview(payload), self._raw))  # type: ignore[arg-type]
