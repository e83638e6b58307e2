"""The payload lane's socket I/O, on threads of its own: one writer per outbound lane, one reader per
inbound lane, beside the worker's event loop.

Why threads: the lane's cost is the kernel's copies and, under TLS, the cipher; done on the loop
thread, they queue behind the collectives' Python and reductions, and the other way round. gloo
does its I/O on a thread of its own and gRPC in its core's threads. A blocking ``sendmsg`` or
``recv_into`` (and a TLS lane's sealing and opening, lanes/tcp/seal.py) releases the GIL for its whole
length, so a thread moves the bytes while the loop computes. Measured on a 2-core machine loaded by other
work, the lane on the loop thread got a third of the CPU the stream got there, and took 3.5x its
time under mTLS for the same CPU, because every thread competes for the cores and it had one.

What stays on the loop: attaching (connect, TLS handshake, token, answer: lanes/tcp/sockets.py), and
everything the plane does with a frame. What crosses between the threads:

- ``Writer``: the loop appends buffers (a frame's header, and a view of its payload) to a queue
  under a lock and the thread sends them in order (under TLS, sealed first into records of its
  own); a small frame with nothing queued goes at once from the loop (``MSG_DONTWAIT``, plaintext
  only), so that a small collective pays no thread switch. The thread tells the loop how many buffers are out (``on_progress``, coalesced: one
  call per batch), which frees their memory (lanes/tcp/outbound.py's ``flushed``) and makes room.
- ``Reader``: the thread parses frames (lanes/tcp/inbound.py's ``FrameParser``, now with blocking reads and
  ``MSG_WAITALL`` for a payload) and queues them; the loop routes them (``on_frame``, coalesced).
  At most ``MAX_UNROUTED`` frames wait for the loop: past that the thread waits, and TCP's window
  holds the sender.

The descriptor's mode is not the threads' to rely on: the loop watches the same descriptor
(lanes/tcp/sockets.py's ``watch``), and uvloop's ``add_reader`` makes it non-blocking again. So a thread's
send or read that finds the kernel not ready (``EAGAIN``, or OpenSSL's want-read/want-write)
waits for the descriptor with ``poll`` (``wait_ready``) and tries again, in either mode. The
threads only ever see plain sockets: a TLS lane has left TLS before they start (lanes/tcp/sockets.py).

Ending: ``close`` (from the loop) shuts the socket down, which wakes a thread blocked in it; the
thread then exits, and ``done`` resolves on the loop, which closes the descriptor. The threads are
daemons only so that a worker that was never closed cannot hold the interpreter at exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import select
import socket
import threading
from collections import deque
from collections.abc import Callable

from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.lanes.tcp.seal import OVERHEAD, RECORD, Sealer

BATCH = 64  # buffers one sendmsg hands the kernel (IOV_MAX is 1024)
SMALL = 64 << 10  # a frame at most this big, with nothing queued, is sent from the loop at once
MAX_UNROUTED = 64  # frames read and not yet routed by the loop; the reader waits beyond it
SEALED_OUT = 2 * (RECORD + OVERHEAD) + (64 << 10)  # a sealing writer's buffer: two whole records, and headers


class Writer:
    """Sends a lane's buffers in order, from a thread, with blocking sends; sealed into records
    first when it has a ``sealer`` (a TLS lane, lanes/tcp/seal.py)."""

    def __init__(self, sock: socket.socket, *, sealer: Sealer | None, loop: asyncio.AbstractEventLoop,
                 on_progress: Callable[[int], None], on_error: Callable[[BaseException], None]) -> None:
        self._sock = sock
        self._sealer = sealer
        self._out = memoryview(bytearray(SEALED_OUT)) if sealer is not None else memoryview(b"")
        self._loop = loop
        self._on_progress = on_progress
        self._on_error = on_error
        self._cv = threading.Condition()
        self._items: deque[memoryview] = deque()  # under _cv; the head may be partly sent
        self._closing = False
        self._sent = 0  # buffers sent, all told (written by the thread, read under _cv)
        self._told = False  # a progress call is on its way to the loop
        self.done: asyncio.Future[None] = loop.create_future()
        sock.setblocking(True)
        self._thread = threading.Thread(target=self._run, name="ringserve-lane-writer", daemon=True)
        self._thread.start()

    def put(self, parts: list[memoryview]) -> int:
        """Sends ``parts`` after what is queued; returns how many of them went at once (sent from
        the loop: a small frame with nothing queued, in plaintext), the rest being queued."""
        with self._cv:
            if self._closing:
                return len(parts)
            if not self._items and self._sealer is None and sum(p.nbytes for p in parts) <= SMALL:
                try:
                    sent = self._sock.sendmsg(parts, (), socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError as exc:
                    self._loop.call_soon(self._on_error, exc)
                    return len(parts)
                done = 0
                while done < len(parts) and sent >= parts[done].nbytes:
                    sent -= parts[done].nbytes
                    done += 1
                if done == len(parts):
                    return done
                parts = [parts[done][sent:], *parts[done + 1:]]
                self._items.extend(parts)
                self._cv.notify()
                return done
            self._items.extend(parts)
            self._cv.notify()
            return 0

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._items and not self._closing:
                        self._cv.wait()
                    if self._closing:
                        return
                    batch = list(itertools.islice(self._items, BATCH))
                sent = self._send(batch)
                with self._cv:
                    if self._closing:
                        return
                    done = 0
                    while self._items and sent >= self._items[0].nbytes:
                        sent -= self._items.popleft().nbytes
                        done += 1
                    if self._items and sent:
                        self._items[0] = self._items[0][sent:]
                    self._sent += done
                    tell = done > 0 and not self._told
                    self._told = self._told or tell
                if tell:
                    self._loop.call_soon_threadsafe(self._progress)
        except (OSError, ValueError) as exc:  # ValueError: closed under us
            with self._cv:
                closing = self._closing
            if not closing:
                self._loop.call_soon_threadsafe(self._on_error, exc)
        finally:
            self._loop.call_soon_threadsafe(_resolve, self.done)

    def _send(self, batch: list[memoryview]) -> int:
        """Waits until the kernel takes some of ``batch``, or the lane closes (0); returns the
        bytes of ``batch`` sent, from its start."""
        if self._sealer is not None:
            return self._seal_and_send(batch, self._sealer)
        while not self.closing:
            try:
                return self._sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                wait_ready(self._sock, write=True)
        return 0

    def _seal_and_send(self, batch: list[memoryview], sealer: Sealer) -> int:
        """Seals as much of ``batch`` as the buffer holds (a record per buffer, or per MiB of
        one) and sends all of it: the plaintext bytes sealed, or 0 if the lane closes meanwhile."""
        out, used, taken = self._out, 0, 0
        for item in batch:
            rest = item
            while rest.nbytes:
                took, wrote = sealer.seal(rest, out[used:])
                if not took:
                    break
                rest, used, taken = rest[took:], used + wrote, taken + took
            if rest.nbytes:
                break
        sealed = out[:used]
        while sealed.nbytes:
            if self.closing:
                return 0
            try:
                sealed = sealed[self._sock.send(sealed):]
            except (BlockingIOError, InterruptedError):
                wait_ready(self._sock, write=True)
        return taken

    @property
    def closing(self) -> bool:
        with self._cv:
            return self._closing

    def _progress(self) -> None:
        with self._cv:
            self._told = False
            sent = self._sent
        self._on_progress(sent)

    def close(self) -> None:
        """Stops the thread (a send blocked in the kernel is woken by the shutdown) and drops what
        is queued; ``done`` resolves once the thread is out of the socket."""
        with self._cv:
            self._closing = True
            self._items.clear()
            self._cv.notify()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)


class Reader:
    """Reads a lane's frames on a thread (``parse``: blocking, until the lane ends or breaks) and
    hands them to the loop."""

    def __init__(self, sock: socket.socket, parse: Callable[[Callable[[Received], None]], None], *,
                 loop: asyncio.AbstractEventLoop, on_frame: Callable[[Received], None]) -> None:
        self._sock = sock
        self._loop = loop
        self._on_frame = on_frame
        self._cv = threading.Condition()
        self._frames: deque[Received] = deque()
        self._told = False
        self._closing = False
        self.done: asyncio.Future[None] = loop.create_future()
        sock.setblocking(True)
        self._thread = threading.Thread(target=self._run, args=(parse,), name="ringserve-lane-reader", daemon=True)
        self._thread.start()

    def _run(self, parse: Callable[[Callable[[Received], None]], None]) -> None:
        try:
            parse(self._queue)
        finally:
            self._loop.call_soon_threadsafe(_resolve, self.done)

    def _queue(self, frame: Received) -> None:
        """On the thread: one frame for the loop (waiting while too many are unrouted)."""
        with self._cv:
            while len(self._frames) >= MAX_UNROUTED and not self._closing:
                self._cv.wait()
            if self._closing:
                return
            self._frames.append(frame)
            tell = not self._told
            self._told = True
        if tell:
            self._loop.call_soon_threadsafe(self._route)

    def _route(self) -> None:
        """On the loop: routes every frame the thread has queued, in order."""
        while True:
            with self._cv:
                if not self._frames or self._closing:
                    self._told = False
                    self._cv.notify()
                    return
                frame = self._frames.popleft()
                self._cv.notify()
            self._on_frame(frame)

    @property
    def closing(self) -> bool:
        with self._cv:
            return self._closing

    def close(self) -> None:
        """Stops the thread: a read blocked in the kernel ends at the shutdown."""
        with self._cv:
            self._closing = True
            self._frames.clear()
            self._cv.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)


def wait_ready(sock: socket.socket, *, write: bool, timeout_ms: int = 200) -> None:
    """Waits (on a lane thread) until ``sock`` may be written or read, it is shut down, or
    ``timeout_ms`` pass: the caller tries again either way, and looks whether it is closing."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT if write else select.POLLIN)
    poller.poll(timeout_ms)


def read_into(sock: socket.socket, view: memoryview, flags: int, closing: Callable[[], bool]) -> int:
    """Reads (on a lane thread) what ``sock`` has into ``view``, waiting while it has nothing: the
    bytes read, 0 at the end of the connection or once ``closing()``."""
    while not closing():
        try:
            return sock.recv_into(view, 0, flags)
        except (BlockingIOError, InterruptedError):
            wait_ready(sock, write=False)
    return 0


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
