"""What a sync that lost the mark sees of a holder's address (ringserve/worker/control/sighting.py), over
real sockets: a live peer server answers with its id (ALIVE; another id means a new process took
the port: GONE), a closed port refuses (GONE, the only proof of absence), and a stopped process,
whose kernel still completes the TCP handshake, never answers (SILENT, within the deadline)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from worlds import WorldFactory, free_port

from ringserve.commits import Seen

pytestmark = pytest.mark.timeout(60)

LISTEN = "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); " \
         "print(s.getsockname()[1], flush=True); time.sleep(600)"


@pytest.fixture
def stopped_listener() -> Iterator[str]:
    """The address of a listening process that is stopped (SIGSTOP): a holder starved or stopped."""
    proc = subprocess.Popen([sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        proc.send_signal(signal.SIGSTOP)
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


async def test_a_live_holder_is_alive_and_a_new_process_on_its_port_is_not_it(world_factory: WorldFactory) -> None:
    world = await world_factory(2)
    a, b = world.workers
    assert await a.sight(b.worker_id, b.address) is Seen.ALIVE
    assert await a.sight("someone-else", b.address) is Seen.GONE


async def test_an_address_nothing_listens_at_is_gone_at_once(world_factory: WorldFactory) -> None:
    world = await world_factory(1)
    with socket.socket() as s:  # a port that was free a moment ago, and is closed now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    assert await world.workers[0].sight("gone", f"127.0.0.1:{port}") is Seen.GONE
    assert time.monotonic() - started < 0.5


async def test_a_stopped_process_is_silent_within_the_deadline(world_factory: WorldFactory, stopped_listener: str) -> None:
    world = await world_factory(1)
    worker = world.workers[0]
    started = time.monotonic()
    assert await worker.sight("stopped", stopped_listener) is Seen.SILENT
    deadline = min(worker.config.rpc_timeout_s, worker.heartbeat_interval_s)
    assert time.monotonic() - started < 2 * deadline + 1.0


async def test_an_unresolvable_or_malformed_address_is_silent_not_gone(world_factory: WorldFactory) -> None:
    world = await world_factory(1)
    # Nothing proves the holder gone: it is waited for, within the bound, not declared lost.
    assert await world.workers[0].sight("x", "no-such-host.invalid:1") is Seen.SILENT
    assert await world.workers[0].sight("x", f"127.0.0.1:{free_port()}x") is Seen.SILENT
