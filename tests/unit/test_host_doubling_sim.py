"""Recursive doubling by host as one program (halving_doubling.host_doubling), proved by the simulator
(tests/ringsim.py): the shipped program, executor, values and planes over in-memory links, under
seeded random interleavings, over hosts of 1 to 5 consecutive ranks and 1 to 8 hosts, powers of two
and not (the leaders then fold). Every rank must end with the ring's bytes where sums are exact;
mismatched arguments and damaged frames fail every rank, not one (test_algorithms_sim.py's cases
for every algorithm, host_doubling among them)."""

from __future__ import annotations

import numpy as np
import pytest
from ringsim import simulate
from test_algorithms_sim import (
    SLOW,
    assert_same_bytes,
    check_against_the_ring,
    lengths,
    run_algorithm,
)

from ringserve.ring import REDUCE_OPS
from ringserve.worker.dataplane import routes
from ringserve.worker.dataplane.programs import Ring, halving_doubling
from ringserve.worker.dataplane.session import Session

QUICK = ((2, 2), (2, 3), (3, 3), (4, 2), (1, 3), (2, 1))  # (ranks per host, hosts)
MORE = ((2, 4), (2, 5), (2, 8), (3, 2), (3, 5), (4, 3), (5, 3), (1, 6), (8, 2))


@pytest.mark.parametrize(("local", "hosts"), [pytest.param(lo, h, id=f"{lo}x{h}") for lo, h in QUICK]
                         + [pytest.param(lo, h, marks=SLOW, id=f"{lo}x{h}") for lo, h in MORE])
async def test_every_op_and_length_reduces_exactly_and_every_rank_ends_with_the_ring_s_bytes(
        local: int, hosts: int) -> None:
    world = local * hosts
    plan = [(op, dtype, n, chunk) for op in REDUCE_OPS for dtype in (np.int32, np.float32)
            for n, chunk in zip(lengths(world), (1, 3, 1000, 3, 1, 1000), strict=False)]
    await check_against_the_ring(routes.by_hosts_of(local), world, plan, seed=world * 3 + local, where=f"hosts={hosts}")


async def test_floats_that_do_not_sum_exactly_still_end_the_same_on_every_rank() -> None:
    world, local = 10, 2  # 5 hosts: one leader folds into another
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(333).astype(np.float32) for _ in range(world)]

    async def call(session: Session, rank: int) -> np.ndarray:
        return await run_algorithm(routes.by_hosts_of(local), xs[rank], "average", 50)(session, rank)

    outs = await simulate(world, call, seed=11)
    assert_same_bytes(outs, "float32 average")
    np.testing.assert_allclose(outs[0], np.mean(xs, axis=0), rtol=1e-5, atol=1e-6)


def test_a_host_s_ranks_talk_to_their_leader_only_and_leaders_to_their_doubling_partners() -> None:
    algorithm = routes.by_hosts_of(2)
    ring = tuple(range(10))  # 5 hosts of 2: host 0's leader (position 0) folds into host 1's (2)
    assert routes.sources(algorithm, Ring(ring, 3)) == {2}  # and the ring's predecessor, 2
    assert routes.sinks(algorithm, Ring(ring, 3)) == {2, 4}  # and the ring's successor, 4
    assert routes.sources(algorithm, Ring(ring, 0)) - {9} == {1, 2}
    assert routes.sources(algorithm, Ring(ring, 2)) - {1} == {3, 0, 4, 6}  # its member, the folded, partners
    assert routes.sources(algorithm, Ring(ring, 8)) - {7} == {9, 4, 6}
    assert routes.sources("host_doubling/3", Ring(ring, 3)) == {2}  # 10 is no multiple of 3: no peers


def test_a_ring_that_is_no_multiple_of_its_hosts_is_refused() -> None:
    with pytest.raises(ValueError, match="no hosts of 3"):
        list(halving_doubling.host_doubling(Ring(tuple(range(4)), 0), 3, 10, 4))
