"""A flood of connections at a worker's payload port, and at its fd-passing socket, while the job
runs with the TCP lane required: the job finishes with the right results.

The payload ports are fixed before the job starts, so the flood is already on when the lanes
attach: a receiver's connection (its TLS handshake, under TLS) must get through a pending table
that silent connections keep full. The port evicts the oldest silent connection first, and a
receiver closed before the sender's answer dials again (lanes/tcp/server.py, lanes/tcp/inbound.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _secure import Pki, make_pki
from worlds import free_port

pytestmark = pytest.mark.timeout(120)

FLOOD = 1000  # connections at each port
HELD = 200  # at most this many held open at once by the flooder of one port
LANE = dict(shared_memory=False, chunk_bytes=64 << 10, payload_lane="tcp", max_unverified_streams=16)


class Flooder(threading.Thread):
    """Opens ``FLOOD`` connections at ``connect()`` (more while ``keep_on``), says nothing on any, and
    keeps the newest ``HELD`` open."""

    def __init__(self, connect: Any) -> None:
        super().__init__(daemon=True)
        self.connect = connect
        self.opened = 0
        self.keep_on = True
        self._done = threading.Event()

    def run(self) -> None:
        held: list[socket.socket] = []
        try:
            while not self._done.is_set() and (self.opened < FLOOD or self.keep_on):
                try:
                    held.append(self.connect())
                    self.opened += 1
                except OSError:
                    time.sleep(0.005)  # not listening yet, or a full backlog
                    continue
                while len(held) > HELD:
                    held.pop(0).close()
        finally:
            for s in held:
                s.close()

    def stop(self) -> None:
        self._done.set()
        self.join(10)


def tcp(port: int) -> Any:
    return lambda: socket.create_connection(("127.0.0.1", port), timeout=1)


def unix(directory: str) -> Any:
    def connect() -> socket.socket:
        found = glob.glob(os.path.join(directory, "rs-*.sock"))
        if not found:
            raise FileNotFoundError(directory)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(found[0])
        except OSError:
            s.close()
            raise
        return s
    return connect


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _exact_allreduces(world: Any, rounds: int) -> None:
    rng = np.random.default_rng(7)
    for k in range(rounds):
        xs = [rng.integers(-1000, 1000, 1 << 18).astype(np.float32) for _ in range(world.size)]
        outs = await world.map("allreduce", xs, op="sum", name=f"flooded/{k}", timeout_s=60)
        expected = sum(xs)
        for out in outs:
            assert out.tobytes() == expected.tobytes()  # integers in float32: exact in any order


@pytest.mark.parametrize("tls", [False, True], ids=["plaintext", "tls"])
async def test_a_flood_at_every_payload_port_while_the_lanes_attach_leaves_the_job_exact(
        tls: bool, pki: Pki, world_factory: Any) -> None:
    ports = [free_port() for _ in range(3)]
    settings = pki.settings() if tls else {}
    flooders = [Flooder(tcp(port)) for port in ports]
    for f in flooders:
        f.start()  # on before the first lane attaches: the ports bind at the first link
    try:
        world = await world_factory(3, coordinator=settings or None, **settings, **LANE,
                                    each=lambda i: {"payload_port": ports[i]})
        await _exact_allreduces(world, 8)
        for f in flooders:
            f.keep_on = False
        async with asyncio.timeout(60):
            while any(f.opened < FLOOD for f in flooders):
                await asyncio.sleep(0.1)
        await _exact_allreduces(world, 2)
    finally:
        for f in flooders:
            f.stop()
    for w in world.workers:
        assert w.counters.lane_bytes_sent > 0  # the lanes carried the payloads: required, and attached
        assert w.counters.lane_refused > 0  # and the flood reached the port
    assert all(f.opened >= FLOOD for f in flooders)


async def test_a_flood_at_every_fd_passing_socket_leaves_the_job_exact(tmp_path: Path, world_factory: Any) -> None:
    shared = str(tmp_path)
    world = await world_factory(3, shared_dir=shared, chunk_bytes=64 << 10)
    await _exact_allreduces(world, 1)  # the ring servers are up once the rings are offered
    flooder = Flooder(unix(shared))
    flooder.start()
    try:
        await _exact_allreduces(world, 4)
        flooder.keep_on = False
        async with asyncio.timeout(60):
            while flooder.opened < FLOOD:
                await asyncio.sleep(0.1)
        await _exact_allreduces(world, 2)
    finally:
        flooder.stop()
    assert flooder.opened >= FLOOD
    with contextlib.suppress(FileNotFoundError):
        assert [n for n in os.listdir(shared) if n.startswith(".")] == []  # no bind folder left behind
