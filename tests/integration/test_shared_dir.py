"""Shared rings handed over a Unix socket in a shared directory (ringserve/worker/dataplane/links/fdpass.py): what
lets containers of one host, each in its own PID namespace, pass payloads through shared memory.

The first tests run the exchange in this process, with the /proc route made unusable; the last
ones start workers in PID namespaces of their own (``unshare --pid --mount-proc``, as root), so
that no worker can see another's processes, and check which way the payloads went.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from worlds import coordinator_config

from ringserve import Worker, WorkerConfig, wire
from ringserve.errors import InvalidArgumentError
from ringserve.worker.dataplane.links import fdpass, shared
from ringserve.worker.dataplane.links.fdpass import RingServer
from ringserve.worker.dataplane.links.shared import InboundRing, OutboundRing

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.skipif(not shared.supported(), reason="the fast path needs Linux memfd seals and x86-64")]


def _unreachable_by_pid(offer):
    offer.pid = 2**31 - 1  # no such process: only the socket can hand the ring over
    return offer


async def test_a_ring_handed_over_the_socket_is_mapped_and_carries_payloads(tmp_path) -> None:
    server = RingServer(str(tmp_path), timeout_s=5.0)
    out = OutboundRing(slots=2, slot_bytes=64)
    try:
        out.serve(server)
        offer = _unreachable_by_pid(out.offer())
        assert offer.socket == server.name and os.path.exists(server.path)
        assert await asyncio.to_thread(InboundRing.attach, offer) is None  # /proc alone: nothing there
        inbound = await asyncio.to_thread(InboundRing.attach, offer, shared_dir=str(tmp_path), timeout_s=5.0)
        assert inbound is not None and out.attached
        values = np.arange(16, dtype=np.float32)
        slot = out.put(values)
        header = wire.FrameHeader(kind=wire.DATA, shm_slot=slot, shm_bytes=values.nbytes)
        assert np.frombuffer(inbound.payload(header), dtype=np.float32).tolist() == values.tolist()
        inbound.close()
    finally:
        out.close()
        server.close()
    assert not os.path.exists(server.path)


async def test_a_wrong_token_a_foreign_name_or_a_closed_ring_gets_no_fd(tmp_path) -> None:
    server = RingServer(str(tmp_path), timeout_s=5.0)
    out = OutboundRing(slots=2, slot_bytes=64)
    try:
        out.serve(server)
        directory = str(tmp_path)
        assert await asyncio.to_thread(fdpass.fetch, directory, server.name, os.urandom(16), 5.0) is None
        for name in ("../" + server.name, "/tmp/x.sock", server.name + ".x"):
            assert await asyncio.to_thread(fdpass.fetch, directory, name, out.token, 5.0) is None
        fd = await asyncio.to_thread(fdpass.fetch, directory, server.name, out.token, 5.0)
        assert fd is not None
        os.close(fd)
        token = out.token
        out.close()  # withdrawn before its fd closes
        assert await asyncio.to_thread(fdpass.fetch, directory, server.name, token, 5.0) is None
    finally:
        out.close()
        server.close()


async def test_a_receiver_that_never_sends_its_token_is_dropped_at_the_deadline(tmp_path) -> None:
    import socket

    server = RingServer(str(tmp_path), timeout_s=0.2)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(server.path)
            conn.settimeout(5.0)
            await asyncio.sleep(0.5)
            assert await asyncio.to_thread(conn.recv, 1) == b""  # closed by the server
    finally:
        server.close()


async def test_a_token_is_spent_once_its_ring_is_handed_over(tmp_path) -> None:
    server = RingServer(str(tmp_path), timeout_s=5.0)
    out = OutboundRing(slots=2, slot_bytes=64)
    try:
        out.serve(server)
        token = out.offer().token
        fd = await asyncio.to_thread(fdpass.fetch, str(tmp_path), server.name, token, 5.0)
        assert fd is not None
        os.close(fd)
        # Replayed (by a process that read it, or the same receiver again): no second fd.
        assert await asyncio.to_thread(fdpass.fetch, str(tmp_path), server.name, token, 5.0) is None
    finally:
        out.close()
        server.close()


async def test_the_socket_appears_in_the_shared_dir_already_owner_only_and_leaves_nothing_else(tmp_path) -> None:
    import stat

    server = RingServer(str(tmp_path), timeout_s=5.0)
    try:
        assert os.listdir(tmp_path) == [server.name]  # the private folder it was bound in is gone
        mode = os.stat(server.path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    finally:
        server.close()
    assert os.listdir(tmp_path) == []


async def test_a_flood_of_held_connections_cannot_keep_a_receiver_from_its_ring(tmp_path) -> None:
    import socket

    server = RingServer(str(tmp_path), timeout_s=30.0)  # the flooders would hold on for 30 s
    out = OutboundRing(slots=2, slot_bytes=64)
    held: list[socket.socket] = []
    try:
        out.serve(server)
        for _ in range(fdpass.MAX_PENDING * 4):  # connect, never send a token
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(server.path)
            held.append(conn)
            await asyncio.sleep(0)  # let the server accept it
        await asyncio.sleep(0.1)
        assert len(server._conns) <= fdpass.MAX_PENDING
        fd = await asyncio.to_thread(fdpass.fetch, str(tmp_path), server.name, out.offer().token, 5.0)
        assert fd is not None  # at once, not after the flooders' 30 s
        os.close(fd)
        assert sum(1 for c in held if _closed(c)) >= len(held) - fdpass.MAX_PENDING  # the oldest went first
    finally:
        for conn in held:
            conn.close()
        out.close()
        server.close()


def _closed(conn) -> bool:
    conn.setblocking(False)
    try:
        return conn.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_a_shared_dir_that_is_missing_or_too_long_is_refused_naming_it(tmp_path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"'/no/such/dir' \(RINGSERVE_SHARED_DIR\) does not exist"):
        Worker(config=WorkerConfig(shared_dir="/no/such/dir"))
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    with pytest.raises(InvalidArgumentError, match=r"longer than"):
        WorkerConfig(shared_dir=str(deep))


# -- workers in PID namespaces of their own ------------------------------------------------------

N = 300_000
WORKER = textwrap.dedent(f"""
    import json, os
    import numpy as np
    import ringserve as rs
    from ringserve import api

    rs.init()
    counters = api.context().worker.counters
    rank, size = rs.rank(), rs.size()
    rs.allreduce(np.ones(1000, dtype=np.float32), op="sum", name="warm-up")  # the rings attach
    before = counters.shared_bytes_sent
    x = np.arange({N}, dtype=np.float32) * (rank + 1)
    out = rs.allreduce(x, op="sum", name="big")
    exact = bool((out == np.arange({N}, dtype=np.float32) * (size * (size + 1) // 2)).all())
    print(json.dumps({{"rank": rank, "pid": os.getpid(), "shared": counters.shared_bytes_sent - before,
                      "exact": exact}}), flush=True)
    rs.shutdown()
""")


def _run_isolated(world: int, env: dict[str, str]) -> list[dict]:
    """``world`` workers, each in a PID and mount namespace of its own, on one coordinator."""
    from ringserve import Coordinator
    from ringserve.loop import LoopThread

    thread = LoopThread(use_uvloop=False)
    coordinator = Coordinator(coordinator_config(min_workers=world, max_workers=world))
    thread.run(coordinator.start(), 10)
    full = {**os.environ, "RINGSERVE_COORDINATOR": coordinator.address, "RINGSERVE_CHUNK_BYTES": str(256 << 10),
            "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p), **env}
    procs = [subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", WORKER],
                              env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(world)]
    try:
        outputs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        thread.run(coordinator.stop(0.1), 10)
        thread.stop()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


needs_namespaces = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                      reason="PID namespaces need root and unshare(1)")


@needs_namespaces
def test_workers_in_separate_pid_namespaces_share_memory_through_the_shared_dir(tmp_path) -> None:
    results = _run_isolated(3, {"RINGSERVE_SHARED_DIR": str(tmp_path), "RINGSERVE_ALGORITHM": "ring"})
    assert all(r["exact"] for r in results)
    assert all(r["pid"] == 1 for r in results)  # each is PID 1 of its own namespace: /proc cannot tell them apart
    for r in results:  # 2(N-1)/N of the tensor, every payload byte through shared memory
        assert r["shared"] == 2 * 2 * N * 4 // 3
    assert os.listdir(tmp_path) == []  # each worker removed its socket


@needs_namespaces
def test_without_the_shared_dir_such_workers_fall_back_to_the_stream(tmp_path) -> None:
    results = _run_isolated(2, {})
    assert all(r["exact"] for r in results)
    assert all(r["shared"] == 0 for r in results)
