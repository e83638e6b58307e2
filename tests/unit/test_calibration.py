"""The measure of the links (worker/dataplane/calibration.py): the clock it reads, and the figures
it hands the model (selection.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import uvloop

from ringserve import selection
from ringserve.loop import fine_clock
from ringserve.selection import FASTEST_SECONDS_PER_BYTE, LinkCosts
from ringserve.testing import vclock
from ringserve.worker.dataplane.calibration import Clock, links_of

MiB = 1 << 20


def _spin(seconds: float) -> None:
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        pass


def _one_hop(loop: asyncio.AbstractEventLoop, hop_s: float) -> float:
    """What the probe's clock reads for a frame that leaves and comes back ``hop_s`` later, within
    one iteration of ``loop`` (a hop on loopback, tens of microseconds)."""
    async def main() -> float:
        clock = Clock(16)
        clock.first(0, 0)
        _spin(hop_s)
        clock.take(0, 0, None)  # type: ignore[arg-type]
        return clock.times[1] - clock.times[0]

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_under_uvloop_the_probe_clock_sees_a_hop_shorter_than_a_millisecond() -> None:
    # uvloop's own clock counts whole milliseconds, read once per iteration: it saw 0 here, and the
    # probe's bytes took no time, so auto ran recursive doubling for a training step's buckets.
    seen = _one_hop(uvloop.new_event_loop(), 300e-6)
    assert 250e-6 < seen < 0.1


def test_under_asyncio_the_probe_clock_is_the_loops_own() -> None:
    loop = asyncio.new_event_loop()
    assert fine_clock(loop) == loop.time
    assert 250e-6 < _one_hop(loop, 300e-6) < 0.1


def test_under_virtual_time_the_probe_clock_is_the_virtual_one() -> None:
    async def main() -> list[float]:
        clock = Clock(16)
        clock.first(0, 0)
        await asyncio.sleep(5.0)  # virtual: no time passes on the wall
        clock.take(0, 0, None)  # type: ignore[arg-type]
        return clock.times

    started = time.monotonic()
    times = vclock.run(main())
    assert times[1] - times[0] == pytest.approx(5.0)
    assert time.monotonic() - started < 1.0


def test_a_probe_whose_bytes_took_no_visible_time_gives_the_fastest_link_not_a_free_one() -> None:
    links = links_of(0.0005, 0.0)
    assert links == LinkCosts(0.0005, FASTEST_SECONDS_PER_BYTE)
    assert links_of(0.0005, 3e-9).seconds_per_byte == 3e-9
    # The benchmark model's whole gradient (DDP's first bucket) over 4 ranks at that latency: the
    # ring, as the bytes say. With bytes for free (the old floor, 1e-12 s a byte) the model put the
    # latency-bound plans first (a 2D ring; recursive doubling, which moves log2(4) whole vectors a
    # rank against the ring's 1.5). The floor is a backstop: the clock above is the fix.
    bucket = 23 * MiB
    assert selection.choose("auto", "allreduce", bucket, 4, links, 2 * MiB).algorithm == selection.RING
    free = LinkCosts(0.0005, 1e-12)
    assert selection.choose("auto", "allreduce", bucket, 4, free, 2 * MiB).algorithm != selection.RING


def test_the_figures_come_from_the_shortest_round_trips() -> None:
    async def make() -> Clock:
        return Clock(16)

    clock = asyncio.run(make())
    # two rounds: (small sent, small back, large sent, large back)
    clock.times = [0.0, 0.0010, 0.0020, 0.0040, 1.0, 1.0004, 1.0010, 1.0030]
    latency, per_byte = clock.figures(1000)
    assert latency == pytest.approx(0.0002)
    assert per_byte == pytest.approx((0.0020 - 0.0004) / 1000)
    assert np.isfinite(per_byte)
