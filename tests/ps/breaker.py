"""A TCP proxy on loopback that breaks plaintext gRPC calls on cue, as a dying peer does.

A shard advertises the proxy's port (``advertise_port``), so its clients' calls run through the
proxy. The proxy reads HTTP/2 frame by frame both ways (it forwards whole frames, so what it adds
never lands inside one), notes the newest stream the client opened, and counts the DATA bytes
that stream carries, either way. Armed with :meth:`arm`, once a stream has carried
``after_bytes`` it breaks it mid-call (``times`` streams in all, one after another), in one of
these ways:

- ``reset``: resets the TCP connection both ways (SO_LINGER 0), as a peer that vanished; gRPC
  gives the call INTERNAL ("Internal error from Core": a send of the client's failed first) or
  UNAVAILABLE ("Connection reset by peer": the status came first), as the race goes;
- ``rst_stream``: resets the stream with HTTP/2's INTERNAL_ERROR towards the client and cancels it
  towards the server, as a dying server's transport does; the call gets INTERNAL ("Stream
  removed"), always; the connection lives on.

With ``down_s``, after each break the proxy resets every connection made for that long, as a
shard that is not back yet (new calls get UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM = 0x0, 0x1, 0x3
CANCEL, INTERNAL_ERROR = 0x8, 0x2
FAULTS = ("reset", "rst_stream")


def frame(kind: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, 0]) + stream.to_bytes(4, "big") + payload


def reset(writer: asyncio.StreamWriter) -> None:
    """Closes a connection with a TCP RST rather than a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass(eq=False)
class _Connection:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    stream: int = 0       # the newest stream the client opened
    carried: int = 0      # its DATA bytes, both ways


@dataclass(eq=False)
class Breaker:
    """The proxy (see the module docstring). ``broken`` counts the faults made."""

    target_port: int = 0
    down: bool = False
    broken: int = 0
    _fault: str = ""
    _after: int = 0
    _times: int = 0
    _down_s: float = 0.0
    _up: asyncio.TimerHandle | None = None
    _server: asyncio.Server | None = None
    _connections: set[_Connection] = field(default_factory=set)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> int:
        """Listens on 127.0.0.1; returns the port (set ``target_port`` before the first client dials)."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def arm(self, fault: str, after_bytes: int, *, times: int = 1, down_s: float = 0.0) -> None:
        """Breaks the next ``times`` streams that carry ``after_bytes`` of DATA, each then down for ``down_s``."""
        assert fault in FAULTS and times > 0, (fault, times)
        self._fault, self._after, self._times, self._down_s = fault, after_bytes, times, down_s

    def cut(self) -> None:
        """Resets every connection now."""
        for connection in list(self._connections):
            self._drop(connection)

    async def close(self) -> None:
        if self._up is not None:
            self._up.cancel()
        if self._server is not None:
            self._server.close()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            reset(writer)
            return
        connection = _Connection(writer, up_writer)
        self._connections.add(connection)
        for pump in (self._pump(reader, connection, upstream=True), self._pump(up_reader, connection, upstream=False)):
            task = asyncio.get_running_loop().create_task(pump)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, connection: _Connection, *, upstream: bool) -> None:
        writer = connection.server if upstream else connection.client
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            if upstream:
                writer.write(await reader.readexactly(len(PREFACE)))
            while connection in self._connections:
                header = await reader.readexactly(9)
                payload = await reader.readexactly(int.from_bytes(header[:3], "big"))
                writer.write(header + payload)  # one write: a frame of ours never lands inside it
                await writer.drain()
                kind, stream = header[3], int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
                if upstream and kind == HEADERS and stream > connection.stream:  # ids only grow
                    connection.stream, connection.carried = stream, 0
                elif kind == DATA and stream == connection.stream:
                    connection.carried += len(payload)
                    if self._fault and connection.carried >= self._after:
                        self._break(connection)
        self._drop(connection)

    def _break(self, connection: _Connection) -> None:
        fault = self._fault
        self._times -= 1
        if not self._times:
            self._fault = ""
        self.broken += 1
        if fault == "reset":
            self._drop(connection)
        else:
            connection.server.write(frame(RST_STREAM, connection.stream, CANCEL.to_bytes(4, "big")))
            connection.client.write(frame(RST_STREAM, connection.stream, INTERNAL_ERROR.to_bytes(4, "big")))
            connection.stream = 0  # what is still under way on it is not counted as another stream
        if self._down_s:
            self.down = True
            if self._up is not None:
                self._up.cancel()
            self._up = asyncio.get_running_loop().call_later(self._down_s, setattr, self, "down", False)

    def _drop(self, connection: _Connection) -> None:
        if connection in self._connections:
            self._connections.discard(connection)
            reset(connection.client)
            reset(connection.server)
