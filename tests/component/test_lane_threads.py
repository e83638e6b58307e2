"""The payload lane's I/O threads (lanes/tcp/threads.py) over real socket pairs: in order, whatever the
descriptor's mode, and stopped at once by close."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np

from ringserve.worker.dataplane.lanes.tcp.threads import Writer, read_into


def _drain(sock: socket.socket, total: int, out: bytearray) -> None:
    while len(out) < total:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return
        out += chunk


async def test_a_writer_sends_every_buffer_in_order_even_when_its_socket_turns_non_blocking() -> None:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        progress: list[int] = []
        errors: list[BaseException] = []
        writer = Writer(a, sealer=None, loop=loop, on_progress=progress.append, on_error=errors.append)
        a.setblocking(False)  # what uvloop's add_reader does to the descriptor under the thread
        parts = [memoryview(np.full(1 << 20, i, dtype=np.uint8)) for i in range(16)]
        got = bytearray()
        reader = threading.Thread(target=_drain, args=(b, 16 << 20, got))
        reader.start()
        queued = sum(1 - writer.put([p]) for p in parts)  # none is small: all go to the thread
        await asyncio.to_thread(reader.join, 30)
        async with asyncio.timeout(10):
            while not progress or progress[-1] < queued:
                await asyncio.sleep(0.01)
        writer.close()
        await asyncio.wait_for(writer.done, 10)
    assert errors == []
    assert bytes(got) == b"".join(bytes(p) for p in parts)


async def test_a_small_frame_with_nothing_queued_leaves_from_the_loop_at_once() -> None:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    with a, b:
        writer = Writer(a, sealer=None, loop=loop, on_progress=lambda _: None, on_error=lambda _: None)
        assert writer.put([memoryview(b"head"), memoryview(b"payload")]) == 2
        assert b.recv(64) == b"headpayload"
        writer.close()
        await asyncio.wait_for(writer.done, 10)


async def test_close_wakes_a_writer_blocked_on_a_peer_that_reads_nothing() -> None:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    with a, b:
        errors: list[BaseException] = []
        writer = Writer(a, sealer=None, loop=loop, on_progress=lambda _: None, on_error=errors.append)
        writer.put([memoryview(bytes(32 << 20))])  # far more than the socket buffers hold
        await asyncio.sleep(0.2)
        assert not writer.done.done()
        writer.close()
        await asyncio.wait_for(writer.done, 5)
    assert errors == []  # a close is not a failure


async def test_read_into_waits_on_a_non_blocking_socket_and_stops_once_closing() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        view = memoryview(bytearray(8))
        reading = asyncio.ensure_future(asyncio.to_thread(read_into, b, view, 0, lambda: False))
        await asyncio.sleep(0.1)
        assert not reading.done()  # nothing yet: it waits, it does not fail
        a.sendall(b"abc")
        assert await asyncio.wait_for(reading, 5) == 3 and bytes(view[:3]) == b"abc"
        stop = threading.Event()
        reading = asyncio.ensure_future(asyncio.to_thread(read_into, b, view, 0, stop.is_set))
        stop.set()
        assert await asyncio.wait_for(reading, 5) == 0
