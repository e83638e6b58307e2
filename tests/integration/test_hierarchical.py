"""Hierarchical allreduce (ringserve/worker/ops/hierarchy.py) between real workers, hosts told apart by
their hostname setting: exact against the flat ring, the same bytes on every rank, chosen only where
the view allows, and a mismatch still fails every rank within the abort grace."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ringserve.errors import MismatchError
from ringserve.worker.dataplane.policy import Place
from ringserve.worker.ops import planner

pytestmark = pytest.mark.timeout(60)


def place(hosts: tuple[int, ...], rank: int) -> Place:
    return Place(view_id=1, rank=rank, size=len(hosts), addresses=tuple("a" * len(hosts)), hosts=hosts)


@pytest.mark.parametrize(("hosts", "rank", "rings"), [
    ((0, 0, 1, 1), 0, ((0, 1), (0, 2))),
    ((0, 0, 1, 1), 3, ((2, 3), (1, 3))),
    ((0, 1, 0, 1), 1, ((1, 3), (0, 1))),  # ranks of a host need not be adjacent
    ((0, 0, 0, 1, 1, 1), 4, ((3, 4, 5), (1, 4))),
])
def test_each_rank_runs_its_hosts_ring_and_the_ring_of_its_local_position(hosts, rank, rings) -> None:
    assert planner.topology(place(hosts, rank)) == rings
    assert planner.chosen("auto", place(hosts, rank)) == rings


@pytest.mark.parametrize(("hosts", "auto", "forced"), [
    ((0, 0, 1), False, False),  # hosts of different sizes: the flat ring, whatever the setting
    ((0, 0, 0, 0), False, True),  # one host
    ((0, 1, 2), False, True),  # one worker per host
    ((), False, False),  # hosts unknown
])
def test_the_flat_ring_where_the_view_gives_no_hierarchy(hosts, auto, forced) -> None:
    p = place(hosts, 0) if hosts else Place(view_id=1, rank=0, size=3, addresses=("a", "b", "c"))
    assert (planner.chosen("auto", p) is not None) == auto
    assert (planner.chosen("1", p) is not None) == forced
    assert planner.chosen("0", p) is None


# The worlds below run by host always (hierarchical="1"): under "auto" with RINGSERVE_ALGORITHM=auto,
# an allreduce runs by host where the cost model says it pays (selection.by_host).
def two_hosts(i: int) -> dict:
    return {"hostname": f"host{i % 2}"}


async def test_integer_sums_equal_the_flat_rings_bit_for_bit_on_every_rank(world_factory) -> None:
    # Links given: no measure of them adds a collective to the count (ops/algorithms.py).
    links = {"link_latency_s": 1e-4, "link_mbps": 10_000.0}
    hier = await world_factory(4, each=two_hosts, chunk_bytes=64 << 10, hierarchical="1", **links)
    flat = await world_factory(4, each=two_hosts, chunk_bytes=64 << 10, hierarchical="0", **links)
    assert {w.local_size for w in hier.workers} == {2} and {w.cross_size for w in hier.workers} == {2}
    rng = np.random.default_rng(3)
    for dtype, n in ((np.int64, 100_003), (np.int32, 7), (np.float32, 250_000)):
        # floats of small integers sum exactly in any order
        inputs = [rng.integers(-1000, 1000, size=n).astype(dtype) for _ in range(4)]
        done = [w.counters.collectives_done for w in hier.workers]
        fused = [w.counters.algorithms.get(("allreduce", "host_doubling/2"), 0) for w in hier.workers]
        got = await hier.map("allreduce", inputs, op="sum", name="x")
        # Three stages, or, where recursive doubling crosses the hosts, one program (hierarchy.py).
        one = [w.counters.algorithms.get(("allreduce", "host_doubling/2"), 0) - f
               for w, f in zip(hier.workers, fused, strict=True)]
        assert one in ([0] * 4, [1] * 4), one
        assert [w.counters.collectives_done - d for w, d in zip(hier.workers, done, strict=True)] == [
            1 if one[0] else 3] * 4
        want = await flat.map("allreduce", inputs, op="sum", name="x")
        for g in got:
            assert g.dtype == dtype and g.tobytes() == want[0].tobytes()
        np.testing.assert_array_equal(got[0], sum(i.astype(np.int64) for i in inputs))


async def test_average_min_and_in_place_results_are_identical_on_every_rank(world_factory) -> None:
    world = await world_factory(4, each=two_hosts, chunk_bytes=32 << 10, hierarchical="1")
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal((300, 101)).astype(np.float32) for _ in range(4)]
    avg = await world.map("allreduce", inputs, op="average", name="avg")
    assert all(a.tobytes() == avg[0].tobytes() and a.shape == (300, 101) for a in avg)
    np.testing.assert_allclose(avg[0], sum(inputs) / 4, rtol=1e-5, atol=1e-6)
    low = await world.map("allreduce", inputs, op="min", name="min")
    np.testing.assert_array_equal(low[0], np.minimum.reduce(inputs))
    copies = [x.copy() for x in inputs]
    await world.each(lambda w: w.allreduce(copies[w.rank], op="sum", name="inplace", out=copies[w.rank]))
    assert all(c.tobytes() == copies[0].tobytes() for c in copies)
    np.testing.assert_allclose(copies[0], sum(inputs), rtol=1e-5, atol=1e-5)


async def test_tensors_smaller_than_the_world_and_empty_ones_still_reduce(world_factory) -> None:
    world = await world_factory(4, each=two_hosts, hierarchical="1")
    for n in (0, 1, 3):
        got = await world.map("allreduce", [np.full(n, r + 1, dtype=np.int32) for r in range(4)], op="sum", name="tiny")
        assert all(g.tolist() == [10] * n for g in got)


async def test_hosts_of_different_sizes_keep_the_flat_ring(world_factory) -> None:
    world = await world_factory(3, each=lambda i: {"hostname": "a" if i < 2 else "b"}, link_latency_s=1e-4,
                                link_mbps=10_000.0)
    done = [w.counters.collectives_done for w in world.workers]
    got = await world.map("allreduce", [np.arange(1000, dtype=np.int64)] * 3, op="sum", name="flat")
    assert all((g == 3 * np.arange(1000)).all() for g in got)
    assert [w.counters.collectives_done - d for w, d in zip(world.workers, done, strict=True)] == [1] * 3


async def test_a_mismatch_on_one_host_fails_the_ranks_of_the_other_within_the_abort_grace(world_factory) -> None:
    world = await world_factory(4, each=two_hosts, abort_grace_s=1.0, hierarchical="1")
    odd = world.workers[0].rank
    start = time.monotonic()
    outcomes = await world.each_outcome(
        lambda w: w.allreduce(np.ones(1000 if w.rank != odd else 999, dtype=np.float32), op="sum", name="bad"))
    took = time.monotonic() - start
    assert all(isinstance(o, MismatchError) for o in outcomes), outcomes
    assert took < 10, took  # the collective deadline is 30 s here
    got = await world.map("allreduce", [np.ones(10, dtype=np.int32)] * 4, op="sum", name="after")
    assert all((g == 4).all() for g in got)



def hosts_in_order(i: int) -> dict:
    # Ranks as the launchers number them, by host (without the hint a rank is the order of joining).
    return {"hostname": f"host{i // 2}", "rank_hint": i}


@pytest.mark.parametrize(("hosts", "shape"), [(4, "one program"), (3, "three stages")])
async def test_a_small_tensor_by_host_across_a_wan_runs_as_one_program_where_doubling_crosses_the_hosts(
        world_factory, hosts: int, shape: str) -> None:
    # Links given (a WAN's): auto runs 64 KiB by host; across 4 hosts by recursive doubling, so as
    # one program where one rank per host crosses (programs_hd.host_doubling); across 3 by a tree,
    # so in three stages.
    n = 2 * hosts
    wan = {"link_latency_s": 0.02, "link_mbps": 100.0}
    world = await world_factory(n, each=hosts_in_order, chunk_bytes=64 << 10, **wan)
    flat = await world_factory(n, chunk_bytes=64 << 10, hierarchical="0", algorithm="ring")
    rng = np.random.default_rng(5)
    inputs = [rng.integers(-1000, 1000, size=16 << 10).astype(np.float32) for _ in range(n)]
    want = (await flat.map("allreduce", inputs, op="sum", name="x"))[0]
    done = [v.counters.collectives_done for v in world.workers]
    sent = [v.counters.bytes_sent for v in world.workers]
    got = await world.map("allreduce", inputs, op="sum", name="x")
    for g in got:
        assert g.tobytes() == want.tobytes()
    calls = [v.counters.collectives_done - d for v, d in zip(world.workers, done, strict=True)]
    assert calls == [1 if shape == "one program" else 3] * n
    for rank, v in enumerate(world.workers):
        assert (("allreduce", "host_doubling/2") in v.counters.algorithms) == (shape == "one program")
        if shape == "one program" and v.local_rank:  # it sends its vector to its host's leader, and nothing else
            assert v.counters.bytes_sent - sent[rank] < inputs[0].nbytes + 1024
