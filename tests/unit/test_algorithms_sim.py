"""Halving-doubling, recursive doubling, the double binary tree and the 2D ring, proved by the
simulator (tests/ringsim.py): the shipped programs, executor, values and planes over in-memory links,
under seeded random interleavings, at worlds 2 to 17, powers of two and not.

Each check compares every rank's result with numpy's and with the ring's (bit for bit where sums
are exact), checks that every rank holds the same bytes, that no frame went unused, and that
nothing hangs. The default run takes a representative set of worlds; ``-m slow`` takes them all.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from reference import numpy_reduce
from ringsim import simulate, simulate_rings

from ringserve import codecs, topology
from ringserve.errors import CorruptFrameError, MismatchError
from ringserve.ring import REDUCE_OPS, segment_bounds
from ringserve.selection import HALVING_DOUBLING, RECURSIVE_DOUBLING, RING2D, TREE, LinkCosts
from ringserve.worker.dataplane import routes
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.session import Session
from ringserve.worker.ops import algorithms, collectives
from ringserve.worker.ops.planner import VIEW, Plan, Stage

ALGORITHMS = (HALVING_DOUBLING, RECURSIVE_DOUBLING, TREE, RING2D)
QUICK = (2, 3, 6, 8)  # the default run: powers of two, a fold (3, 6), a prime (3), a grid (6, 8)
ALL = tuple(range(2, 18))
T = 20.0
WAN = LinkCosts.of(0.02, 100e6 / 8)


def worlds_for(algorithm: str, worlds: tuple[int, ...]) -> list[int]:
    """The worlds an algorithm runs over (a 2D ring needs a grid of two rows or more)."""
    return [w for w in worlds if algorithm != RING2D or topology.grid(w)[0] >= 2]


# A slow case takes up to 100 s on a machine at load 35: room past the default 120 s.
SLOW = [pytest.mark.slow, pytest.mark.timeout(600)]


def cases(worlds: tuple[int, ...]) -> list[Any]:
    return [pytest.param(a, w, marks=SLOW if w not in QUICK else [], id=f"{a}-{w}")
            for a in ALGORITHMS for w in worlds_for(a, worlds)]


def lengths(world: int) -> list[int]:
    return sorted({0, 1, world - 1, world, 3 * world + 2, 61})


def data(world: int, length: int, dtype: Any, seed: int, op: str = "sum") -> list[np.ndarray]:
    """Integers, as floats where asked: small enough that every order of summation (or, for
    products, of multiplication) is exact. Integer products wrap alike in any order."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        high = 3 if op == "product" else 50
        return [rng.integers(-high, high, length).astype(dtype) for _ in range(world)]
    return [rng.integers(-1000, 1000, length).astype(dtype) for _ in range(world)]


def run_algorithm(algorithm: str, x: np.ndarray, op: str, chunk: int, **kw: Any) -> Callable[[Session, int], Any]:
    async def call(session: Session, rank: int) -> np.ndarray:
        buf = np.empty_like(x)
        descriptor = Descriptor("allreduce", dtype=x.dtype.name, shape=x.shape, op=op)
        plan = algorithms.forced(session, algorithm, collectives.wire_call("allreduce", buf, kw.get("coder")),
                                 chunk * x.itemsize)
        await algorithms.allreduce(session, plan, x, buf, op=op, name=None, descriptor=descriptor, timeout_s=T, **kw)
        return buf
    return call


def chunked(op: str, algorithm: str, chunk_elems: int) -> Plan:
    """A plan of one stage by ``algorithm`` in chunks of ``chunk_elems``, as the planner makes them."""
    return Plan(op, algorithm, (Stage("", VIEW, algorithm, chunk_elems),))


def by_halving(op: str) -> Plan:
    return chunked(op, HALVING_DOUBLING, 2)


def assert_same_bytes(outs: list[np.ndarray], where: str) -> None:
    for r, out in enumerate(outs):
        assert out.tobytes() == outs[0].tobytes(), f"rank {r} ended with other bytes than rank 0 ({where})"


