"""One end of a payload lane's connection: a non-blocking TCP socket on the worker's event loop,
with TLS as a filter over it (``ssl.SSLObject`` on memory BIOs) when the job runs with TLS.

Why not asyncio's transports, or ``loop.sock_sendall``:

- **The lane decides what it holds.** It sends straight from the caller's array (a collective's
  input, or its result buffer) and keeps a view of what the kernel did not take, until a flush
  (tcplane.py); ``try_send`` gives the kernel what it takes now, a frame's header and payload in
  one ``sendmsg``. A transport would copy the rest (asyncio) or keep it where the lane could not
  account for it (uvloop).
- **The receiver reads straight into its own buffer**: ``recv_into`` for plaintext, and
  ``SSLObject.read(n, buffer)`` under TLS, which decrypts into it (``read_nowait``, called from
  the loop's readiness callback: lanein.py).
- **The same code under TLS and without it.** TLS is a filter: ``seal`` encrypts a payload into
  bytes of the lane's own (so nothing of the caller's is kept), and ``read_exact`` decrypts. A
  ``ssl.SSLSocket`` would need blocking sockets and threads, which the worker's one loop avoids.

Every socket is tuned the way the gRPC channels are (transport.py): TCP keepalive and a user
timeout of KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS, so a lane whose peer vanished without a FIN
fails within the same bound as a stream; and no Nagle delay.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable, Sequence
from typing import cast

from ringserve.transport import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS

MAGIC = b"RSLANE1\0"  # what a receiver sends first, before its token: the lane's protocol and version
TOKEN_BYTES = 16
ATTACHED = b"A"  # the sender's answer to a good token; a bad one is closed without an answer
TLS_RECORD = 0x16  # the first byte of a TLS handshake record (a ClientHello)
PREFIX = 4  # a frame on the lane: its encoded header's length (little-endian), the header, the payload
_SCRATCH = 256 << 10  # ciphertext read at once under TLS


class LaneClosed(ConnectionError):
    """The other end closed the lane (or ended its TLS session) while bytes were still due."""


def tune(sock: socket.socket) -> None:
    """Non-blocking, no Nagle delay, and the gRPC channels' bound on a silent peer."""
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's keepalive timing holds
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, KEEPALIVE_TIME_MS // 1000))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, KEEPALIVE_TIMEOUT_MS // 1000))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS)


