"""One end of a payload lane's connection: a TCP socket, under TLS (an ``ssl.SSLSocket``) when the
job runs with TLS. The loop attaches it here, non-blocking (connect, handshake, token, answer);
an attached lane's bytes are then moved by a thread of its own (lanes/tcp/threads.py).

Why not asyncio's transports, or ``loop.sock_sendall``:

- **The lane decides what it holds.** It sends straight from the caller's array (a collective's
  input, or its result buffer) and keeps a view of what the kernel did not take, until a flush
  (lanes/tcp/outbound.py); the writer gives the kernel a frame's header and payload in one ``sendmsg``. A
  transport would copy the rest (asyncio) or keep it where the lane could not account for it
  (uvloop).
- **The receiver reads straight into its own buffer**: ``recv_into`` (lanes/tcp/threads.py's
  ``read_into``, on the reader's thread); under TLS a sealed record is opened into it.
- **TLS for the handshake, sealed records after it.** A TLS lane runs its handshake, token and
  answer through ``ssl.SSLSocket`` (OpenSSL reads and writes the socket itself: no copies of our
  own), then leaves TLS (``leave_tls``) and carries records of up to a MiB sealed under a key that
  the session carried (lanes/tcp/seal.py says why). (Memory BIOs, the other way Python offers, cost two
  more copies of every byte, which measured 2.6x the plaintext lane's CPU.)

Every socket is tuned the way the gRPC channels are (transport.py): TCP keepalive and a user
timeout of KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS, so a lane whose peer vanished without a FIN
fails within the same bound as a stream; and no Nagle delay.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable

from ringserve.errors import ProtocolError
from ringserve.transport import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS

MAGIC = b"RSLANE2\0"  # what a receiver sends first, before its token: the lane's protocol and version
# (2: a TLS lane's answer carries the key of its sealed records; a worker of version 1 is refused, and
# its edge keeps the stream)
TOKEN_BYTES = 16
ATTACHED = b"A"  # the sender's answer to a good token
REFUSED = b"N"  # its answer to a token no lane offers (or one spent): the receiver does not dial again
TLS_RECORD = 0x16  # the first byte of a TLS handshake record (a ClientHello)
PREFIX = 4  # a frame on the lane: its encoded header's length (little-endian), the header, the payload


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


def congestion(sock: socket.socket, name: str) -> str:
    """Sets the TCP congestion control ``name`` on ``sock`` (``system``: leaves the host's);
    returns "" once set, or why the kernel refused it (the host's then stays)."""
    if name == "system" or not hasattr(socket, "TCP_CONGESTION"):
        return ""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


class LaneSocket:
    """A connected, tuned, non-blocking socket, plain or TLS; used on one event loop.

    Example:
        ```python
        conn = LaneSocket(sock)                                # plaintext
        conn.start_tls(context, server_side=True)              # then TLS, over the same fd
        await conn.handshake()
        ```
    """

    def __init__(self, sock: socket.socket, *, tls: bool = False) -> None:
        self.sock = sock
        self.tls = tls  # under TLS now (an ssl.SSLSocket)
        self._loop = asyncio.get_running_loop()
        self._fd = sock.fileno()
        self._waiter: asyncio.Future[None] | None = None

    def start_tls(self, context: ssl.SSLContext, *, server_side: bool, server_hostname: str | None = None) -> None:
        """Puts this connection under TLS with ``context`` (the same file descriptor, now owned by
        an ``ssl.SSLSocket``); the handshake is ``handshake``'s."""
        self.sock = context.wrap_socket(self.sock, server_side=server_side, server_hostname=server_hostname,
                                        do_handshake_on_connect=False, suppress_ragged_eofs=False)
        self.tls = True

    def leave_tls(self) -> None:
        """Drops the TLS session and keeps its connection, plain again: its next bytes are sealed
        records (lanes/tcp/seal.py). Nothing that follows the session's last record is lost: OpenSSL reads
        a record's header and then its body, never further (it reads ahead only when told to).

        Raises:
            ProtocolError: the session holds bytes that were not read (the peer sent more than its answer).
        """
        sock = self.sock
        assert isinstance(sock, ssl.SSLSocket), "only a connection under TLS leaves it"
        if sock.pending():
            raise ProtocolError(f"The payload lane's TLS session ended with {sock.pending()} unread bytes.")
        self.sock = socket.socket(sock.family, sock.type, sock.proto, fileno=sock.detach())  # same fd, no alert sent
        self.tls = False

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

    # -- sending -------------------------------------------------------------------------------

    def try_send(self, data: bytes | memoryview) -> int:
        """Gives the kernel what it takes of ``data`` now; returns how many bytes that was. Under
        TLS a send that could not finish must be retried with the same bytes (the queue does).

        Raises:
            OSError, ssl.SSLError: the connection broke (reset, a broken pipe, a TLS alert).
        """
        try:
            return self.sock.send(data)
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return 0

    async def send_all(self, data: bytes | memoryview) -> None:
        """Sends every byte of ``data`` (bytes of the lane's own: it may wait for room)."""
        view = memoryview(data)
        while view.nbytes:
            sent = self.try_send(view)
            view = view[sent:]
            if view.nbytes:
                await self.writable()

    def watch(self, closed: Callable[[], None]) -> None:
        """Calls ``closed`` (once) if the peer closes or resets the connection, or sends anything:
        for a sender, which reads nothing after the token, and whose writes are a thread's
        (lanes/tcp/threads.py), so the socket may be blocking. Under TLS any byte at all means the end
        (an alert, close_notify, or the FIN): the receiver sends nothing after its token, and the
        loop must not touch the TLS session the writer thread uses."""
        fd = self._fd

        def readable() -> None:
            if self._fd != fd:
                return
            if not self.tls:
                try:
                    self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    pass
            self._loop.remove_reader(fd)
            closed()

        self._loop.add_reader(fd, readable)

    # -- receiving -----------------------------------------------------------------------------

    async def recv_into(self, view: memoryview) -> int:
        """Reads what has arrived (waiting for something) into ``view``; 0 at the peer's end."""
        while True:
            n = self.read_nowait(view)
            if n is not None:
                return n
            await self.readable()

    def read_nowait(self, view: memoryview) -> int | None:
        """Reads what has arrived into ``view``, decrypted under TLS, without waiting: the number of
        bytes, 0 at the lane's end, None when nothing is there yet.

        Raises:
            OSError, ssl.SSLError: the connection broke, or its TLS records are damaged.
        """
        try:
            return self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return None
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            return 0

    async def read_exact(self, view: memoryview) -> None:
        """Fills ``view`` with the next ``len(view)`` bytes of the lane.

        Raises:
            LaneClosed: the lane ended first.
            OSError, ssl.SSLError: the connection broke, or its TLS records are damaged.
        """
        got, total = 0, view.nbytes
        while got < total:
            n = await self.recv_into(view[got:])
            if n == 0:
                raise LaneClosed(f"the lane closed {total - got} bytes short of {total}")
            got += n

    async def handshake(self) -> None:
        """Runs the TLS handshake (nothing to do in plaintext).

        Raises:
            ssl.SSLError: the peer's certificate or protocol was refused, or it refused ours.
            LaneClosed, OSError: the peer closed the connection during the handshake.
        """
        if not self.tls:
            return
        assert isinstance(self.sock, ssl.SSLSocket)
        while True:
            try:
                self.sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                await self.readable()
            except ssl.SSLWantWriteError:
                await self.writable()
            except ssl.SSLEOFError:
                raise LaneClosed("the peer closed the connection during the TLS handshake") from None
