"""Shared fixtures: fast configs, and real worlds (a coordinator and N started workers) on loopback.

A world is built with ``world_factory`` (any number of worlds per test, closed after the test) or
with the ``world`` fixture, parametrised indirectly by the number of workers::

    @pytest.mark.parametrize("world", [2, 3], indirect=True)
    async def test_something(world):
        outs = await world.map("allreduce", [x0, x1], op="sum")   # rank r passes the r-th value

A module whose tests run on one module-scoped loop may share worlds through ``shared_worlds``
(see tests/integration/test_collectives.py), which is much faster than a world per test.

Timeouts are short so the suite is fast, but heartbeats leave wide margins: a 2-core machine under
load must never miss one by accident.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio

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


async def start_world(n: int, *, coordinator: dict[str, Any] | None = None, **worker: Any) -> World:
    """Starts a coordinator with min_workers=n and n workers, and waits for their common view."""
    coord = await Coordinator(coordinator_config(**{"min_workers": n, **(coordinator or {})})).start()
    workers = [Worker(config=worker_config(coord.address, **worker)) for _ in range(n)]
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


@pytest.fixture
def make_coordinator_config() -> Callable[..., CoordinatorConfig]:
    return coordinator_config


@pytest.fixture
def make_worker_config() -> Callable[..., WorkerConfig]:
    return worker_config


@pytest_asyncio.fixture
async def world_factory() -> AsyncIterator[WorldFactory]:
    """``await world_factory(n, coordinator={...}, **worker_overrides)``; every world closes after the test."""
    worlds: list[World] = []

    async def make(n: int, **kwargs: Any) -> World:
        world = await start_world(n, **kwargs)
        worlds.append(world)
        return world

    yield make
    for world in reversed(worlds):
        await world.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_worlds() -> AsyncIterator[WorldFactory]:
    """Worlds shared by the tests of one module, one per size, started on first use.

    Only for modules whose tests run on the module's loop
    (``pytestmark = pytest.mark.asyncio(loop_scope="module")``) and that give every collective a
    name of its own, so that one test's failure cannot leak into the next.
    """
    worlds: dict[int, World] = {}

    async def get(n: int) -> World:
        if n not in worlds:
            worlds[n] = await start_world(n, chunk_bytes=SMALL_CHUNK_BYTES)
        return worlds[n]

    yield get
    for w in worlds.values():
        await w.close()


@pytest_asyncio.fixture
async def world(request: pytest.FixtureRequest, world_factory: WorldFactory) -> World:
    """A world of ``request.param`` workers (an int), or of ``request.param["n"]`` with overrides."""
    param = getattr(request, "param", 2)
    if isinstance(param, int):
        return await world_factory(param)
    param = dict(param)
    return await world_factory(param.pop("n"), **param)


@pytest_asyncio.fixture
async def coordinator(request: pytest.FixtureRequest) -> AsyncIterator[Coordinator]:
    """One running coordinator on 127.0.0.1:0; ``indirect`` params are CoordinatorConfig overrides."""
    overrides = getattr(request, "param", {})
    async with Coordinator(coordinator_config(**overrides)) as coord:
        yield coord


@contextlib.contextmanager
def _coordinator_process(args: list[str], pattern: str = r"listening on (\S+)") -> Iterator[str]:
    """`ringserve coordinator ARGS` as a process: yields the address from its first line
    (``pattern``'s group 1), and stops it with SIGTERM (it must exit 0) afterwards."""
    proc = subprocess.Popen([sys.executable, "-m", "ringserve.cli", "coordinator", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(pattern, line)
        assert match, f"unexpected first line {line!r}"
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.fixture
def coordinator_process() -> Callable[..., contextlib.AbstractContextManager[str]]:
    """A factory: ``with coordinator_process([...args]) as address:`` runs `ringserve coordinator`."""
    return _coordinator_process


# Shared test helpers (reference.py) are imported by name from every test folder.
sys.path.insert(0, str(pathlib.Path(__file__).parent))
