"""The shipped collectives, proved by a simulator of the ring for worlds 1..16, and ring.py's schedule.

The simulator (tests/ringsim.py) runs the real collectives: their programs (programs/__init__.py) through
the executor, on real sessions linked by in-memory links, under seeded random interleavings (random
delays per frame, random send windows down to one frame, random start times). It checks every
rank's result against numpy's answer, that all ranks hold the same bytes, that no frame was sent
that nobody used, and that the ring never hangs. A broken program fails it (see the last tests of
the simulated section). Nothing here opens a socket.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from reference import numpy_reduce
from ringsim import simulate

from ringserve import codecs, wire
from ringserve.errors import CollectiveTimeoutError, InvalidArgumentError, MismatchError
from ringserve.ring import (
    REDUCE_OPS,
    allgather_step,
    check_op,
    chunk_bounds,
    combine_into,
    finish_into,
    predecessor,
    reduce_scatter_step,
    segment_bounds,
    successor,
)
from ringserve.worker.dataplane import programs
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import FORWARD, Phase, Place, Program, Recv, Ring, Signal, executor
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Blocks, Raw
from ringserve.worker.ops import collectives

WORLDS = list(range(1, 17))
DTYPES = list(wire.DTYPES)
CODECS = ("fp16", "bf16", "int8")
T = 10.0  # a collective's deadline: a hang fails the simulation well before pytest's timeout


def lengths_for(world: int) -> list[int]:
    """Zero, one, fewer elements than ranks, exactly as many, uneven, and a longer odd length."""
    return sorted({0, 1, 2, max(world - 1, 0), world, world + 1, 3 * world + 2, 61})


def rank_data(world: int, length: int, dtype: np.dtype, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(length).astype(dtype) for _ in range(world)]
    info = np.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return [rng.integers(low, high, length).astype(dtype) for _ in range(world)]


def assert_bit_identical(results: list[np.ndarray], where: str = "") -> None:
    first = results[0].tobytes()
    for r, out in enumerate(results):
        assert out.tobytes() == first, f"rank {r} ended with different bytes than rank 0 {where}"


def assert_reduced(got: np.ndarray, xs: list[np.ndarray], op: str, where: str) -> None:
    expected = numpy_reduce(xs, op)
    if got.dtype.kind != "f" or op in ("min", "max"):
        np.testing.assert_array_equal(got, expected, err_msg=where)
    else:  # the ring adds in another order than numpy
        tol = {2: 4e-3, 4: 1e-6, 8: 1e-12}[got.dtype.itemsize] * len(xs)
        np.testing.assert_allclose(got, expected, rtol=tol, atol=tol, err_msg=where)


def case_seed(*parts: object) -> int:
    """A seed that is stable across runs (str hashes are salted per process)."""
    return zlib.crc32(repr(parts).encode())


def in_turn(calls: list[Callable[[Session, int], Any]]) -> Callable[[Session, int], Any]:
    """One rank's part of several collectives, run one after the other on one ring."""
    async def call(session: Session, rank: int) -> list[Any]:
        return [await c(session, rank) for c in calls]
    return call


# -- the shipped collectives, simulated --------------------------------------------------------------


CHUNKS = (1, 4, 1000)


def allreduce_cases(world: int, rng: random.Random) -> list[tuple[str, np.dtype, int, int]]:
    """(op, dtype, length, chunk elements): every dtype and every op, every length of lengths_for.

    Each dtype gets two ops (so every op is met) and each length one op; the slow test below runs
    every combination with every chunk size.
    """
    chunks = CHUNKS
    cases = []
    for i, dtype in enumerate(DTYPES):
        for op in (REDUCE_OPS[i % 4], REDUCE_OPS[(i + 1) % 4]):
            cases.append((op, np.dtype(dtype), rng.choice(lengths_for(world)), rng.choice(chunks)))
    for length in lengths_for(world):
        cases.append((rng.choice(REDUCE_OPS), np.dtype(np.int64), length, rng.choice(chunks)))
    return cases