@pytest.mark.parametrize(("algorithm", "world"), cases(ALL))
async def test_every_op_and_length_reduces_exactly_and_every_rank_ends_with_the_ring_s_bytes(
        algorithm: str, world: int) -> None:
    rng = random.Random(world * 7 + len(algorithm))
    every = lengths(world)
    # The default run takes every op and dtype at a few lengths; -m slow every length of each.
    plan = [(op, dtype, n, rng.choice((1, 3, 1000)))
            for op in REDUCE_OPS for dtype in (np.int32, np.float32)
            for n in (every if world not in QUICK else rng.sample(every, 2))]
    await check_against_the_ring(algorithm, world, plan, seed=world, where=f"world={world}")


Calls = list[tuple[str, Any, int, int]]  # (op, dtype, length, chunk in elements) of each call


async def check_against_the_ring(algorithm: str, world: int, plan: Calls, *, seed: int, where: str) -> None:
    """Runs each call of ``plan`` under ``algorithm`` and on the ring, on exact inputs: every rank
    must end with the same bytes, the ring's, and numpy's result."""
    inputs = [data(world, n, dtype, i, op) for i, (op, dtype, n, _) in enumerate(plan)]

    async def call(session: Session, rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
        outs = []
        for i, (op, _, _, chunk) in enumerate(plan):
            x = inputs[i][rank]
            mine = await run_algorithm(algorithm, x, op, chunk)(session, rank)
            ring = await collectives.allreduce(session, x, op=op, name=None, chunk_bytes=chunk * x.itemsize, timeout_s=T)
            outs.append((mine, ring))
        return outs

    results = await simulate(world, call, seed=seed, timeout_s=120)
    for i, (op, dtype, n, chunk) in enumerate(plan):
        at = f"{algorithm} {op} {np.dtype(dtype)} {where} length={n} chunk={chunk}"
        mine = [results[r][i][0] for r in range(world)]
        assert_same_bytes(mine, at)
        assert mine[0].tobytes() == results[0][i][1].tobytes(), f"differs from the ring: {at}"
        np.testing.assert_array_equal(mine[0], numpy_reduce(inputs[i], op), err_msg=at)


@pytest.mark.parametrize(("algorithm", "world"), [c for c in cases(ALL) if c.values[0] != RECURSIVE_DOUBLING])
async def test_under_every_codec_the_result_is_the_same_everywhere_within_bounds_and_feedback_keeps_the_loss(
        algorithm: str, world: int) -> None:
    length = 3 * world + 257
    rng = np.random.default_rng(world)
    specs = [(c, np.dtype(d)) for c in ("fp16", "bf16", "int8") for d in (np.float32, np.float64)]
    inputs = [[rng.standard_normal(length).astype(d) for _ in range(world)] for _, d in specs]

    async def call(session: Session, rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
        outs = []
        for i, (compression, dtype) in enumerate(specs):
            x = inputs[i][rank]
            residual = np.zeros(length, dtype=codecs.sum_dtype(dtype))
            out = await run_algorithm(algorithm, x, "average", 40, coder=codecs.codec(compression),
                                      residual=residual)(session, rank)
            outs.append((out, residual))
        return outs

    results = await simulate(world, call, seed=world)
    for i, (compression, dtype) in enumerate(specs):
        where = f"{algorithm} {compression} {dtype} world={world}"
        outs = [results[r][i][0] for r in range(world)]
        assert_same_bytes(outs, where)
        exact = numpy_reduce([x.astype(np.float64) for x in inputs[i]], "average")
        scale = np.abs(np.stack(inputs[i])).sum(axis=0).max()
        np.testing.assert_allclose(outs[0], exact, atol=0.02 * scale, err_msg=where)
        # Each element is encoded once per rank, and each loss kept by the rank that made it:
        # what the ranks kept plus what they lost is the exact sum.
        lost = sum(results[r][i][1] for r in range(world))
        np.testing.assert_allclose(outs[0].astype(np.float64) * world + lost, exact * world,
                                   atol=1e-4 * scale * world, err_msg=where)


@pytest.mark.parametrize("world", [w for w in ALL if w & (w - 1) == 0])
async def test_reduce_scatter_and_allgather_by_halving_doubling_match_numpy_and_the_ring(world: int) -> None:
    cols, rows = 3, 2 * world + 1
    xs = [x.reshape(rows, cols) for x in data(world, rows * cols, np.int64, world)]
    blocks = [np.arange(r * 5 % 7, dtype=np.float32) + r for r in range(world)]  # ragged, some empty

    async def call(session: Session, rank: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        src = xs[rank].reshape(-1)
        buf = np.empty_like(src)
        bounds = segment_bounds(rows, world, cols)
        await algorithms.reduce_scatter(session, by_halving("reduce_scatter"), src, buf, bounds, op="sum", name=None,
                                        descriptor=Descriptor("reduce_scatter"), timeout_s=T)
        a, b = bounds[rank]
        ring = await collectives.reduce_scatter(session, xs[rank], op="sum", name=None, chunk_bytes=16, timeout_s=T)
        values = collectives.Blocks(np.dtype(np.float32), [blocks[rank] if o == rank else None for o in range(world)])
        await algorithms.allgather_blocks(session, by_halving("allgather"), values, blocks[rank].size, name=None,
                                          descriptor=Descriptor("allgather"), timeout_s=T)
        gathered = [b if b is not None else np.empty(0, np.float32) for b in values.blocks]
        assert buf[a:b].tobytes() == ring.reshape(-1).tobytes()
        return buf[a:b], ring, gathered

    results = await simulate(world, call, seed=world)
    total = sum(xs).reshape(-1)
    bounds = segment_bounds(rows, world, cols)
    for r in range(world):
        a, b = bounds[r]
        np.testing.assert_array_equal(results[r][0], total[a:b])
        for o in range(world):
            np.testing.assert_array_equal(results[r][2][o], blocks[o])


@pytest.mark.parametrize("world", [2, 3, 5, 8, pytest.param(13, marks=pytest.mark.slow), pytest.param(17, marks=pytest.mark.slow)])
async def test_a_tree_broadcast_from_every_root_gives_every_rank_the_roots_bytes(world: int) -> None:
    payloads = [np.arange(r * 3 + 1, dtype=np.int64) * (r + 1) for r in range(world)]

    async def call(session: Session, rank: int) -> list[np.ndarray]:
        got = []
        for root in range(world):
            blocks: list[np.ndarray | None] = [None] * world
            if rank == root:
                blocks[root] = payloads[root]
            values = collectives.Blocks(np.dtype(np.int64), blocks)
            await algorithms.broadcast(session, chunked("broadcast", TREE, 2), values, root, payloads[root].size,
                                       name=None, descriptor=Descriptor("broadcast", root=root), timeout_s=T)
            block = values.blocks[root]
            assert block is not None
            got.append(block)
        return got

    results = await simulate(world, call, seed=world)
    for r in range(world):
        for root in range(world):
            np.testing.assert_array_equal(results[r][root], payloads[root])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
async def test_process_sets_run_each_algorithm_over_their_sub_rings_beside_the_whole_views(algorithm: str) -> None:
    world = 9
    subsets = [(8, 1, 5, 3), (0, 2, 4, 6, 7, 1)]  # out of rank order: positions are not ranks
    xs = data(world, 37, np.int64, 3)

    def on(members: tuple[int, ...] | None) -> Callable[[Session, int], Any]:
        ranks = members if members is not None else tuple(range(world))
        name = RECURSIVE_DOUBLING if algorithm == RING2D and topology.grid(len(ranks))[0] < 2 else algorithm

        async def call(session: Session, position: int) -> np.ndarray:
            return await run_algorithm(name, xs[ranks[position]], "sum", 5)(session, position)
        return call

    results = await simulate_rings(world, {None: on(None), **{m: on(m) for m in subsets}}, seed=11)
    for members, outs in results.items():
        ranks = members if members is not None else tuple(range(world))
        assert_same_bytes(outs, f"{algorithm} over {ranks}")
        np.testing.assert_array_equal(outs[0], sum(xs[r] for r in ranks))


@pytest.mark.parametrize("algorithm", [*ALGORITHMS, "host_doubling/2"])
async def test_a_rank_whose_arguments_differ_fails_every_rank_with_mismatch_error_not_a_hang(algorithm: str) -> None:
    world = 6

    async def call(session: Session, rank: int) -> BaseException | None:
        x = np.ones(7 if rank == 4 else 6, dtype=np.float32)
        try:
            await run_algorithm(algorithm, x, "sum", 2)(session, rank)
        except MismatchError as exc:
            return exc
        return None

    outcomes = await simulate(world, call, seed=5, aborts=True, abort_grace_s=0.5)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, MismatchError), f"rank {rank} returned {outcome!r}"
        assert "rank 4: allreduce float32 (7,)" in str(outcome)


@pytest.mark.parametrize("algorithm", [HALVING_DOUBLING, TREE])
async def test_ranks_that_disagree_on_the_algorithm_fail_with_mismatch_error_naming_both(algorithm: str) -> None:
    world = 5

    async def call(session: Session, rank: int) -> BaseException | None:
        x = np.ones(6, dtype=np.float32)
        try:
            if rank == 2:
                await collectives.allreduce(session, x, op="sum", name="g", chunk_bytes=8, timeout_s=T)
            else:
                buf = np.empty_like(x)
                plan = algorithms.forced(session, algorithm, collectives.wire_call("allreduce", buf, None), 8)
                await algorithms.allreduce(session, plan, x, buf, op="sum", name="g",
                                           descriptor=Descriptor("allreduce", dtype="float32", shape=(6,), op="sum"),
                                           timeout_s=T)
        except MismatchError as exc:
            return exc
        return None

    outcomes = await simulate(world, call, seed=2, aborts=True, abort_grace_s=0.5)
    for outcome in outcomes:
        assert isinstance(outcome, MismatchError)
        assert f"algo={algorithm}" in str(outcome) and "rank 2: allreduce float32 (6,) op=sum;" in str(outcome)


@pytest.mark.parametrize("algorithm", [*ALGORITHMS, "host_doubling/3"])  # host doubling: rank 3 leads a host
async def test_with_checksums_every_algorithm_confirms_and_a_damaged_frame_fails_every_rank(algorithm: str) -> None:
    world = 6
    xs = data(world, 40, np.int64, 1)

    async def call(session: Session, rank: int) -> np.ndarray:
        return await run_algorithm(algorithm, xs[rank], "sum", 4)(session, rank)

    outs = await simulate(world, call, seed=3, checksum=True)
    assert_same_bytes(outs, algorithm)
    np.testing.assert_array_equal(outs[0], sum(xs))

    async def damaged(session: Session, rank: int) -> BaseException | None:
        if rank == 3:  # mid-way
            damage(session, 3)
        try:
            await run_algorithm(algorithm, xs[rank], "sum", 4)(session, rank)
        except CorruptFrameError as exc:
            return exc
        return None

    outcomes = await simulate(world, damaged, seed=4, checksum=True, aborts=True, abort_grace_s=0.5)
    assert all(isinstance(o, CorruptFrameError) for o in outcomes), outcomes


def damage(session: Session, nth: int) -> None:
    """The last byte of the ``nth`` payload this rank sends is flipped on its link."""
    plane = session.plane
    send = plane.send
    sent = [0]

    def flip(link: Any, key: str, inbox: Any, **frame: Any) -> None:
        send(link, key, inbox, **frame)
        sent[0] += 1 if frame["count"] else 0
        if sent[0] == nth and frame["count"] and link is not None:
            raw, is_data = link._frames[-1]
            link._frames[-1] = (raw[:-1] + bytes([raw[-1] ^ 0xFF]), is_data)
    plane.send = flip  # type: ignore[method-assign]


async def test_auto_picks_by_the_measured_links_and_names_the_algorithm_on_every_rank() -> None:
    world = 8
    x = np.arange(64, dtype=np.float32)

    async def call(session: Session, rank: int) -> tuple[np.ndarray, str]:
        out = await collectives.allreduce(session, x, op="sum", name="auto", chunk_bytes=64, timeout_s=T)
        chosen = [k for k in session.counters.algorithms if k[0] == "allreduce"]
        return out, chosen[0][1]

    given = await simulate(world, call, seed=1, algorithm="auto", links=WAN)
    assert {algorithm for _, algorithm in given} == {RECURSIVE_DOUBLING}
    measured = await simulate(world, call, seed=1, algorithm="auto")  # links measured over the memory links
    assert len({algorithm for _, algorithm in measured}) == 1
    for out, _ in given + measured:
        np.testing.assert_array_equal(out, x * world)
    assert routes.algorithm_of(routes.tagged(Descriptor("allreduce"), RECURSIVE_DOUBLING)) == RECURSIVE_DOUBLING
