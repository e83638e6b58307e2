"""Shared rings between containers: the ring's memfd handed over a Unix socket (SCM_RIGHTS).

Containers on one host run one kernel (one boot id) but each has its own PID namespace, so the
receiver's ``/proc/<pid>/fd/<fd>`` (links/shared.py) names some other process, or none, and the
payloads of a compose job on one machine would all cross the stream. What containers can share is
a directory: a tmpfs volume mounted into every worker (``shared_dir``, RINGSERVE_SHARED_DIR). Each
worker that offers rings listens there on one Unix socket (``RingServer``), whose name goes into
the HELLO with the ring's token. The receiver connects, sends the token, and gets the memfd of the
ring with that token back as ancillary data (``fetch``); then it checks and maps the fd exactly as
one opened through /proc (name, seals, size, token), and answers by writing the token back into
the ring. From there on nothing differs: payloads in the ring, headers on the stream.

Why the token decides: anyone who can reach the directory can connect, but only a receiver that
read the token from the verified predecessor's HELLO (over the authenticated stream) gets a ring,
and only that one ring. A HELLO names only a socket's file name, never a path: the receiver looks
for it in its own ``shared_dir`` (mounted at any path), so a hostile HELLO cannot make a worker
connect anywhere else. The socket is made mode 0600, for workers that run as one user.

Why a server per worker rather than a socket per ring: one file in the directory per worker, made
when its first ring is offered and removed when it stops; its rings come and go with the views.
The server answers on the worker's event loop (one non-blocking accept and one small send per
ring); the receiver's fetch blocks, under a deadline, so it runs on a thread (peers.py), which is
also what lets a sender and a receiver share one loop (tests run several workers in one process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
import stat

log = logging.getLogger("ringserve.worker")

TOKEN_BYTES = 16
GRANTED, REFUSED = b"R", b"-"
_NAME = re.compile(r"rs-[0-9a-f]{16}\.sock")


class RingServer:
    """A Unix socket in ``directory`` that hands the memfd of a ring to whoever sends its token."""

    def __init__(self, directory: str, *, timeout_s: float) -> None:
        self.name = f"rs-{secrets.token_hex(8)}.sock"
        self.path = os.path.join(directory, self.name)
        self.timeout_s = timeout_s
        self._fds: dict[bytes, int] = {}  # the rings on offer: memfd by token
        self._loop = asyncio.get_running_loop()
        self._conns: dict[socket.socket, asyncio.TimerHandle] = {}
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.setblocking(False)
            listener.bind(self.path)
            os.chmod(self.path, stat.S_IRUSR | stat.S_IWUSR)
            listener.listen(64)
        except OSError:
            listener.close()
            raise
        self._listener: socket.socket | None = listener
        self._loop.add_reader(listener.fileno(), self._accept)

    def add(self, token: bytes, fd: int) -> None:
        """Offers the ring whose memfd is ``fd`` to whoever sends ``token``."""
        self._fds[token] = fd

    def remove(self, token: bytes) -> None:
        """Withdraws a ring; its owner calls this before it closes the fd (whose number the
        process may then reuse for another file)."""
        self._fds.pop(token, None)

    def _accept(self) -> None:
        listener = self._listener
        if listener is None:
            return
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of fds: the receiver falls back, and says so
            log.info("ring server %s could not accept: %s", self.path, exc)
            return
        conn.setblocking(False)
        self._conns[conn] = self._loop.call_later(self.timeout_s, self._drop, conn)
        self._loop.add_reader(conn.fileno(), self._answer, conn, bytearray())

    def _answer(self, conn: socket.socket, got: bytearray) -> None:
        try:
            data = conn.recv(TOKEN_BYTES - len(got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the receiver went away
            self._drop(conn)
            return
        got += data
        if len(got) < TOKEN_BYTES:
            return
        fd = self._fds.get(bytes(got))
        try:
            if fd is None:
                conn.send(REFUSED)
            else:
                socket.send_fds(conn, [GRANTED], [fd])
        except OSError as exc:  # a few bytes on a fresh socket: only a gone peer fails them
            log.debug("ring server %s could not answer: %s", self.path, exc)
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        timer = self._conns.pop(conn, None)
        if timer is None:
            return
        timer.cancel()
        self._loop.remove_reader(conn.fileno())
        conn.close()

    def close(self) -> None:
        """Stops answering and removes the socket's file."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        for conn in list(self._conns):
            self._drop(conn)
        self._loop.remove_reader(listener.fileno())
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def fetch(directory: str, name: str, token: bytes, timeout_s: float) -> int | None:
    """The memfd of the ring with ``token`` from the server ``name`` in ``directory``, or None.

    Blocks for at most about ``timeout_s`` (run it on a thread). The fd is the caller's to check
    (it is whatever the server sent) and to close.
    """
    if not _NAME.fullmatch(name) or len(token) != TOKEN_BYTES:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout_s)
            conn.connect(os.path.join(directory, name))
            conn.sendall(token)
            msg, fds, _, _ = socket.recv_fds(conn, 1, 1)
    except OSError as exc:
        log.debug("no shared ring from %s in %s: %s", name, directory, exc)
        return None
    if msg == GRANTED and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    return None
