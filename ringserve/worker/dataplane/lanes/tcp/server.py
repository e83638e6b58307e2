"""A worker's payload port: the one listener of its TCP payload lanes, and the TLS it speaks.

Every lane this worker offers (one per link, see lanes/tcp/outbound.py) is a token in this server's table. A
receiver connects, finishes TLS when the job runs with it, and sends ``MAGIC`` and a token; the
server hands the connection to the lane with that token, which answers ``ATTACHED`` and from then
on writes its payloads there (under TLS, the answer carries the key of the lane's sealed records,
and both ends leave TLS: lanes/tcp/seal.py). The token is spent on first use.

Nothing that has not presented a valid token reaches a lane, and the port never affects the job:

- a connection must present its token within ``hello_timeout_s`` (the peer server's
  ``peer_hello_timeout_s``, the bound on a gRPC connection's handshake too), or it is closed;
- at most ``cap`` connections may be waiting to do so (``max_unverified_streams``); a new one past
  it closes the oldest that has sent nothing yet (a squatter), or, when every one has, the
  oldest: a receiver speaks at once (its ClientHello, or its hello), so a flood of silent
  connections cannot evict a member in the middle of its handshake, and squatters cannot keep one
  out. A connection whose token matched is no longer waiting and is never evicted. A receiver
  evicted all the same dials again within its deadline (lanes/tcp/inbound.py);
- garbage, a wrong token, a token already spent, a TLS client on a plaintext lane or a plaintext
  one on a TLS lane are closed at once and counted (``Counters.lane_refused``), with the reason
  logged once per kind. The tokens are compared in constant time.

TLS is the gRPC server's (security.py): the same certificate and key, the same CA, and the same
client-auth rule (``tls_require_client_auth``); a receiver verifies the lane's certificate as its
channel verifies the peer server's, against the same name.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import socket
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from ringserve.errors import ProtocolError
from ringserve.handshake import pem_file
from ringserve.observe import Counters
from ringserve.security import Security
from ringserve.worker.dataplane.lanes.tcp.seal import KEY_BYTES
from ringserve.worker.dataplane.lanes.tcp.sockets import (
    ATTACHED,
    MAGIC,
    REFUSED,
    TLS_RECORD,
    TOKEN_BYTES,
    LaneClosed,
    LaneSocket,
    congestion,
    tune,
)

if TYPE_CHECKING:
    from ringserve.worker.dataplane.lanes.tcp.outbound import OutboundLane

log = logging.getLogger("ringserve.worker")

BACKLOG = 128


class _Waiting:
    """A connection waiting for its token: whether it has sent anything yet."""

    __slots__ = ("spoke",)

    def __init__(self) -> None:
        self.spoke = False


def server_context(security: Security) -> ssl.SSLContext | None:
    """The lane server's TLS, as the gRPC server's: None when this worker serves plaintext."""
    if security.cert is None or security.key is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    with pem_file(security.cert + b"\n" + security.key) as path:
        ctx.load_cert_chain(path)
    if security.ca is not None:
        ctx.load_verify_locations(cadata=security.ca.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED if security.require_client_auth else ssl.CERT_NONE
    ctx.num_tickets = 0  # a lane's session is never resumed, and leaves TLS after its answer (lanes/tcp/seal.py)
    return ctx


def client_context(security: Security) -> ssl.SSLContext | None:
    """A receiver's TLS towards a lane, as its gRPC channels': None in plaintext."""
    if not security.tls:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if security.ca is not None:
        ctx.load_verify_locations(cadata=security.ca.decode())
    else:
        ctx.load_default_certs()
    if security.cert is not None and security.key is not None:
        with pem_file(security.cert + b"\n" + security.key) as path:
            ctx.load_cert_chain(path)
    return ctx


class LaneServer:
    """The payload port: accepts receivers and hands each to the lane whose token it presents."""

    def __init__(self, host: str, port: int, *, context: ssl.SSLContext | None, hello_timeout_s: float,
                 cap: int, counters: Counters, tag: Callable[[], str], congestion: str = "system") -> None:
        self.context = context
        self.congestion = congestion  # the TCP congestion control lanes send with (config.py)
        self.hello_timeout_s = hello_timeout_s
        self.cap = cap
        self.counters = counters
        self._tag = tag
        self._offers: list[OutboundLane] = []
        self._pending: dict[asyncio.Task[None], _Waiting] = {}  # admissions under way, oldest first
        self._said: set[str] = set()  # kinds of refusal logged already
        self._loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host.strip("[]"), port))
            listener.listen(BACKLOG)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self.port = int(listener.getsockname()[1])
        self._listener: socket.socket | None = listener
        self._loop.add_reader(listener.fileno(), self._accept)

    @property
    def tls(self) -> bool:
        return self.context is not None

    def offer(self, lane: OutboundLane) -> None:
        """Lets the receiver with ``lane``'s token attach to it."""
        self._offers.append(lane)

    def withdraw(self, lane: OutboundLane) -> None:
        """Forgets ``lane``'s token (attached, or closed)."""
        with contextlib.suppress(ValueError):
            self._offers.remove(lane)

    @property
    def waiting(self) -> int:
        """Connections accepted that have not presented a token yet."""
        return len(self._pending)

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds: the receiver falls back, and says so
                self._refused("accept", f"the payload port could not accept a connection ({exc})")
                return
            try:
                tune(sock)
            except OSError:  # reset before we got to it
                sock.close()
                continue
            refused = congestion(sock, self.congestion)
            if refused and "congestion" not in self._said:
                self._said.add("congestion")
                log.warning("%s: the payload lane keeps the host's TCP congestion control: %s refused "
                            "(%s; RINGSERVE_PAYLOAD_CONGESTION)", self._tag(), self.congestion, refused)
            while len(self._pending) >= self.cap:  # make room: a squatter goes (it closes itself)
                victim = self._victim()
                victim.cancel()
                del self._pending[victim]
                self._refused("evicted", f"a connection to the payload port sent no token while {self.cap} "
                              "others waited (max_unverified_streams); the oldest silent one was closed")
            waiting = _Waiting()
            task = self._loop.create_task(self._admit(sock, waiting), name="ringserve-lane-admit")
            self._pending[task] = waiting
            task.add_done_callback(self._admitted)

    def _victim(self) -> asyncio.Task[None]:
        """The connection to close to make room: the oldest that has sent nothing, else the oldest."""
        for task, waiting in self._pending.items():
            if not waiting.spoke:
                return task
        return next(iter(self._pending))

    def _admitted(self, task: asyncio.Task[None]) -> None:
        self._pending.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: the payload port's admission failed", self._tag(), exc_info=task.exception())

    async def _admit(self, sock: socket.socket, waiting: _Waiting) -> None:
        """Reads the receiver's hello within the deadline and hands the connection to its lane;
        closes it otherwise (cancelled: evicted, or the server closes)."""
        plain = LaneSocket(sock)
        conn: LaneSocket | None = plain
        handed = False
        try:
            async with asyncio.timeout(self.hello_timeout_s):
                conn = await self._handshake(plain, waiting)
                if conn is None:
                    return
                hello = bytearray(len(MAGIC) + TOKEN_BYTES)
                await conn.read_exact(memoryview(hello))
                if bytes(hello[: len(MAGIC)]) != MAGIC:
                    self._refused("garbage", "a connection to the payload port sent something other than a lane hello")
                    return
                lane = self._match(bytes(hello[len(MAGIC):]))
                if lane is None:
                    self._refused("token", "a connection to the payload port presented a token that no lane offers")
                    with contextlib.suppress(OSError, ssl.SSLError, LaneClosed):
                        await conn.send_all(REFUSED)  # said, so that the receiver does not dial again
                    return
                self.withdraw(lane)  # spent, even if what follows fails
                self._pending.pop(asyncio.current_task(), None)  # type: ignore[arg-type]  # verified: not evicted
                key = None
                if conn.tls:  # the answer and the key of the lane's sealed records, inside the session
                    key = secrets.token_bytes(KEY_BYTES)
                    await conn.send_all(ATTACHED + key)
                    conn.leave_tls()
            handed = lane.attach(conn, key=key)
        except TimeoutError:
            self._refused("silent", f"a connection to the payload port presented no token within "
                          f"{self.hello_timeout_s:g} s (peer_hello_timeout_s) and was closed")
        except (OSError, ssl.SSLError, LaneClosed, ProtocolError) as exc:
            self._refused("broken", f"a connection to the payload port failed before its token: {exc}")
        finally:
            if not handed:
                (conn or plain).close()

    async def _handshake(self, conn: LaneSocket, waiting: _Waiting) -> LaneSocket | None:
        """The connection after TLS if this lane speaks it; None if refused (and closed)."""
        sock = conn.sock
        await conn.readable()
        waiting.spoke = True
        try:
            first = sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            first = b""
        if not first:
            raise LaneClosed("the peer closed the connection before its hello")
        if self.context is None:
            if first[0] == TLS_RECORD:
                self._refused("tls-client", "a TLS client reached this plaintext payload lane and was refused: "
                              "the workers disagree on TLS (tls_cert, tls_ca)")
                conn.close()
                return None
            return conn
        if first[0] != TLS_RECORD:
            self._refused("plaintext-client", "a plaintext client reached this TLS payload lane and was refused: "
                          "a worker of a TLS job needs tls_ca (and tls_cert/tls_key under mTLS)")
            conn.close()
            return None
        conn.start_tls(self.context, server_side=True)
        await conn.handshake()
        return conn

    def _match(self, token: bytes) -> OutboundLane | None:
        found = None
        for lane in self._offers:  # every offer compared, in constant time each
            if hmac.compare_digest(lane.token, token):
                found = lane
        return found

    def _refused(self, kind: str, message: str) -> None:
        self.counters.lane_refused += 1
        if kind not in self._said:
            self._said.add(kind)
            log.warning("%s: %s (logged once; every refusal is counted in lane_refused)", self._tag(), message)
        else:
            log.debug("%s: %s", self._tag(), message)

    async def close(self) -> None:
        """Stops accepting, and closes the connections that have not attached."""
        listener, self._listener = self._listener, None
        if listener is not None:
            self._loop.remove_reader(listener.fileno())
            listener.close()
        tasks = list(self._pending)
        self._pending.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)  # each closes its own connection
        self._offers.clear()
