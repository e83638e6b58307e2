"""A TCP relay on loopback that can damage what passes through it: a test's stand-in for a bad link.

A worker advertises the relay's port (``advertise_port``) and binds another, so its ring
predecessor's stream runs through the relay. With ``flip_after`` set, the relay flips one byte of
the dialler's data inside the first run of that pattern it sees, and only once: the pattern is
chosen from a tensor's own bytes, so the byte that changes is tensor data, never a frame header,
and neither gRPC nor HTTP/2 nor TCP (whose checksum the kernel computes anew on the relay's side)
notices.

With ``blackhole`` set (a byte pattern such as an RPC's path, which plaintext gRPC sends as is in
its headers), :meth:`cut` stands in for a route that drops one kind of traffic: connections that
carried the pattern are reset, and from then on their bytes, and those of every new connection
that carries it, go nowhere (no RST, no FIN: they just stop), while other connections (a health
probe's) pass. :meth:`heal` resets the blackholed connections, so that their clients dial again
(or leaves them stuck, as a route that came back leaves a connection in TCP's backoff).

With ``delay_s`` set, every byte is passed on ``delay_s`` after it arrived, both ways and in
order: a link with that much more latency than loopback's, and the same bandwidth.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Link:
    """One client connection through the relay: both writers, and whether it carried the pattern."""

    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    marked: bool = False
    stuck: bool = False  # its bytes go nowhere for good (see Relay.heal)


class Relay:
    def __init__(self, target_port: int, flip_after: bytes = b"", blackhole: bytes = b"", delay_s: float = 0.0) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.flip_after = flip_after
        self.flipped = 0
        self.blackhole = blackhole
        self.cutting = False
        self._links: set[_Link] = set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except (OSError, TimeoutError):
            writer.close()
            return
        link = _Link([writer, up_writer])
        self._links.add(link)
        for task in (self._pipe(reader, up_writer, link, damage=True), self._pipe(up_reader, writer, link, damage=False)):
            t = asyncio.get_running_loop().create_task(task)
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    def cut(self) -> None:
        """Resets the connections that carried the pattern, and blackholes them from now on."""
        self.cutting = True
        self._reset(marked_only=True)

    def heal(self, *, reset: bool = True) -> None:
        """Lets the pattern through again, on new connections. The connections blackholed so far
        are reset, or with ``reset=False`` stay blackholed, as a TCP connection that lived through
        an outage stays stuck in its retransmission backoff after the route is back."""
        self.cutting = False
        if reset:
            self._reset(marked_only=True)
            return
        for link in self._links:
            link.stuck = link.stuck or link.marked

    def _reset(self, *, marked_only: bool) -> None:
        for link in [k for k in self._links if k.marked or not marked_only]:
            self._links.discard(link)
            for writer in link.writers:
                writer.transport.abort()  # a reset, as a route change makes of a live connection

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link, *, damage: bool) -> None:
        if self.delay_s > 0:
            try:
                await self._delayed(reader, writer)
            finally:
                self._links.discard(link)
            return
        seen = b""  # the end of what came before: a pattern split across two reads is still seen
        try:
            while data := await reader.read(1 << 16):
                if damage and self.flip_after and not self.flipped:
                    data = self._flip(data)
                if damage and self.blackhole:
                    link.marked = link.marked or self.blackhole in seen + data
                    seen = (seen + data)[-len(self.blackhole):]
                if (link.marked and self.cutting) or link.stuck:
                    continue
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._links.discard(link)
            with contextlib.suppress(Exception):
                writer.close()

    async def _delayed(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Passes each read on ``delay_s`` after it arrived (reads go on meanwhile)."""
        loop = asyncio.get_running_loop()
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def hold() -> None:
            data = b"-"
            while data:
                try:
                    data = await reader.read(1 << 16)
                except OSError:
                    data = b""
                held.put_nowait((loop.time() + self.delay_s, data))

        async def release() -> None:
            while True:
                due, data = await held.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                try:
                    if not data:
                        writer.close()
                        return
                    writer.write(data)
                    await writer.drain()
                except OSError:
                    return

        with contextlib.suppress(asyncio.CancelledError):
            async with asyncio.TaskGroup() as group:
                group.create_task(hold())
                group.create_task(release())

    def _flip(self, data: bytes) -> bytes:
        at = data.find(self.flip_after)
        if at < 0:
            return data
        damaged = bytearray(data)
        damaged[at + len(self.flip_after) // 2] ^= 0x40
        self.flipped += 1
        return bytes(damaged)
