"""Real worlds on loopback: a coordinator and N started workers, with test-speed configs.

Kept apart from conftest.py so that test modules can import it by name (every directory's
conftest.py is a module called "conftest").
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from ringserve import Coordinator, CoordinatorConfig, RingserveError, Worker, WorkerConfig

FAST_COORDINATOR = dict(
    settle_s=0.05,
    tick_s=0.01,
    heartbeat_interval_s=0.2,
    heartbeat_timeout_s=5.0,
)

FAST_WORKER = dict(
    connect_timeout_s=5.0,
    rendezvous_timeout_s=20.0,
    collective_timeout_s=30.0,
    rpc_timeout_s=5.0,
    abort_grace_s=1.0,
    use_uvloop=False,
)


def coordinator_config(**overrides: Any) -> CoordinatorConfig:
    """A coordinator config with test-speed settle and tick; overrides win."""
    return CoordinatorConfig(**{**FAST_COORDINATOR, **overrides})


def worker_config(coordinator: str, **overrides: Any) -> WorkerConfig:
    """A worker config with test-speed deadlines; overrides win."""
    return WorkerConfig(coordinator=coordinator, **{**FAST_WORKER, **overrides})


@dataclasses.dataclass
class World:
    """A running coordinator and its workers, in rank order."""

    coordinator: Coordinator
    workers: list[Worker]

    @property
    def size(self) -> int:
        return len(self.workers)

    async def each(self, call: Callable[[Worker], Awaitable[Any]], timeout_s: float = 30.0) -> list[Any]:
        """Runs ``call(worker)`` on every rank at once; returns the results in rank order."""
        async with asyncio.timeout(timeout_s):
            return list(await asyncio.gather(*(call(w) for w in self.workers)))

    async def map(self, method: str, per_rank: list[Any], timeout_s: float = 30.0, **kwargs: Any) -> list[Any]:
        """Calls ``worker.<method>(per_rank[rank], **kwargs)`` on every rank at once."""
        return await self.each(lambda w: getattr(w, method)(per_rank[w.rank], **kwargs), timeout_s)

    async def each_outcome(self, call: Callable[[Worker], Awaitable[Any]], timeout_s: float = 30.0) -> list[Any]:
        """Like each(), but returns each rank's exception instead of raising it."""
        async with asyncio.timeout(timeout_s):
            return list(await asyncio.gather(*(call(w) for w in self.workers), return_exceptions=True))

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers))
        await self.coordinator.stop()


async def start_world(n: int, *, coordinator: dict[str, Any] | None = None,
                      each: Callable[[int], dict[str, Any]] | None = None, **worker: Any) -> World:
    """Starts a coordinator with min_workers=n and n workers, and waits for their common view.

    ``worker`` overrides every worker's config; ``each(i)`` adds overrides for the i-th worker
    started (not a rank: ranks are assigned as workers join).
    """
    coord = await Coordinator(coordinator_config(**{"min_workers": n, **(coordinator or {})})).start()
    workers = [Worker(config=worker_config(coord.address, **{**worker, **(each(i) if each else {})}))
               for i in range(n)]
    try:
        await asyncio.gather(*(w.start() for w in workers))
    except BaseException:
        await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
        await coord.stop()
        raise
    # With min_workers below n, the first workers may start in a smaller view: wait for the full one.
    async with asyncio.timeout(10):
        while not _one_view_of(workers):
            await asyncio.sleep(0.01)
    workers.sort(key=lambda w: w.rank)
    return World(coord, workers)


def _one_view_of(workers: list[Worker]) -> bool:
    try:
        places = {(w.view_id, w.size) for w in workers}
        ranks = sorted(w.rank for w in workers)
    except RingserveError:  # a worker between views
        return False
    return len(places) == 1 and ranks == list(range(len(workers)))


WorldFactory = Callable[..., Awaitable[World]]

# Small enough that short arrays cross many chunks; odd, so chunks hold a whole number of elements
# of every dtype only by rounding down.
SMALL_CHUNK_BYTES = 52


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for servers that need a fixed port).

    Drawn below the kernel's ephemeral range where there is room: a port that a bind to port 0
    handed out and gave back can be handed out again at once, to a worker's own server that binds
    port 0 before the fixed-port server starts (fresh-ci: a worker's gRPC port took the payload
    port chosen for it, whose lane then could not bind).
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = random.sample(range(10000, low), min(64, low - 10000)) if low > 10100 else []
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def warm_lanes(world: World, senders: tuple[int, ...] | None = None, timeout_s: float = 10.0) -> None:
    """Allreduces until the TCP payload lane of every rank in ``senders`` (all by default) carries
    all its payloads: a lane attaches a moment after its view's first HELLO (a TLS handshake
    later), and until then payloads take the stream."""
    senders = tuple(range(world.size)) if senders is None else senders
    chunk = np.ones(64 << 10, dtype=np.float32)
    async with asyncio.timeout(timeout_s):
        for k in range(1 << 20):
            before = [(w.counters.bytes_sent, w.counters.lane_bytes_sent) for w in world.workers]
            await world.map("allreduce", [chunk] * world.size, op="sum", name=f"warm-lanes/{k}")
            after = [(w.counters.bytes_sent, w.counters.lane_bytes_sent) for w in world.workers]
            # Every payload of the op on the lane: what the stream carried is headers only.
            if all((after[r][0] - before[r][0]) - (after[r][1] - before[r][1]) < 0.02 * (after[r][0] - before[r][0])
                   for r in senders):
                return