async def check_allreduce(world: int, cases: list[tuple[str, np.dtype, int, int]], seed: int, timeout_s: float = 20.0) -> None:
    inputs = [rank_data(world, n, dtype, case_seed(world, i)) for i, (_, dtype, n, _) in enumerate(cases)]

    def one(i: int, op: str, chunk: int) -> Callable[[Session, int], Any]:
        async def call(session: Session, rank: int) -> np.ndarray:
            x = inputs[i][rank]
            return await collectives.allreduce(session, x, op=op, name=None, chunk_bytes=chunk * x.itemsize, timeout_s=T)
        return call

    results = await simulate(world, in_turn([one(i, op, chunk) for i, (op, _, _, chunk) in enumerate(cases)]),
                             seed=seed, timeout_s=timeout_s)
    for i, (op, dtype, length, chunk) in enumerate(cases):
        outs = [results[r][i] for r in range(world)]
        where = f"{op} {dtype} world={world} length={length} chunk={chunk}"
        assert_bit_identical(outs, where)
        assert_reduced(outs[0], inputs[i], op, where)


@pytest.mark.parametrize("world", WORLDS)
async def test_allreduce_of_every_dtype_op_and_length_gives_every_rank_numpys_answer_in_the_same_bytes(world: int) -> None:
    await check_allreduce(world, allreduce_cases(world, random.Random(world)), seed=case_seed("allreduce", world))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("world", WORLDS)
async def test_allreduce_of_every_combination_of_dtype_op_length_and_chunk_size_is_exact(world: int, op: str, dtype: np.dtype) -> None:
    cases = [(op, np.dtype(dtype), n, c) for n in lengths_for(world) for c in CHUNKS]
    await check_allreduce(world, cases, seed=case_seed(world, op, str(dtype)), timeout_s=120)


@pytest.mark.parametrize("world", WORLDS)
async def test_compressed_allreduce_gives_every_rank_the_same_bytes_within_the_codecs_bound(world: int) -> None:
    length = 3 * world + 257  # some int8 blocks of 256 values, and a partial one
    cases = [(c, np.dtype(d), fb) for c in CODECS for d in (np.float32, np.float64) for fb in (False, True)]
    inputs = [rank_data(world, length, d, case_seed(world, i)) for i, (_, d, _) in enumerate(cases)]

    def one(i: int, compression: str, feedback: bool) -> Callable[[Session, int], Any]:
        async def call(session: Session, rank: int) -> tuple[np.ndarray, np.ndarray | None]:
            x = inputs[i][rank]
            residual = np.zeros(length, dtype=codecs.sum_dtype(x.dtype)) if feedback else None
            out = await collectives.allreduce(session, x, op="average", name=None, chunk_bytes=40 * x.itemsize,
                                              timeout_s=T, compression=compression, residual=residual)
            return out, residual
        return call

    results = await simulate(world, in_turn([one(i, c, fb) for i, (c, _, fb) in enumerate(cases)]),
                             seed=case_seed("codecs", world))
    for i, (compression, dtype, feedback) in enumerate(cases):
        outs = [results[r][i][0] for r in range(world)]
        where = f"{compression} {dtype} feedback={feedback} world={world}"
        assert_bit_identical(outs, where)
        exact = numpy_reduce([x.astype(np.float64) for x in inputs[i]], "average")
        # Each of the world partial sums is encoded once: a loose multiple of the codecs' bounds.
        scale = max(np.abs(np.stack(inputs[i])).sum(axis=0).max(), 1.0) if length else 1.0
        np.testing.assert_allclose(outs[0], exact, atol=0.02 * scale, err_msg=where)
        if feedback:
            # Error feedback: what every rank kept plus what it lost adds up to the exact sum.
            lost = sum(results[r][i][1] for r in range(world))
            np.testing.assert_allclose(outs[0].astype(np.float64) * world + lost, exact * world,
                                       atol=1e-4 * scale * world, err_msg=where)


