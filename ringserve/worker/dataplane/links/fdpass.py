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
connect anywhere else. The socket is made mode 0600, for workers that run as one user: it is
bound in a private directory (0700) and renamed into place, so it is never reachable with other
modes, not even between bind and chmod.

What a local flood cannot do: a token is compared in constant time (``hmac.compare_digest``) and
spent when its ring is handed over (a ring goes to one receiver, once); at most ``MAX_PENDING``
connections wait for their token at once, and a new one past that closes the one that waited
longest (a receiver sends its token as soon as it connects, so the longest waiter is the one
holding its connection open), and each is dropped at ``timeout_s`` anyway. A receiver that gets
no ring falls back to the stream, and says so: the job never depends on this socket.

Why a server per worker rather than a socket per ring: one file in the directory per worker, made
when its first ring is offered and removed when it stops; its rings come and go with the views.
The server answers on the worker's event loop (one non-blocking accept and one small send per
ring); the receiver's fetch blocks, under a deadline, so it runs on a thread (peers.py), which is
also what lets a sender and a receiver share one loop (tests run several workers in one process).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile

log = logging.getLogger("ringserve.worker")

TOKEN_BYTES = 16
GRANTED, REFUSED = b"R", b"-"
MAX_PENDING = 32  # connections waiting for their token at once (a worker has a few peers on its host)
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
        private = tempfile.mkdtemp(prefix=".", dir=directory)  # 0700: nobody else reaches it
        try:
            listener.setblocking(False)
            staged = os.path.join(private, self.name)
            listener.bind(staged)
            os.chmod(staged, stat.S_IRUSR | stat.S_IWUSR)
            os.rename(staged, self.path)  # into the shared directory already 0600
            listener.listen(MAX_PENDING)
        except OSError:
            listener.close()
            raise
        finally:
            with contextlib.suppress(OSError):
                shutil.rmtree(private)
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
        while len(self._conns) >= MAX_PENDING:  # the one that waited longest goes (dicts keep order)
            self._drop(next(iter(self._conns)))
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
        token = self._spend(bytes(got))
        fd = self._fds.pop(token) if token is not None else None
        try:
            if fd is None:
                conn.send(REFUSED)
            else:
                socket.send_fds(conn, [GRANTED], [fd])
        except OSError as exc:  # a few bytes on a fresh socket: only a gone peer fails them
            log.debug("ring server %s could not answer: %s", self.path, exc)
        self._drop(conn)

    def _spend(self, got: bytes) -> bytes | None:
        """The token on offer that ``got`` is, compared in constant time with each (a worker
        offers a ring to each peer on its host: a handful)."""
        found = None
        for token in self._fds:
            if hmac.compare_digest(token, got):
                found = token
        return found

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
