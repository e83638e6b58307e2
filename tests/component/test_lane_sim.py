"""The ring simulator (tests/ringsim.py) with real TCP payload lanes on 127.0.0.1: every link's
frames take its lane once attached, while the frames sent before that, on the simulated link, are
delayed by random loop turns; so the two paths interleave differently under each seed, and every
collective and codec must still give every rank the same bytes as without lanes."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from ringsim import simulate

from ringserve.selection import LinkCosts
from ringserve.worker.dataplane.session import Session
from ringserve.worker.ops import collectives

pytestmark = pytest.mark.timeout(60)

T = 20.0


async def every_collective(session: Session, rank: int) -> list[Any]:
    world = session.place.size
    rng = np.random.default_rng(rank)
    x = rng.standard_normal(40 * world + 7).astype(np.float32)
    opts: dict[str, Any] = {"chunk_bytes": 64, "timeout_s": T}
    out: list[Any] = []
    for k in range(3):  # the first ones cross as the lanes attach, the later ones on them
        out.append(await collectives.allreduce(session, x * (k + 1), op="sum", name=f"a{k}", **opts))
    await lanes_attached(session)  # on a loaded machine the first ones can finish before any lane attaches
    for codec in ("fp16", "bf16", "int8"):
        residual = np.zeros_like(x)
        out.append(await collectives.allreduce(session, x, op="average", name=codec, compression=codec,
                                               residual=residual, **opts))
        out.append(residual)
    out.append(await collectives.broadcast(session, x, root=world - 1, name="b", **opts))
    out.append(await collectives.allgather(session, x[: rank + 3], name="g", **opts))
    out.append(await collectives.reduce_scatter(session, x, op="max", name="rs", **opts))
    out.append(await collectives.allgather_object(session, {"rank": rank}, name="o", chunk_bytes=16, timeout_s=T))
    await collectives.barrier(session, timeout_s=T)
    return [out, session.counters.lane_bytes_sent, {a for (op, a) in session.counters.algorithms if op == "allreduce"}]


async def lanes_attached(session: Session, timeout_s: float = 10.0) -> None:
    """Waits until every link this rank holds that has a TCP lane has it attached (none: at once)."""
    plane = session.plane
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        links = [plane.link_to(r) for r in plane.linked_ranks]
        if all(link is None or link.tcp is None or link.tcp.attached for link in links):
            return
        assert asyncio.get_running_loop().time() < deadline, "the simulated TCP lanes did not attach"
        await asyncio.sleep(0.01)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return bool(a == b)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("world", [2, 3, 5])
async def test_every_collective_over_tcp_lanes_gives_the_same_bytes_as_over_the_links_alone(world: int, seed: int) -> None:
    over_lanes = await simulate(world, every_collective, seed=seed * 100 + world, tcp=True)
    alone = await simulate(world, every_collective, seed=seed * 100 + world)
    for rank in range(world):
        assert all(same(a, b) for a, b in zip(over_lanes[rank][0], alone[rank][0], strict=True)), f"rank {rank}"
        assert over_lanes[rank][1] > 0 and alone[rank][1] == 0  # the lanes carried frames
    assert all(same(a, b) for a, b in zip(over_lanes[0][0][:3], over_lanes[-1][0][:3], strict=True))


@pytest.mark.parametrize("algorithm", ["halving_doubling", "tree", "ring2d"])
async def test_the_latency_algorithms_over_tcp_lanes_give_the_same_bytes_as_over_the_links_alone(algorithm: str) -> None:
    """Their programs send to several links at once (partners, a tree's children): the buffers
    are the caller's again only once every one of those lanes has sent from them."""
    world = 6  # a fold for halving-doubling, two children in a tree, a grid of 2 x 3
    # Link figures given: measured ones vary with the machine's load, and under ``halving_doubling``
    # the model may then plan recursive doubling in one run and halving-doubling in the other, whose
    # sums round differently (both right). At these, every allreduce here plans ``algorithm``.
    links = LinkCosts.of(1e-5, 1e8)
    over_lanes = await simulate(world, every_collective, seed=7, tcp=True, algorithm=algorithm, links=links)
    alone = await simulate(world, every_collective, seed=7, algorithm=algorithm, links=links)
    for rank in range(world):
        assert over_lanes[rank][2] == alone[rank][2] == {algorithm}
        assert all(same(a, b) for a, b in zip(over_lanes[rank][0], alone[rank][0], strict=True)), f"rank {rank}"
        assert over_lanes[rank][1] > 0
