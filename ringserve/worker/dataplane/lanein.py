"""The receiver's side of a TCP payload lane (tcplane.py): dialling the sender's payload port, and
reading payloads into pooled buffers that the reduction reads from.

A verified stream whose HELLO offers a lane gets an ``InboundLane``, which dials at once, in a task
of its own, while the stream's frames go on being read (their payloads are in them until the
sender hears the token). Within ``timeout_s`` it must connect, finish TLS and send its token; past
that, or on any failure before the token is sent, the edge keeps the stream (``fell_back``), and
the sender, which never saw the token, never uses the lane. Once the token is sent the receiver
never closes the lane on its own: the sender may already be writing to it. If the sender's answer
takes longer than the deadline, the fallback is logged, and the lane still attaches if the answer
comes (a sender whose loop was held up); if the sender closes instead, it refused the token.

``read(n)`` is called by the stream for each header that names lane bytes, in order: it fills a
pooled buffer with the next ``n`` bytes (``recv_into``, or TLS decrypting into it) and returns a
read-only view. The buffer goes back to the pool when the last view of it is dropped (a weak
reference, as the shared ring frees its slots), so a buffer is never written while a collective
still reads it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import weakref
from collections.abc import Callable

import numpy as np

from ringserve.errors import PeerUnavailableError, ProtocolError
from ringserve.worker.dataplane.lanesock import ATTACHED, MAGIC, LaneClosed, LaneSocket, tune

POOLED_MIN = 256 << 10  # smaller payloads take a fresh buffer: cheap, and no chunk-sized block held
KEEP = 8  # free buffers the pool keeps


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
    """One stream's lane from its sender: dialled at creation, read by the stream in order."""

    def __init__(self, *, host: str, port: int, token: bytes, context: ssl.SSLContext | None, server_name: str,
                 timeout_s: float, buffers: LaneBuffers, max_bytes: int, fell_back: Callable[[str], None],
                 attached_late: Callable[[], None]) -> None:
        self.host, self.port = host, port
        self._token = token
        self._context = context
        self._server_name = server_name
        self.timeout_s = timeout_s
        self._buffers = buffers
        self._max_bytes = max_bytes
        self._fell_back = fell_back
        self._attached_late = attached_late
        self.conn: LaneSocket | None = None
        self.failure = ""  # why the lane did not attach ("" while it may)
        self.required = False  # set by a stream that waits for it (``ready``): it reports the failure
        loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[LaneSocket] = loop.create_future()
        self._task = loop.create_task(self._connect(), name="ringserve-lane-dial")

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def attached(self) -> bool:
        return self._ready.done() and not self._ready.cancelled() and self._ready.exception() is None

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                conn = await self._dial()
        except TimeoutError:
            return self._fail(f"it did not connect and take the token within {self.timeout_s:g} s "
                              "(RINGSERVE_PAYLOAD_CONNECT_TIMEOUT_S): a firewall or a NAT drops the port")
        except ssl.SSLCertVerificationError as exc:
            return self._fail(f"its TLS certificate was refused ({exc.verify_message})")
        except ssl.SSLError as exc:
            return self._fail(f"TLS failed ({exc.reason or exc}): the lane may not speak TLS, or refused this "
                              "worker's certificate")
        except (OSError, LaneClosed) as exc:
            return self._fail(f"the connection failed ({_why(exc)})")
        # The token is out: from here on the sender may write to the lane at any moment.
        answer = bytearray(1)
        reading = loop.create_task(conn.read_exact(memoryview(answer)))
        late = False
        try:
            done, _ = await asyncio.wait([reading], timeout=max(0.0, deadline - loop.time()))
            if not done:
                late = True
                self._fell_back(f"it did not answer the token within {self.timeout_s:g} s; the lane attaches "
                                "if the answer comes")
            await reading
        except (OSError, ssl.SSLError, LaneClosed) as exc:
            return self._fail(f"it closed the connection on the token ({exc}): a wrong or spent token, or "
                              "not a ringserve payload lane", logged=late)
        finally:
            reading.cancel()
        if bytes(answer) != ATTACHED:
            return self._fail(f"it answered the token with {bytes(answer)!r}, not a lane's answer", logged=late)
        if late:
            self._attached_late()
        self._ready.set_result(conn)

    async def _dial(self) -> LaneSocket:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            tune(sock)
            self.conn = LaneSocket(sock)
            await loop.sock_connect(sock, address)
            if self._context is not None:
                self.conn = LaneSocket.wrap(sock, self._context, server_side=False, server_hostname=self._server_name)
                await self.conn.handshake()
            await self.conn.send_all(self.conn.seal(MAGIC + self._token))
        except BaseException:
            self.conn = None
            sock.close()
            raise
        return self.conn

    def _fail(self, why: str, *, logged: bool = False) -> None:
        self.failure = why
        if self.conn is not None:
            self.conn.close()
        if not logged and not self.required:
            self._fell_back(why)
        self._ready.set_exception(ProtocolError(
            f"A frame names bytes on the payload lane at {self.where}, which did not attach: {why}."))
        self._ready.exception()  # retrieved by read() if a frame ever needs it

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
        except ProtocolError:
            raise ConnectionError(self.failure) from None

    async def read(self, nbytes: int) -> memoryview:
        """The next ``nbytes`` of the lane, in a pooled buffer, read-only.

        Raises:
            ProtocolError: the size is out of bounds, or the lane never attached.
            PeerUnavailableError: the lane broke (or ended) before the payload was complete.
        """
        if not 0 < nbytes <= self._max_bytes:
            raise ProtocolError(f"A frame names {nbytes} bytes on the payload lane; a payload holds at most "
                                f"{self._max_bytes} (a chunk and its header).")
        conn = await self._ready
        view = self._buffers.take(nbytes)
        try:
            await conn.read_exact(memoryview(view))  # type: ignore[arg-type]
        except (OSError, ssl.SSLError, LaneClosed) as exc:
            raise PeerUnavailableError(f"The payload lane from {self.where} broke: {exc}.") from None
        view.flags.writeable = False
        return memoryview(view)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stops dialling and closes the connection (``wait_closed`` then waits for the dial task)."""
        self._task.cancel()
        if self.conn is not None:
            self.conn.close()
        if not self._ready.done():
            self._ready.cancel()

    async def wait_closed(self) -> None:
        """Waits for the dial task to end, after ``close``."""
        await asyncio.wait([self._task])
