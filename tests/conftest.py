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

import contextlib
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio
from worlds import SMALL_CHUNK_BYTES, World, WorldFactory, coordinator_config, start_world, worker_config

from ringserve import Coordinator, CoordinatorConfig, WorkerConfig


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

    One worker of each world has shared memory off, so that a world of 2 runs every payload over
    the gRPC stream, and larger worlds mix the two paths: frames that came through shared memory
    are forwarded over the stream and the other way round.

    Only for modules whose tests run on the module's loop
    (``pytestmark = pytest.mark.asyncio(loop_scope="module")``) and that give every collective a
    name of its own, so that one test's failure cannot leak into the next.
    """
    worlds: dict[int, World] = {}

    async def get(n: int) -> World:
        if n not in worlds:
            worlds[n] = await start_world(n, chunk_bytes=SMALL_CHUNK_BYTES,
                                          each=lambda i: {"shared_memory": i != 0})
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
    # Its log goes to a file that nobody reads while it runs (a pipe could fill and block it).
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ringserve.cli", "coordinator", *args],
                                stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            match = re.search(pattern, line)
            assert match, f"unexpected first line {line!r}"
            yield match.group(1)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(15)
                log.seek(0)
                assert code == 0, f"the coordinator exited {code}: {log.read()[-3000:]}"
            finally:
                if proc.poll() is None:
                    proc.kill()


@pytest.fixture
def coordinator_process() -> Callable[..., contextlib.AbstractContextManager[str]]:
    """A factory: ``with coordinator_process([...args]) as address:`` runs `ringserve coordinator`."""
    return _coordinator_process


# Shared test helpers (reference.py) are imported by name from every test folder.
sys.path.insert(0, str(pathlib.Path(__file__).parent))
