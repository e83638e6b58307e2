"""A TCP relay on loopback that can damage what passes through it: a test's stand-in for a bad link.

A worker advertises the relay's port (``advertise_port``) and binds another, so its ring
predecessor's stream runs through the relay. With ``flip_after`` set, the relay flips one byte of
the dialler's data inside the first run of that pattern it sees, and only once: the pattern is
chosen from a tensor's own bytes, so the byte that changes is tensor data, never a frame header,
and neither gRPC nor HTTP/2 nor TCP (whose checksum the kernel computes anew on the relay's side)
notices.
"""

from __future__ import annotations

import asyncio
import contextlib


class Relay:
    def __init__(self, target_port: int, flip_after: bytes = b"") -> None:
        self.target_port = target_port
        self.flip_after = flip_after
        self.flipped = 0
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
        for task in (self._pipe(reader, up_writer, damage=True), self._pipe(up_reader, writer, damage=False)):
            t = asyncio.get_running_loop().create_task(task)
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, damage: bool) -> None:
        try:
            while data := await reader.read(1 << 16):
                if damage and self.flip_after and not self.flipped:
                    data = self._flip(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def _flip(self, data: bytes) -> bytes:
        at = data.find(self.flip_after)
        if at < 0:
            return data
        damaged = bytearray(data)
        damaged[at + len(self.flip_after) // 2] ^= 0x40
        self.flipped += 1
        return bytes(damaged)
