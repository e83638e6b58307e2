"""The job's certificates, made once per test session (see _secure.py)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio
from _secure import Pki, make_pki
from worlds import World, WorldFactory, worker_config

from ringserve import WorkerConfig


@pytest.fixture
def make_worker_config() -> Callable[..., WorkerConfig]:
    """Workers that run the ring: these tests forge its frames, and the ring's frames only."""
    return functools.partial(worker_config, algorithm="ring")


@pytest_asyncio.fixture
async def world_factory(world_factory: WorldFactory) -> AsyncIterator[WorldFactory]:
    """The suite's world_factory, of workers that run the ring (see make_worker_config)."""

    async def make(n: int, **kwargs: Any) -> World:
        return await world_factory(n, **{"algorithm": "ring", **kwargs})

    yield make


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))
