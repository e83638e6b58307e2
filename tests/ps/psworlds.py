"""Parameter-server worlds on loopback: a coordinator, S shards and N workers, each with a client.

Kept apart from conftest.py so that test modules can import it by name, as tests/worlds.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
from worlds import World, start_world

from ringserve.config import PSClientConfig, ShardConfig
from ringserve.ps import AsyncClient, Optimizer, Shard
from ringserve.ps.client.aio import view_of

FAST_SHARD = dict(connect_timeout_s=5.0, register_timeout_s=20.0, rpc_timeout_s=5.0, max_wait_s=60.0,
                  use_uvloop=False)
FAST_CLIENT = dict(connect_timeout_s=5.0, rpc_timeout_s=5.0, round_timeout_s=30.0, shard_wait_s=20.0)


def shard_config(coordinator: str, shards: int, **overrides: Any) -> ShardConfig:
    return ShardConfig(coordinator=coordinator, shards=shards, **{**FAST_SHARD, **overrides})


def client_config(coordinator: str, **overrides: Any) -> PSClientConfig:
    return PSClientConfig(coordinator=coordinator, **{**FAST_CLIENT, **overrides})


@dataclasses.dataclass
class PSWorld:
    """A world of workers (tests/worlds.py), its shards, and one client per worker in rank order."""

    world: World
    shards: list[Shard]
    clients: list[AsyncClient]

    @property
    def address(self) -> str:
        return self.world.coordinator.address

    async def each(self, call: Any, timeout_s: float = 60.0) -> list[Any]:
        """Runs ``call(rank, client)`` for every rank at once."""
        async with asyncio.timeout(timeout_s):
            return list(await asyncio.gather(*(call(r, c) for r, c in enumerate(self.clients))))

    def client_for(self, rank: int, **overrides: Any) -> AsyncClient:
        worker = self.world.workers[rank]
        return AsyncClient(client_config(self.address, **overrides), worker_id=worker.worker_id,
                           view=view_of(worker))

    async def start_shard(self, shards: int, **overrides: Any) -> Shard:
        shard = await Shard(shard_config(self.address, shards, **overrides)).start()
        self.shards.append(shard)
        return shard

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
        await asyncio.gather(*(s.stop() for s in self.shards), return_exceptions=True)
        await self.world.close()


async def start_ps_world(n: int, shards: int = 2, *, coordinator: dict[str, Any] | None = None,
                         shard: dict[str, Any] | None = None, client: dict[str, Any] | None = None,
                         **worker: Any) -> PSWorld:
    """Starts a world of n workers, ``shards`` shards registered with its coordinator, and a client
    per worker (connected, not yet Init)."""
    world = await start_world(n, coordinator=coordinator, **worker)
    ps = PSWorld(world, [], [])
    try:
        for _ in range(shards):
            await ps.start_shard(shards, **(shard or {}))
        ps.clients = [ps.client_for(r, **(client or {})) for r in range(n)]
        await asyncio.gather(*(c.connect() for c in ps.clients))
    except BaseException:
        await ps.close()
        raise
    return ps


def model(seed: int = 0, sizes: tuple[tuple[int, ...], ...] = ((13, 7), (7,), (7, 3), (3,))) -> dict[str, np.ndarray]:
    """A small model's named float32 tensors."""
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal(shape).astype(np.float32) for i, shape in enumerate(sizes)}


SGD = Optimizer(kind="sgd", lr=0.1)
