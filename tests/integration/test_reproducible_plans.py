"""Two runs of one job under ``auto`` sum in the same order, bit for bit, though their links
measure several times apart (selection.planned: the plan follows the host layout and the links'
coarse class, never the measured value).

Each run is a world of its own, one after the other: a coordinator and three workers on hosts of
their own (by name: every payload between them travels over the gRPC stream, as between hosts),
which measure their links at the first collective. In the second run every worker's peer server
sits behind a relay that holds each byte ``DELAY_S`` before passing it on, as a loaded machine's
ping swings tenfold; below the WAN's class (selection.WAN_LATENCY_S), so both runs plan a LAN.
Before the plan took the class, the test failed: the second run (about 4 ms measured, against 0.3
to 0.6 ms) planned a tree at 256 KiB where the first ran the ring, and the sums differed in their
last bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from relay import Relay
from worlds import free_port, start_world

from ringserve import selection
from ringserve.selection import LinkCosts

pytestmark = pytest.mark.timeout(120)

N = 3
DELAY_S = 0.003  # one way, at each relay: 5 to 15 times a loopback ping, well below the WAN's class
SIZES = (64 << 10, 256 << 10, 1_200_000, 4 << 20)  # bytes of float32
APART = dict(shared_memory=False, payload_lane="off")  # as between hosts, every byte on the stream


def inputs(rank: int) -> dict[int, np.ndarray]:
    """Rank ``rank``'s float32 vectors, one per size: random, so that another order of the sum
    changes its last bits; the same in every run."""
    rng = np.random.default_rng(1000 + rank)
    return {size: rng.standard_normal(size // 4).astype(np.float32) for size in SIZES}


async def run_job(*, delay_s: float) -> tuple[dict[int, bytes], dict[Any, int], LinkCosts]:
    """One run of the job: (rank 0's sum of each size, the algorithms rank 0 ran, the measured figures)."""
    relays: list[Relay] = []
    each: list[dict[str, Any]] = []
    try:
        for i in range(N):
            config: dict[str, Any] = {"rank_hint": i, "hostname": f"host-{i}"}
            if delay_s > 0:
                port = free_port()
                relay = Relay(port, delay_s=delay_s)
                relays.append(relay)
                config.update(bind_port=port, advertise_port=await relay.start())
            each.append(config)
        world = await start_world(N, **APART, each=lambda i: each[i])
        try:
            assert [w.rank for w in world.workers] == list(range(N))
            assert all(w.node.config.algorithm == selection.AUTO for w in world.workers)
            data = [inputs(r) for r in range(N)]
            sums: dict[int, bytes] = {}
            for size in SIZES:
                outs = await world.map("allreduce", [d[size] for d in data], op="sum", name=f"x{size}")
                assert all(out.tobytes() == outs[0].tobytes() for out in outs)  # every rank alike, as ever
                sums[size] = outs[0].tobytes()
            plane = world.workers[0].node.planes.current
            assert plane is not None
            measured = await plane.measures.links(plane.session())
            return sums, dict(world.workers[0].counters.algorithms), measured
        finally:
            await world.close()
    finally:
        for relay in relays:
            await relay.close()


async def test_two_runs_under_auto_give_the_same_bits_though_the_second_runs_every_link_3_ms_slower() -> None:
    quick_sums, quick_algorithms, quick = await run_job(delay_s=0.0)
    slow_sums, slow_algorithms, slow = await run_job(delay_s=DELAY_S)
    assert slow.latency_s >= DELAY_S  # the relays took effect: each hop of the pings waited for them
    assert slow.latency_s < selection.WAN_LATENCY_S and quick.latency_s < selection.WAN_LATENCY_S
    assert quick_algorithms == slow_algorithms, (quick, slow)
    for size in SIZES:
        assert quick_sums[size] == slow_sums[size], f"{size} bytes: the sums differ ({quick} and {slow} measured)"
