"""Recursive doubling by host as one program (programs_hd.host_doubling), proved by the simulator
(tests/ringsim.py): the shipped program, executor, values and planes over in-memory links, under
seeded random interleavings, over hosts of 1 to 5 consecutive ranks and 1 to 8 hosts, powers of two
and not (the leaders then fold). Every rank must end with the ring's bytes where sums are exact;
mismatched arguments and damaged frames fail every rank, not one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from reference import numpy_reduce
from ringsim import simulate
from test_algorithms_sim import SLOW, T, assert_same_bytes, data, lengths, run_algorithm

from ringserve.errors import CorruptFrameError, MismatchError
from ringserve.ring import REDUCE_OPS
from ringserve.worker.dataplane import programs_hd, routes
from ringserve.worker.dataplane.programs import Ring
from ringserve.worker.dataplane.session import Session
from ringserve.worker.ops import collectives

QUICK = ((2, 2), (2, 3), (3, 3), (4, 2), (1, 3), (2, 1))  # (ranks per host, hosts)
MORE = ((2, 4), (2, 5), (2, 8), (3, 2), (3, 5), (4, 3), (5, 3), (1, 6), (8, 2))


@pytest.mark.parametrize(("local", "hosts"), [pytest.param(lo, h, id=f"{lo}x{h}") for lo, h in QUICK]
                         + [pytest.param(lo, h, marks=SLOW, id=f"{lo}x{h}") for lo, h in MORE])
async def test_every_op_and_length_reduces_exactly_and_every_rank_ends_with_the_ring_s_bytes(
        local: int, hosts: int) -> None:
    world = local * hosts
    algorithm = routes.by_hosts_of(local)
    plan = [(op, dtype, n, chunk) for op in REDUCE_OPS for dtype in (np.int32, np.float32)
            for n, chunk in zip(lengths(world), (1, 3, 1000, 3, 1, 1000), strict=False)]
    inputs = [data(world, n, dtype, i, op) for i, (op, dtype, n, _) in enumerate(plan)]

    async def call(session: Session, rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
        outs = []
        for i, (op, _, _, chunk) in enumerate(plan):
            x = inputs[i][rank]
            mine = await run_algorithm(algorithm, x, op, chunk)(session, rank)
            ring = await collectives.allreduce(session, x, op=op, name=None, chunk_bytes=chunk * x.itemsize, timeout_s=T)
            outs.append((mine, ring))
        return outs

    results = await simulate(world, call, seed=world * 3 + local, timeout_s=120)
    for i, (op, dtype, n, chunk) in enumerate(plan):
        where = f"{algorithm} {op} {np.dtype(dtype)} hosts={hosts} length={n} chunk={chunk}"
        mine = [results[r][i][0] for r in range(world)]
        assert_same_bytes(mine, where)
        assert mine[0].tobytes() == results[0][i][1].tobytes(), f"differs from the ring: {where}"
        np.testing.assert_array_equal(mine[0], numpy_reduce(inputs[i], op), err_msg=where)


async def test_floats_that_do_not_sum_exactly_still_end_the_same_on_every_rank() -> None:
    world, local = 10, 2  # 5 hosts: one leader folds into another
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(333).astype(np.float32) for _ in range(world)]

    async def call(session: Session, rank: int) -> np.ndarray:
        return await run_algorithm(routes.by_hosts_of(local), xs[rank], "average", 50)(session, rank)

    outs = await simulate(world, call, seed=11)
    assert_same_bytes(outs, "float32 average")
    np.testing.assert_allclose(outs[0], np.mean(xs, axis=0), rtol=1e-5, atol=1e-6)


async def test_a_rank_whose_arguments_differ_fails_every_rank_with_mismatch_error_not_a_hang() -> None:
    world = 6

    async def call(session: Session, rank: int) -> BaseException | None:
        x = np.ones(7 if rank == 3 else 6, dtype=np.float32)
        try:
            await run_algorithm(routes.by_hosts_of(2), x, "sum", 2)(session, rank)
        except MismatchError as exc:
            return exc
        return None

    outcomes = await simulate(world, call, seed=5, aborts=True, abort_grace_s=0.5)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, MismatchError), f"rank {rank} returned {outcome!r}"
        assert "rank 3: allreduce float32 (7,)" in str(outcome)


async def test_with_checksums_it_confirms_and_a_damaged_frame_fails_every_rank() -> None:
    world = 6
    xs = data(world, 40, np.int64, 1)
    algorithm = routes.by_hosts_of(3)

    async def call(session: Session, rank: int) -> np.ndarray:
        return await run_algorithm(algorithm, xs[rank], "sum", 4)(session, rank)

    outs = await simulate(world, call, seed=3, checksum=True)
    assert_same_bytes(outs, algorithm)
    np.testing.assert_array_equal(outs[0], sum(xs))

    async def damaged(session: Session, rank: int) -> BaseException | None:
        plane = session.plane
        if rank == 3:  # a leader: the last byte of its second payload is flipped on its link
            send = plane.send
            sent = [0]

            def flip(link: Any, key: str, inbox: Any, **frame: Any) -> None:
                send(link, key, inbox, **frame)
                sent[0] += 1 if frame["count"] else 0
                if sent[0] == 2 and frame["count"] and link is not None:
                    raw, is_data = link._frames[-1]
                    link._frames[-1] = (raw[:-1] + bytes([raw[-1] ^ 0xFF]), is_data)
            plane.send = flip  # type: ignore[method-assign]
        try:
            await run_algorithm(algorithm, xs[rank], "sum", 4)(session, rank)
        except CorruptFrameError as exc:
            return exc
        return None

    outcomes = await simulate(world, damaged, seed=4, checksum=True, aborts=True, abort_grace_s=0.5)
    assert all(isinstance(o, CorruptFrameError) for o in outcomes), outcomes


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
        list(programs_hd.host_doubling(Ring(tuple(range(4)), 0), 3, 10, 4))
