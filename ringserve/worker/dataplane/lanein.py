"""The receiver's side of a TCP payload lane (tcplane.py): dialling the sender's payload port, and
reading its frames, payloads into pooled buffers that the reduction reads from.

A verified stream whose HELLO offers a lane gets an ``InboundLane``, which dials at once, in a task
of its own, while the stream's frames go on being read (the sender sends on the stream until it
hears the token). Within ``timeout_s`` it must connect, finish TLS and send its token; past that,
or on any failure before the token is sent, the edge keeps the stream (``fell_back``), and the
sender, which never saw the token, never uses the lane. Once the token is sent the receiver never
closes the lane on its own: the sender may already be writing to it. If the sender's answer takes
longer than the deadline, the fallback is logged, and the lane still attaches if the answer comes
(a sender whose loop was held up); if the sender closes instead, it refused the token.

Attached, the lane is read from the loop's readiness callback (``FrameParser``): each time the
socket is readable, it reads what has come, headers through a staging buffer (many small frames
in one read), a payload straight into its own buffer, and hands every complete frame to
``on_frame``, which routes it as the stream would, until the sender's end marker (``finished``)
or a break (``on_broken``). No task wakes per frame, and the socket stays registered. A payload
goes into a pooled buffer, returned to the pool when the last view of it is dropped (a weak
reference, as the shared ring frees its slots), so a buffer is never written while a collective
still reads it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import weakref
from collections.abc import Callable

import numpy as np

from ringserve import wire
from ringserve.errors import PeerUnavailableError, ProtocolError
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.lanesock import ATTACHED, MAGIC, PREFIX, LaneClosed, LaneSocket, tune

log = logging.getLogger("ringserve.worker")

POOLED_MIN = 256 << 10  # smaller payloads take a fresh buffer: cheap, and no chunk-sized block held
KEEP = 8  # free buffers the pool keeps
MAX_HEADER = 64 << 10  # an encoded frame header: a few hundred bytes (an abort's descriptors, a few KiB)
STAGING = 256 << 10  # the staging buffer: room for the largest header and then some
STAGED_READ = 64 << 10  # read at most this much into it at once: many small frames, and at most this
# much of a large payload copied out of it (the rest goes straight into the payload's own buffer)


def _drop(_: object) -> None:
    pass


def _why(exc: BaseException) -> str:
    """An OSError as its system message ("Connection refused"), without asyncio's wording."""
    if isinstance(exc, OSError) and exc.errno is not None and not isinstance(exc, LaneClosed):
        return os.strerror(exc.errno)
    return str(exc)


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
        buf = self._free.pop() if self._free else self._new()
        view = buf[:nbytes]
        weakref.finalize(view, self._give_back, buf)
        return view

    def _new(self) -> np.ndarray:
        self.made += 1
        return np.empty(self.size, dtype=np.uint8)

    def _give_back(self, buf: np.ndarray) -> None:
        if len(self._free) < self.keep:
            self._free.append(buf)


