"""The receiver's side of a TCP payload lane (lanes/tcp/outbound.py): dialling the sender's payload port, and
reading its frames, payloads into pooled buffers that the reduction reads from.

A verified stream whose HELLO offers a lane gets an ``InboundLane``, which dials at once, in a task
of its own, while the stream's frames go on being read (the sender sends on the stream until it
hears the token). Within ``timeout_s`` it must connect, finish TLS and send its token; past that,
or on any failure before the token is sent, the edge keeps the stream (``fell_back``), and the
sender, which never saw the token, never uses the lane. Once the token is sent the receiver never
closes the lane on its own: the sender may already be writing to it. If the sender's answer takes
longer than the deadline, the fallback is logged, and the lane still attaches if the answer comes
(a sender whose loop was held up); if the sender closes instead, it refused the token.

Under TLS, the sender's answer carries the key of its sealed records, and both ends leave TLS
(lanes/tcp/seal.py). Attached, the lane is read on a thread of its own (lanes/tcp/threads.py's ``Reader``) by a
``FrameParser`` (lanes/tcp/frames.py): headers through a staging buffer (many small frames in one
read), a payload straight into a pooled buffer, every complete frame handed to the loop, where
``on_frame`` routes it as the stream would, until the sender's end marker (``finished``) or a
break (``on_broken``). A pooled buffer returns to the pool when the last view of it is dropped
(a weak reference, as the shared ring frees its slots), so a buffer is never written while a
collective still reads it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
from collections.abc import Callable

from ringserve.errors import PeerUnavailableError, ProtocolError
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.lanes.tcp.frames import POOLED_MIN, FrameParser, LaneBuffers
from ringserve.worker.dataplane.lanes.tcp.seal import KEY_BYTES, Opener, read_exactly
from ringserve.worker.dataplane.lanes.tcp.sockets import ATTACHED, MAGIC, REFUSED, LaneClosed, LaneSocket, tune
from ringserve.worker.dataplane.lanes.tcp.threads import Reader, read_into

log = logging.getLogger("ringserve.worker")

# A connection closed before the sender's answer is dialled again this many times in all, after
# pauses doubling from DIAL_PAUSE_S, within the one deadline (payload_connect_timeout_s).
DIAL_ATTEMPTS = 4
DIAL_PAUSE_S = 0.05

__all__ = ["POOLED_MIN", "InboundLane", "LaneBuffers"]

def _drop(_: object) -> None:
    pass


def _why(exc: BaseException) -> str:
    """An OSError as its system message ("Connection refused"), without asyncio's wording."""
    if isinstance(exc, OSError) and exc.errno is not None and not isinstance(exc, LaneClosed):
        return os.strerror(exc.errno)
    return str(exc)


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
        self._key: bytes | None = None  # of a TLS lane's sealed records, from the sender's answer
        self._reader: Reader | None = None  # the thread that reads the attached lane (lanes/tcp/threads.py)
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
            if not self._ready.done():  # closed (cancelled) while dialling
                # An error, not a cancellation: a stream waiting in ``ready`` was not cancelled,
                # and must fail as for any lane that did not attach (issue 40).
                self.failure = self.failure or "the lane was closed while it dialled"
                self._ready.set_exception(ConnectionError(self.failure))
                self._ready.exception()  # retrieved: ``ready`` raises it
        if conn is None:
            self._finish(True)  # nothing came on the lane, nothing is owed
            return
        loop = asyncio.get_running_loop()
        reader = self._reader = Reader(conn.sock, lambda deliver: self._parse(conn, loop, deliver), loop=loop,
                                       on_frame=self._delivered)
        try:
            await asyncio.wait([reader.done])  # the thread reads until the end, a break or close()
        finally:
            if not reader.done.done():  # cancelled (the loop ends): stop the thread before the socket goes
                reader.close()
                await asyncio.wait([reader.done])
            conn.close()
            # The reader and this lane hold each other, and this lane holds the stream's route (its
            # plane, the plane's links, their gRPC channels): let go of the route once the lane is
            # over, so that a closed worker's channels go with their last reference, not at the
            # next garbage collection (until then gRPC's poller thread outlives hvd.shutdown()).
            self._on_frame = self._on_broken = _drop

    def _parse(self, conn: LaneSocket, loop: asyncio.AbstractEventLoop, deliver: Callable[[Received], None]) -> None:
        """On the reader's thread: every frame of the lane to ``deliver``, until its end or a break,
        either told to the loop."""
        sock = conn.sock

        def closing() -> bool:
            return self._reader is not None and self._reader.closing

        def read_plain(view: memoryview, whole: bool, landed: bool) -> int:
            return read_into(sock, view, socket.MSG_WAITALL if whole else 0, closing)

        read = read_plain
        if self._key is not None:  # a TLS lane: sealed records, each read whole
            opener = Opener(self._key, read_exactly(lambda view: read_plain(view, True, False)), self.where)
            read = lambda view, whole, landed: opener.read(view, private=not landed)  # noqa: E731

        def broken(exc: BaseException) -> None:
            loop.call_soon_threadsafe(self._break, exc)

        def ended() -> None:
            loop.call_soon_threadsafe(self._finish, True)

        def stop() -> None:  # from the loop: a collective ended while a payload was read into its result
            if self._reader is not None:
                self._reader.close()

        FrameParser(read, self._buffers, self._max_bytes, self.where, deliver, broken, ended, stop).pump()

    async def _connect(self) -> LaneSocket | None:
        """The connection once the sender answered the token; None if the lane did not attach.

        A connection closed before the answer (the payload port evicts waiting connections under
        a flood: lanes/tcp/server.py) is dialled again, ``DIAL_ATTEMPTS`` times at most, within
        the one deadline; a refused certificate or TLS that does not match is not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        pause = DIAL_PAUSE_S
        for attempt in range(1, DIAL_ATTEMPTS + 1):
            outcome = await self._attempt(deadline)
            if isinstance(outcome, LaneSocket):
                self._ready.set_result(outcome)
                return outcome
            why, again, logged = outcome
            if not again or attempt == DIAL_ATTEMPTS or loop.time() + pause >= deadline:
                self._fail(why, logged=logged)
                return None
            log.debug("the payload lane to %s: %s; dialling again (%d of %d)", self.where, why, attempt + 1,
                      DIAL_ATTEMPTS)
            await asyncio.sleep(pause)
            pause *= 2
        raise AssertionError("unreachable")

    async def _attempt(self, deadline: float) -> LaneSocket | tuple[str, bool, bool]:
        """One dial: the attached connection, or (why not, worth another dial?, said already?)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                conn = await self._dial()
        except TimeoutError:
            return (f"it did not connect and take the token within {self.timeout_s:g} s "
                    "(RINGSERVE_PAYLOAD_CONNECT_TIMEOUT_S): a firewall or a NAT drops the port", False, False)
        except ssl.SSLCertVerificationError as exc:
            return f"its TLS certificate was refused ({exc.verify_message})", False, False
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:  # closed in the handshake: evicted, perhaps
            return f"the connection closed in the TLS handshake ({exc.reason or exc})", True, False
        except ssl.SSLError as exc:
            return (f"TLS failed ({exc.reason or exc}): the lane may not speak TLS, or refused this "
                    "worker's certificate", False, False)
        except (OSError, LaneClosed) as exc:  # closed on us (evicted, perhaps): again; refused, unreachable: no
            again = isinstance(exc, (LaneClosed, ConnectionResetError, BrokenPipeError, ConnectionAbortedError))
            return f"the connection failed ({_why(exc)})", again, False
        # The token is out: from here on the sender may write to the lane at any moment.
        answer = bytearray(len(ATTACHED) + (KEY_BYTES if conn.tls else 0))  # under TLS, with the key

        async def read_answer() -> None:
            await conn.read_exact(memoryview(answer)[:len(ATTACHED)])  # REFUSED is as long: said whole
            if answer[:len(ATTACHED)] == ATTACHED and conn.tls:
                await conn.read_exact(memoryview(answer)[len(ATTACHED):])

        reading = loop.create_task(read_answer())
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
            self._drop_conn()
            # Closed with no answer: evicted while it waited (dial again); an alert (a refused client
            # certificate) or a reset on a refused hello is the port's word (do not).
            closed = isinstance(exc, (LaneClosed, ssl.SSLEOFError, ssl.SSLZeroReturnError, ConnectionResetError))
            return (f"it closed the connection on the token ({exc}): evicted under a flood, a refused "
                    "certificate, or not a ringserve payload lane", closed and not late, late)
        finally:
            reading.cancel()
        if bytes(answer[:len(ATTACHED)]) == REFUSED:
            self._drop_conn()
            return "it refused the token: a wrong or spent token", False, late
        if bytes(answer[:len(ATTACHED)]) != ATTACHED:
            self._drop_conn()
            return f"it answered the token with {bytes(answer[:len(ATTACHED)])!r}, not a lane's answer", False, late
        if conn.tls:
            try:
                conn.leave_tls()
            except ProtocolError as exc:
                self._drop_conn()
                return str(exc), False, late
            self._key = bytes(answer[len(ATTACHED):])
        if late:
            self._attached_late()
        return conn

    def _drop_conn(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

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
        """Stops dialling or reading; the connection closes once the reader's thread is out of it
        (``wait_closed`` waits for that)."""
        self._finish(False)
        if self._reader is not None:
            self._reader.close()  # the task ends with the thread, and closes the socket
            return
        self._task.cancel()
        if self.conn is not None:
            self.conn.close()

    async def wait_closed(self) -> None:
        """Waits for the reading task to end, after ``close``."""
        await asyncio.wait([self._task])