@pytest.mark.parametrize("world", WORLDS)
async def test_reduce_scatter_gives_each_rank_its_rows_of_numpys_answer(world: int) -> None:
    cols = 3
    cases = [(rows, op) for rows, op in zip(sorted({1, world - 1, world, 2 * world + 1} - {0}), REDUCE_OPS * 2, strict=False)]
    inputs = [[x.reshape(rows, cols) for x in rank_data(world, rows * cols, np.int32, case_seed(world, rows))]
              for rows, _ in cases]

    def one(i: int, op: str) -> Callable[[Session, int], Any]:
        async def call(session: Session, rank: int) -> np.ndarray:
            return await collectives.reduce_scatter(session, inputs[i][rank], op=op, name=None, chunk_bytes=8, timeout_s=T)
        return call

    results = await simulate(world, in_turn([one(i, op) for i, (_, op) in enumerate(cases)]), seed=case_seed("rs", world))
    for i, (rows, op) in enumerate(cases):
        expected = np.array_split(numpy_reduce(inputs[i], op), world)
        for r in range(world):
            np.testing.assert_array_equal(results[r][i], expected[r], err_msg=f"rank {r} rows={rows} {op}")


@pytest.mark.parametrize("world", WORLDS)
async def test_allgather_of_blocks_of_different_sizes_concatenates_them_in_rank_order(world: int) -> None:
    rng = np.random.default_rng(world)
    patterns = {
        "zeros": [0] * world,
        "one_empty": [0 if r == world // 2 else 3 for r in range(world)],
        "mixed": [int(rng.integers(0, 9)) for _ in range(world)],
    }
    dtypes = [np.dtype(DTYPES[(world + i) % len(DTYPES)]) for i in range(len(patterns))]
    blocks = {name: [(np.arange(s * 2) % 100 + r).astype(dt).reshape(s, 2) for r, s in enumerate(sizes)]
              for (name, sizes), dt in zip(patterns.items(), dtypes, strict=True)}

    def one(name: str) -> Callable[[Session, int], Any]:
        async def call(session: Session, rank: int) -> np.ndarray:
            return await collectives.allgather(session, blocks[name][rank], name=name, chunk_bytes=5, timeout_s=T)
        return call

    async def objects(session: Session, rank: int) -> list[object]:
        return await collectives.allgather_object(session, {"rank": rank}, name=None, chunk_bytes=7, timeout_s=T)

    results = await simulate(world, in_turn([*(one(n) for n in patterns), objects]), seed=case_seed("ag", world))
    for r in range(world):
        for i, name in enumerate(patterns):
            np.testing.assert_array_equal(results[r][i], np.concatenate(blocks[name]), err_msg=f"rank {r} {name}")
        assert results[r][-1] == [{"rank": k} for k in range(world)]


@pytest.mark.parametrize("world", WORLDS)
async def test_broadcast_from_every_root_gives_every_rank_the_roots_bytes(world: int) -> None:
    lengths = [(0, 1, world + 2, 41)[root % 4] for root in range(world)]
    data = [np.random.default_rng(root).standard_normal(n).astype(np.float32) for root, n in enumerate(lengths)]

    def one(root: int) -> Callable[[Session, int], Any]:
        async def call(session: Session, rank: int) -> np.ndarray:
            mine = data[root] if rank == root else np.zeros_like(data[root])
            return await collectives.broadcast(session, mine, root=root, name=None, chunk_bytes=12, timeout_s=T)
        return call

    async def obj(session: Session, rank: int) -> object:
        value = {"from": 0, "blob": b"x" * 50} if rank == 0 else None
        return await collectives.broadcast_object(session, value, root=0, name=None, chunk_bytes=16, timeout_s=T)

    async def barrier(session: Session, rank: int) -> None:
        await collectives.barrier(session, timeout_s=T)

    results = await simulate(world, in_turn([*(one(root) for root in range(world)), obj, barrier]),
                             seed=case_seed("bcast", world))
    for r in range(world):
        for root in range(world):
            assert results[r][root].tobytes() == data[root].tobytes(), f"rank {r} root {root}"
        assert results[r][world] == {"from": 0, "blob": b"x" * 50}


async def every_collective(session: Session, rank: int) -> list[Any]:
    """One of each collective, some at once (two in flight on one ring), on small arrays."""
    world = session.place.size
    x = np.arange(2 * world + 3, dtype=np.float32) * (rank + 1)
    opts: dict[str, Any] = {"chunk_bytes": 8, "timeout_s": T}
    return [
        await collectives.allreduce(session, x, op="sum", name="a", **opts),
        await collectives.allreduce(session, x, op="sum", name="a", compression="int8", **opts),
        *(await asyncio.gather(
            collectives.broadcast(session, x, root=world - 1, name="b", **opts),
            collectives.allgather(session, x[: rank + 1], name="c", **opts),
            collectives.reduce_scatter(session, x, op="max", name="d", **opts),
        )),
    ]


def check_every_collective(world: int, results: list[list[Any]]) -> None:
    xs = [np.arange(2 * world + 3, dtype=np.float32) * (r + 1) for r in range(world)]
    for r, (total, coded, bcast, gathered, part) in enumerate(results):
        np.testing.assert_array_equal(total, numpy_reduce(xs, "sum"))
        assert coded.tobytes() == results[0][1].tobytes()
        np.testing.assert_array_equal(bcast, xs[world - 1])
        np.testing.assert_array_equal(gathered, np.concatenate([x[: k + 1] for k, x in enumerate(xs)]))
        np.testing.assert_array_equal(part, np.array_split(numpy_reduce(xs, "max"), world)[r])


@pytest.mark.parametrize("world", WORLDS)
async def test_every_collective_with_checksums_runs_its_confirmation_lap_and_agrees(world: int) -> None:
    results = await simulate(world, every_collective, seed=case_seed("crc", world), checksum=True)
    check_every_collective(world, results)


@pytest.mark.parametrize("world", [2, 3, 5, 16])
async def test_every_collective_through_shared_memory_lanes_with_few_slots_is_exact(world: int) -> None:
    # Two slots of 64 bytes: some payloads go through the lane, some (full lane, larger chunks) inline.
    results = await simulate(world, every_collective, seed=case_seed("lanes", world), lanes=True)
    check_every_collective(world, results)


@pytest.mark.parametrize("world", [2, 3, 7])
async def test_ranks_that_disagree_all_fail_with_every_ranks_arguments(world: int) -> None:
    async def call(session: Session, rank: int) -> np.ndarray:
        x = np.zeros(4 if rank != 1 else 5, dtype=np.float32)
        return await collectives.allreduce(session, x, op="sum", name="m", chunk_bytes=8, timeout_s=T)

    with pytest.raises(MismatchError):
        await simulate(world, call, seed=world, abort_grace_s=0.5)


# -- a broken program fails the simulator ------------------------------------------------------------


def broadcast_without_commit(ring: Ring, root: int, total: int, chunk_elems: int) -> Program:
    """The drifted copy the old simulator ran: the commit lap's frames reach non-roots, unused."""
    n, me = ring.size, ring.index
    last = (me + 1) % n == root
    if me == root:
        if n > 1:
            for c, (a, b) in enumerate(chunk_bounds(0, total, chunk_elems)):
                yield programs.Give(0, c, root, a, b, total)
            yield Recv(1, 0)
            yield Signal(2)
        return
    size = yield Recv(0, 0)
    assert size is not None
    yield Phase("broadcast")
    for c, (a, b) in enumerate(chunk_bounds(0, size, chunk_elems)):
        if c:
            yield Recv(0, c)
        yield Place(root, a, b, size)
        if not last:
            yield FORWARD
    if last:
        yield Signal(1)


def allgather_that_stops_forwarding_early(ring: Ring, bounds: list[tuple[int, int]], chunk_elems: int) -> Program:
    """Ring allreduce in which rank 0 forwards nothing in the allgather: it ends with the right
    result, but the ranks after it wait for segments that never come."""
    for step in programs.ring_reduce(ring, bounds, chunk_elems, gather=True):
        if not (isinstance(step, programs.Forward) and ring.index == 0):
            yield step


def reduce_scatter_from_the_wrong_segment(ring: Ring, bounds: list[tuple[int, int]], chunk_elems: int) -> Program:
    """Ring allreduce whose first step sends the segment after the right one."""
    seg = reduce_scatter_step(ring.index, ring.size, 0)[0]
    shift = bounds[(seg + 1) % ring.size][0] - bounds[seg][0]  # segments of one size: the same chunks
    for step in programs.ring_reduce(ring, bounds, chunk_elems, gather=True):
        if isinstance(step, programs.Lead):
            step = programs.Lead(step.slot, step.chunk, step.a + shift, step.b + shift)
        yield step


async def run_broadcast(program: Callable[..., Program], world: int) -> list[np.ndarray]:
    data = np.arange(10, dtype=np.int32)

    async def call(session: Session, rank: int) -> np.ndarray:
        blocks: list[np.ndarray | None] = [data if rank == 0 else None] + [None] * (world - 1)
        values = Blocks(data.dtype, blocks)
        await executor.run(session, None, Descriptor("broadcast"), 1.0, program(executor.ring_of(session), 0, data.size, 3), values)
        out = values.blocks[0]
        assert out is not None
        return out

    return await simulate(world, call, seed=world)


async def run_allreduce(program: Callable[..., Program], world: int) -> list[np.ndarray]:
    xs = [np.arange(12, dtype=np.int64) * (r + 1) for r in range(world)]

    async def call(session: Session, rank: int) -> np.ndarray:
        buf = np.empty_like(xs[rank])
        bounds = segment_bounds(buf.size, world)
        await executor.run(session, None, Descriptor("allreduce"), 1.0, program(executor.ring_of(session), bounds, 2),
                           Raw(xs[rank], buf, "sum", world))
        np.testing.assert_array_equal(buf, numpy_reduce(xs, "sum"), err_msg=f"rank {rank}")
        return buf

    return await simulate(world, call, seed=world)


async def test_the_simulator_fails_a_broadcast_that_lacks_the_commit_lap() -> None:
    assert len(await run_broadcast(programs.broadcast_chain, 4)) == 4  # the shipped program passes
    with pytest.raises(AssertionError, match=r"never took|after their collective had finished"):
        await run_broadcast(broadcast_without_commit, 4)


async def test_the_simulator_fails_an_allreduce_that_hangs_or_reduces_the_wrong_segment() -> None:
    assert len(await run_allreduce(lambda r, b, c: programs.ring_reduce(r, b, c, gather=True), 3)) == 3
    with pytest.raises(CollectiveTimeoutError):
        await run_allreduce(allgather_that_stops_forwarding_early, 3)
    with pytest.raises(AssertionError, match=r"Arrays are not equal"):
        await run_allreduce(reduce_scatter_from_the_wrong_segment, 3)


# -- the programs themselves ---------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
def test_ring_allreduce_sends_exactly_the_ring_optimum_of_elements(world: int) -> None:
    for length in lengths_for(world):
        bounds = segment_bounds(length, world)
        sent = [sent_elements(programs.ring_reduce(Ring.whole(r, world), bounds, 4, gather=True)) for r in range(world)]
        # Rank r sends every segment but its own in the reduce-scatter and every segment but its
        # successor's in the allgather: 2(N-1)/N x S per rank when N divides S, 2(N-1) x S in all.
        assert sum(sent) == 2 * (world - 1) * length
        for r, elems in enumerate(sent):
            nxt = successor(r, world)
            assert elems == 2 * length - (bounds[r][1] - bounds[r][0]) - (bounds[nxt][1] - bounds[nxt][0])
            assert elems <= 2 * (world - 1) * math.ceil(length / world)


@pytest.mark.parametrize("world", WORLDS)
def test_every_ring_step_carries_at_least_one_frame_even_for_empty_segments(world: int) -> None:
    # One frame per step at least is what lets each rank check its predecessor's arguments.
    for length in (0, 1, world):
        bounds = segment_bounds(length, world)
        for r in range(world):
            frames = [s for s in programs.ring_reduce(Ring.whole(r, world), bounds, 1000, gather=True)
                      if isinstance(s, programs.Lead | programs.Fold | programs.Own | programs.Forward)
                      and getattr(s, "slot", 0) != programs.NO_SEND]
            assert len(frames) >= 2 * (world - 1)


def sent_elements(program: Program) -> int:
    """Elements a program sends, run dry: every Recv answered with an empty origin_count."""
    total, last = 0, 0
    reply: int | None = None
    try:
        while True:
            step = program.send(reply)
            reply = None
            if isinstance(step, Recv):
                reply = 0
            elif isinstance(step, programs.Lead | programs.Fold | programs.Take):
                last = step.b - step.a
                if not isinstance(step, programs.Take):
                    total += last
            elif isinstance(step, programs.Own):
                last = step.b - step.a
                total += last if step.slot != programs.NO_SEND else 0
            elif isinstance(step, programs.Forward):
                total += last
    except StopIteration:
        return total


# -- the schedule's building blocks ----------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
def test_segment_bounds_tile_the_buffer_like_numpy_array_split(world: int) -> None:
    for units in range(0, 3 * world + 3):
        for granule in (1, 3):
            bounds = segment_bounds(units, world, granule)
            assert len(bounds) == world
            assert bounds[0][0] == 0 and bounds[-1][1] == units * granule
            assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
            sizes = [(b - a) // granule for a, b in bounds]
            assert sizes == [len(p) for p in np.array_split(np.arange(units), world)]


def test_chunk_bounds_cover_a_range_with_chunks_no_larger_than_asked() -> None:
    for start, stop in [(0, 0), (5, 5), (0, 1), (3, 10), (7, 107)]:
        for size in (1, 2, 3, 50, 1000):
            chunks = chunk_bounds(start, stop, size)
            if stop == start:
                assert chunks == [(start, start)]
                continue
            assert chunks[0][0] == start and chunks[-1][1] == stop
            assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
            assert all(0 < b - a <= size for a, b in chunks)
            assert len(chunks) == math.ceil((stop - start) / size)


@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_receives_at_every_step_what_its_predecessor_sends(world: int) -> None:
    for step in range(world - 1):
        for rank in range(world):
            pred = predecessor(rank, world)
            assert reduce_scatter_step(pred, world, step)[0] == reduce_scatter_step(rank, world, step)[1]
            assert allgather_step(pred, world, step)[0] == allgather_step(rank, world, step)[1]


@pytest.mark.parametrize("world", WORLDS)
def test_the_reduce_scatter_ends_with_each_rank_owning_its_own_segment(world: int) -> None:
    for rank in range(world):
        sent = [reduce_scatter_step(rank, world, s)[0] for s in range(world - 1)]
        received = [reduce_scatter_step(rank, world, s)[1] for s in range(world - 1)]
        assert sorted(sent) == sorted(set(range(world)) - {rank})
        if world > 1:
            assert received[-1] == rank
        gathered = [allgather_step(rank, world, s)[1] for s in range(world - 1)]
        assert sorted([*gathered, rank]) == list(range(world))


def test_successor_and_predecessor_close_the_ring() -> None:
    for world in WORLDS:
        for rank in range(world):
            assert predecessor(successor(rank, world), world) == rank
        assert successor(world - 1, world) == 0 and predecessor(0, world) == world - 1


def test_an_unknown_reduce_op_is_rejected_with_the_known_ops_named() -> None:
    for op in REDUCE_OPS:
        assert check_op(op) == op
    with pytest.raises(InvalidArgumentError, match=r"The reduce op 'prod' is not supported; use one of sum, average, min, max, product, band, bor, bxor\."):
        check_op("prod")


def test_combine_into_reduces_in_place() -> None:
    acc = np.array([1, 5, -2], dtype=np.int32)
    combine_into(acc, np.array([3, 2, -7], dtype=np.int32), "sum")
    assert acc.tolist() == [4, 7, -9]
    combine_into(acc, np.array([0, 9, 0], dtype=np.int32), "min")
    assert acc.tolist() == [0, 7, -9]
    combine_into(acc, np.array([1, 1, 1], dtype=np.int32), "max")
    assert acc.tolist() == [1, 7, 1]


def test_finish_into_divides_floats_and_floors_integer_averages() -> None:
    ints = np.array([-3, 3, 4, -4], dtype=np.int64)
    finish_into(ints, "average", 2)
    assert ints.tolist() == [-2, 1, 2, -2]
    floats = np.array([1.0, -3.0], dtype=np.float32)
    finish_into(floats, "average", 4)
    assert floats.tolist() == [0.25, -0.75]
    for op in ("sum", "min", "max"):
        same = np.array([7, 9])
        finish_into(same, op, 3)
        assert same.tolist() == [7, 9]
    alone = np.array([5, 7])
    finish_into(alone, "average", 1)
    assert alone.tolist() == [5, 7]