class LaneSocket:
    """A connected, tuned, non-blocking socket, optionally under TLS; used on one event loop.

    Example::

        conn = LaneSocket(sock)                      # plaintext
        conn = LaneSocket(sock, context.wrap_bio(incoming, outgoing, server_side=True), incoming, outgoing)
        await conn.handshake()
    """

    def __init__(self, sock: socket.socket, tls: ssl.SSLObject | None = None,
                 incoming: ssl.MemoryBIO | None = None, outgoing: ssl.MemoryBIO | None = None) -> None:
        self.sock = sock
        self.tls = tls
        self._in = incoming
        self._out = outgoing
        self._scratch = memoryview(bytearray(_SCRATCH)) if tls is not None else memoryview(b"")
        self._loop = asyncio.get_running_loop()
        self._fd = sock.fileno()
        self._waiter: asyncio.Future[None] | None = None

    @classmethod
    def wrap(cls, sock: socket.socket, context: ssl.SSLContext | None, *, server_side: bool,
             server_hostname: str | None = None) -> LaneSocket:
        """``sock`` as a lane socket, under TLS with ``context`` when one is given."""
        if context is None:
            return cls(sock)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = context.wrap_bio(incoming, outgoing, server_side=server_side, server_hostname=server_hostname)
        return cls(sock, tls, incoming, outgoing)

    @property
    def peer(self) -> str:
        try:
            host, port = self.sock.getpeername()[:2]
        except OSError:
            return "?"
        return f"{host}:{port}"

    def close(self) -> None:
        """Closes the socket; a read or write waiting on it fails with LaneClosed."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        self._loop.remove_reader(fd)  # before the fd is closed, whose number may be reused at once
        self._loop.remove_writer(fd)
        self.sock.close()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(LaneClosed("the lane was closed"))

    @property
    def closed(self) -> bool:
        return self._fd < 0

    # -- readiness ---------------------------------------------------------------------------

    async def readable(self) -> None:
        await self._ready(writing=False)

    async def writable(self) -> None:
        await self._ready(writing=True)

    async def _ready(self, *, writing: bool) -> None:
        if self._fd < 0:
            raise LaneClosed("the lane is closed")
        fut: asyncio.Future[None] = self._loop.create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        fd = self._fd
        if writing:
            self._loop.add_writer(fd, wake)
        else:
            self._loop.add_reader(fd, wake)
        self._waiter = fut
        try:
            await fut
        finally:
            self._waiter = None
            if self._fd == fd:  # not closed meanwhile (close removed it then)
                if writing:
                    self._loop.remove_writer(fd)
                else:
                    self._loop.remove_reader(fd)

    # -- raw bytes ---------------------------------------------------------------------------

    def try_send(self, data: bytes | memoryview) -> int:
        """Gives the kernel what it takes of ``data`` now; returns how many bytes that was.

        Raises:
            OSError: the connection broke (reset, a broken pipe).
        """
        try:
            return self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0

    def try_send_parts(self, parts: Sequence[bytes | memoryview]) -> int:
        """``try_send`` of several buffers in one system call (``sendmsg``), in order."""
        try:
            return self.sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            return 0

    def watch(self, closed: Callable[[], None]) -> None:
        """Calls ``closed`` (once) if the peer closes or resets the connection, or sends anything:
        for a sender, which reads nothing after the token (a TLS peer sends nothing either)."""
        fd = self._fd

        def readable() -> None:
            if self._fd != fd:
                return
            try:
                self.sock.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                pass
            self._loop.remove_reader(fd)
            closed()

        self._loop.add_reader(fd, readable)

    async def send_all(self, data: bytes | memoryview) -> None:
        """Sends every byte of ``data`` (bytes of the lane's own: it may wait for room)."""
        view = memoryview(data)
        while view.nbytes:
            sent = self.try_send(view)
            view = view[sent:]
            if view.nbytes:
                await self.writable()

    async def recv_into(self, view: memoryview) -> int:
        """Reads what has arrived (waiting for something) into ``view``; 0 at the peer's end."""
        while True:
            try:
                return self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                await self.readable()

    # -- payloads, through TLS when it is on ---------------------------------------------------

    def seal(self, data: bytes | memoryview) -> bytes | memoryview:
        """What goes on the wire for ``data``: itself in plaintext, else its TLS records (bytes
        of the lane's own, made now: nothing of ``data`` is kept)."""
        if self.tls is None:
            return data
        assert self._out is not None
        self.tls.write(data)  # into a memory BIO, which takes everything at once
        return self._out.read()

    def seal_parts(self, *parts: bytes | memoryview) -> bytes:
        """The TLS records of ``parts`` one after the other (under TLS only): one buffer, no joining copy."""
        assert self.tls is not None and self._out is not None
        for part in parts:
            if len(part):
                self.tls.write(part)
        return self._out.read()

    def read_nowait(self, view: memoryview) -> int | None:
        """Reads what has arrived into ``view``, decrypted under TLS, without waiting: the number of
        bytes, 0 at the lane's end, None when nothing is there yet.

        Raises:
            OSError, ssl.SSLError: the connection broke, or its TLS records are damaged.
        """
        if self.tls is None:
            try:
                return self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                return None
        assert self._in is not None
        while True:
            try:
                return cast(int, self.tls.read(view.nbytes, view))
            except ssl.SSLWantReadError:
                try:
                    n = self.sock.recv_into(self._scratch)
                except (BlockingIOError, InterruptedError):
                    return None
                if n == 0:
                    return 0
                self._in.write(self._scratch[:n])
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    def on_readable(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` whenever the socket is readable, until the lane is closed."""
        self._loop.add_reader(self._fd, callback)

    async def read_exact(self, view: memoryview) -> None:
        """Fills ``view`` with the next ``len(view)`` bytes of the lane.

        Raises:
            LaneClosed: the lane ended first.
            OSError, ssl.SSLError: the connection broke, or its TLS records are damaged.
        """
        got, total = 0, view.nbytes
        while got < total:
            if self.tls is None:
                n = await self.recv_into(view[got:])
                if n == 0:
                    raise LaneClosed(f"the lane closed {total - got} bytes short of a payload of {total}")
                got += n
                continue
            try:
                n = cast(int, self.tls.read(total - got, view[got:]))  # with a buffer: a count
            except ssl.SSLWantReadError:
                await self._flush()  # a TLS 1.3 key update may want an answer
                await self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                raise LaneClosed(f"the lane's TLS session ended {total - got} bytes short of a payload of {total}") from None
            else:
                if n == 0:
                    raise LaneClosed(f"the lane's TLS session ended {total - got} bytes short of a payload of {total}")
                got += n

    async def handshake(self) -> None:
        """Runs the TLS handshake (nothing to do in plaintext).

        Raises:
            ssl.SSLError: the peer's certificate or protocol was refused, or it refused ours.
            LaneClosed: the peer closed the connection during the handshake.
        """
        if self.tls is None:
            return
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
        await self._flush()

    async def _flush(self) -> None:
        assert self._out is not None
        if self._out.pending:
            await self.send_all(self._out.read())

    async def _fill(self) -> None:
        """Reads some ciphertext into the TLS object's incoming BIO."""
        assert self._in is not None
        n = await self.recv_into(self._scratch)
        if n == 0:
            self._in.write_eof()
            raise LaneClosed("the peer closed the lane during TLS")
        self._in.write(self._scratch[:n])