class InboundLane:
    """One stream's lane from its sender: dialled at creation; once attached, its frames are read
    in order and handed to ``on_frame``, until the sender's end marker or a break (``on_broken``)."""

    def __init__(self, *, host: str, port: int, token: bytes, context: ssl.SSLContext | None, server_name: str,
                 timeout_s: float, buffers: LaneBuffers, max_bytes: int, fell_back: Callable[[str], None],
                 attached_late: Callable[[], None], on_frame: Callable[[Received], None] = _drop,
                 on_broken: Callable[[BaseException], None] = _drop) -> None:
        self.host, self.port = host, port
        self._token = token
        self._context = context
        self._server_name = server_name
        self.timeout_s = timeout_s
        self._buffers = buffers
        self._max_bytes = max_bytes
        self._fell_back = fell_back
        self._attached_late = attached_late
        self._on_frame = on_frame
        self._on_broken = on_broken
        self.conn: LaneSocket | None = None
        self.failure = ""  # why the lane did not attach ("" while it may)
        self.required = False  # set by a stream that waits for it (``ready``): it reports the failure
        self.frames = 0  # frames read from the lane
        loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[LaneSocket] = loop.create_future()
        self._over: asyncio.Future[bool] = loop.create_future()  # True: the end marker came; False: it broke
        self._task = loop.create_task(self._run(), name="ringserve-lane-reader")

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def attached(self) -> bool:
        return self._ready.done() and not self._ready.cancelled() and self._ready.exception() is None

    async def _run(self) -> None:
        try:
            conn = await self._connect()
        finally:
            if not self._ready.done():  # cancelled while dialling
                self._ready.cancel()
        if conn is None:
            self._finish(True)  # nothing came on the lane, nothing is owed
            return
        parser = FrameParser(conn, self._buffers, self._max_bytes, self.where, self._delivered, self._break,
                             lambda: self._finish(True))
        conn.on_readable(parser.pump)
        asyncio.get_running_loop().call_soon(parser.pump)  # what TLS decrypted already signals nothing

    async def _connect(self) -> LaneSocket | None:
        """The connection once the sender answered the token; None if the lane did not attach."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                conn = await self._dial()
        except TimeoutError:
            self._fail(f"it did not connect and take the token within {self.timeout_s:g} s "
                       "(RINGSERVE_PAYLOAD_CONNECT_TIMEOUT_S): a firewall or a NAT drops the port")
            return None
        except ssl.SSLCertVerificationError as exc:
            self._fail(f"its TLS certificate was refused ({exc.verify_message})")
            return None
        except ssl.SSLError as exc:
            self._fail(f"TLS failed ({exc.reason or exc}): the lane may not speak TLS, or refused this "
                       "worker's certificate")
            return None
        except (OSError, LaneClosed) as exc:
            self._fail(f"the connection failed ({_why(exc)})")
            return None
        # The token is out: from here on the sender may write to the lane at any moment.
        answer = bytearray(1)
        reading = loop.create_task(conn.read_exact(memoryview(answer)))
        late = False
        try:
            done, _ = await asyncio.wait([reading], timeout=max(0.0, deadline - loop.time()))
            if not done:
                late = True
                if not self.required:
                    self._fell_back(f"it did not answer the token within {self.timeout_s:g} s; the lane attaches "
                                    "if the answer comes")
            await reading
        except (OSError, ssl.SSLError, LaneClosed) as exc:
            self._fail(f"it closed the connection on the token ({exc}): a wrong or spent token, or "
                       "not a ringserve payload lane", logged=late)
            return None
        finally:
            reading.cancel()
        if bytes(answer) != ATTACHED:
            self._fail(f"it answered the token with {bytes(answer)!r}, not a lane's answer", logged=late)
            return None
        if late:
            self._attached_late()
        self._ready.set_result(conn)
        return conn

    async def _dial(self) -> LaneSocket:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            tune(sock)
        except BaseException:
            sock.close()
            raise
        conn = self.conn = LaneSocket(sock)
        try:
            await loop.sock_connect(sock, address)
            if self._context is not None:
                conn.start_tls(self._context, server_side=False, server_hostname=self._server_name)
                await conn.handshake()
            await conn.send_all(MAGIC + self._token)
        except BaseException:
            self.conn = None
            conn.close()
            raise
        return conn

    def _fail(self, why: str, *, logged: bool = False) -> None:
        self.failure = why
        if self.conn is not None:
            self.conn.close()
        if not logged and not self.required:
            self._fell_back(why)
        self._ready.set_exception(ConnectionError(why))
        self._ready.exception()  # retrieved: ``ready`` raises its own error

    def _delivered(self, frame: Received) -> None:
        self.frames += 1
        self._on_frame(frame)

    def _break(self, exc: BaseException) -> None:
        if self.conn is not None:
            self.conn.close()
        if not self._over.done():
            if not isinstance(exc, ProtocolError):
                exc = PeerUnavailableError(f"The payload lane from {self.where} broke: {_why(exc)}.")
            self._on_broken(exc)
        self._finish(False)

    def _finish(self, clean: bool) -> None:
        if not self._over.done():
            self._over.set_result(clean)

    async def ready(self) -> None:
        """Waits until the lane has attached, within the connect deadline; for a stream that requires
        it (RINGSERVE_PAYLOAD_LANE=tcp).

        Raises:
            ConnectionError: it did not attach (its ``failure`` says why).
        """
        self.required = True
        try:
            async with asyncio.timeout(self.timeout_s + 0.5):  # the dial's own deadline fires first
                await asyncio.shield(self._ready)
        except TimeoutError:
            self.failure = self.failure or f"it did not answer the token within {self.timeout_s:g} s"
            raise ConnectionError(self.failure) from None

    async def finished(self, timeout_s: float) -> bool:
        """Waits for the lane's end: True once the sender's end marker came (or the lane never
        attached: nothing was owed), False if it broke or did not end within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(self._over)
        except TimeoutError:
            return False

    def close(self) -> None:
        """Stops dialling or reading and closes the connection (``wait_closed`` waits for the task)."""
        self._task.cancel()
        if self.conn is not None:
            self.conn.close()
        self._finish(False)

    async def wait_closed(self) -> None:
        """Waits for the reading task to end, after ``close``."""
        await asyncio.wait([self._task])


class FrameParser:
    """The frames of an attached lane, read as they come: called by the loop whenever the socket is
    readable, it reads what is there, hands on each frame it completes, and returns when the
    socket has no more (``pump``)."""

    def __init__(self, conn: LaneSocket, buffers: LaneBuffers, max_bytes: int, where: str,
                 deliver: Callable[[Received], None], broken: Callable[[BaseException], None],
                 ended: Callable[[], None]) -> None:
        self.conn = conn
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
            n = self.conn.read_nowait(view)
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
        n = self.conn.read_nowait(self._stage[self._end : self._end + STAGED_READ])
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
