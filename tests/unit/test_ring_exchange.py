"""Alltoall, grouped allgather and grouped reduce-scatter, run by the ring simulator (tests/ringsim.py)
for worlds 1..16: the shipped programs through the executor over in-memory links, under seeded random
interleavings. Results are checked against numpy, and a broken alltoall program must fail the
simulator."""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from reference import numpy_reduce
from ringsim import simulate

from ringserve import wire
from ringserve.errors import CollectiveTimeoutError, InvalidArgumentError, MismatchError
from ringserve.ring import chunk_bounds
from ringserve.worker.dataplane import programs
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import FORWARD, Give, Place, Program, Recv, Ring, executor
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Exchange
from ringserve.worker.ops import collectives, grouped

WORLDS = list(range(1, 17))
DTYPES = list(wire.DTYPES)
T = 10.0


def seed_of(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def data(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    """Arbitrary bytes (NaN payloads included): an exchange must move them unchanged."""
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.random.default_rng(seed).integers(0, 256, size=count * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def expected_alltoall(inputs: list[np.ndarray], splits: list[list[int]], me: int) -> tuple[np.ndarray, list[int]]:
    """numpy's answer: what each origin's splits address to ``me``."""
    parts, counts = [], []
    for o, x in enumerate(inputs):
        start = sum(splits[o][:me])
        parts.append(x[start: start + splits[o][me]])
        counts.append(splits[o][me])
    return np.concatenate(parts, axis=0), counts


def random_splits(world: int, rng: random.Random, pattern: str) -> list[list[int]]:
    if pattern == "even":
        k = rng.randint(0, 3)
        return [[k] * world for _ in range(world)]
    if pattern == "one rank sends nothing":
        quiet = rng.randrange(world)
        return [[0 if o == quiet else rng.randint(0, 4) for _ in range(world)] for o in range(world)]
    return [[rng.randint(0, 5) for _ in range(world)] for _ in range(world)]


@pytest.mark.parametrize("world", WORLDS)
async def test_alltoall_gives_each_rank_what_every_rank_addressed_to_it_in_rank_order(world: int) -> None:
    rng = random.Random(world)
    cases = []
    for i, dtype in enumerate(DTYPES):
        pattern = ("even", "uneven", "one rank sends nothing")[i % 3]
        rest = ((), (3,), (2, 2))[i % 3]
        splits = random_splits(world, rng, pattern)
        extra = [rng.randint(0, 2) for _ in range(world)]  # rows past the splits' sum are not sent
        inputs = [data((sum(splits[r]) + extra[r], *rest), dtype, seed_of(world, i, r)) for r in range(world)]
        cases.append((splits, inputs, rng.choice((1, 3, 1000))))

    def one(i: int) -> Callable[[Session, int], Any]:
        splits, inputs, chunk = cases[i]

        async def call(session: Session, rank: int) -> tuple[np.ndarray, np.ndarray]:
            x = inputs[rank]
            return await collectives.alltoall(session, x, splits=splits[rank], name=f"a2a{i}",
                                              chunk_bytes=chunk * x.itemsize, timeout_s=T)
        return call

    async def each(session: Session, rank: int) -> list[Any]:
        return list(await asyncio.gather(*(one(i)(session, rank) for i in range(len(cases)))))

    results = await simulate(world, each, seed=seed_of("a2a", world))
    for i, (splits, inputs, chunk) in enumerate(cases):
        for r in range(world):
            got, counts = results[r][i]
            want, want_counts = expected_alltoall(inputs, splits, r)
            where = f"case {i} ({inputs[0].dtype}, chunk {chunk}) rank {r} of {world}"
            assert got.dtype == want.dtype and got.shape == want.shape, where
            assert got.tobytes() == want.tobytes(), where
            assert counts.dtype == np.int64 and counts.tolist() == want_counts, where


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
async def test_alltoall_without_splits_splits_the_first_dimension_evenly_and_rows_of_no_elements_count(world: int) -> None:
    async def call(session: Session, rank: int) -> list[tuple[np.ndarray, np.ndarray]]:
        even = np.arange(world * 2 * 3, dtype=np.int32).reshape(world * 2, 3) + 100 * rank
        empty_rows = np.zeros((sum(range(world)) + rank, 0), dtype=np.float32)
        splits = [d + (rank if d == 0 else 0) for d in range(world)]
        opts: dict[str, Any] = {"name": None, "chunk_bytes": 8, "timeout_s": T}
        return [await collectives.alltoall(session, even, **opts),
                await collectives.alltoall(session, empty_rows, splits=splits, **opts)]

    results = await simulate(world, call, seed=world)
    for r, (even, empty) in enumerate(results):
        rows = [np.arange(world * 2 * 3, dtype=np.int32).reshape(world * 2, 3)[2 * r: 2 * r + 2] + 100 * o
                for o in range(world)]
        np.testing.assert_array_equal(even[0], np.concatenate(rows))
        assert even[1].tolist() == [2] * world
        assert empty[0].shape == (sum(r + (o if r == 0 else 0) for o in range(world)), 0)
        assert empty[1].tolist() == [r + (o if r == 0 else 0) for o in range(world)]


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("bad", ["sum too large", "negative", "wrong length", "not integers", "uneven without splits"])
async def test_wrong_splits_on_one_rank_fail_every_rank_within_the_abort_grace(world: int, bad: str) -> None:
    grace = 0.5

    async def call(session: Session, rank: int) -> Any:
        x = np.zeros((2 * world, 2), dtype=np.float32)
        splits: Any = [2] * world
        if rank == world - 1:
            splits = {"sum too large": [3] * world, "negative": [-1] + [2] * (world - 1),
                      "wrong length": [1] * (world + 1), "not integers": [2.0] * world,
                      "uneven without splits": None}[bad]
            if bad == "uneven without splits":
                x = np.zeros((2 * world + 1, 2), dtype=np.float32)
        started = time.monotonic()
        try:
            await collectives.alltoall(session, x, splits=splits, name="bad", chunk_bytes=8, timeout_s=T)
        except (InvalidArgumentError, MismatchError) as exc:
            return exc, time.monotonic() - started
        return None, time.monotonic() - started

    outcomes = await simulate(world, call, seed=world, abort_grace_s=grace, aborts=True)
    for r, (exc, took) in enumerate(outcomes):
        assert took < grace + 1.0, f"rank {r} failed after {took:.2f} s"
        if r == world - 1:
            assert isinstance(exc, InvalidArgumentError) and isinstance(exc, ValueError), exc
        else:
            assert isinstance(exc, MismatchError), f"rank {r}: {exc!r}"
            assert "invalid:" in str(exc)


async def test_splits_wrong_alike_on_every_rank_raise_a_value_error_everywhere_after_one_lap() -> None:
    async def call(session: Session, rank: int) -> Exception | None:
        try:
            await collectives.alltoall(session, np.zeros(3), splits=[1, 1, 1, 1], name=None, chunk_bytes=8, timeout_s=T)
        except InvalidArgumentError as exc:
            return exc
        return None

    outcomes = await simulate(4, call, seed=4, abort_grace_s=5.0)
    assert all(isinstance(e, ValueError) and "more than the first dimension (3)" in str(e) for e in outcomes), outcomes


def test_split_rows_follows_horovods_rules() -> None:
    assert collectives.split_rows(None, 6, 3) == ([2, 2, 2], "")
    assert collectives.split_rows([], 6, 3) == ([2, 2, 2], "")  # an empty splits tensor: even, as Horovod
    assert collectives.split_rows(np.array([0, 4, 1], dtype=np.int32), 6, 3) == ([0, 4, 1], "")
    for splits, rows, message in [(None, 7, "not a multiple of the world size (3)"),
                                  ([1, 1], 6, "has 2 entries, but the world has 3 ranks"),
                                  ([1, -1, 1], 6, "negative"),
                                  ([3, 3, 3], 6, "sum to 9, more than the first dimension (6)"),
                                  ([1.0, 1.0, 1.0], 6, "must be one integer per rank")]:
        rows_out, problem = collectives.split_rows(splits, rows, 3)
        assert rows_out == [] and message in problem, (splits, problem)


# -- a broken alltoall fails the simulator ---------------------------------------------------------


def rewritten(program: Program, change: Callable[[Any], Any]) -> Program:
    """``program`` with each step passed through ``change``, the executor's replies passed back."""
    reply = None
    while True:
        try:
            step = program.send(reply)
        except StopIteration:
            return
        reply = yield change(step)


def alltoall_that_forwards_what_it_should_keep(ring: Ring, sizes: list[int], chunk_elems: int) -> Program:
    """Each rank forwards, rather than keeps, the block of its predecessor: it never has it, and its
    successor gets a frame it never takes."""
    behind = (ring.index - 1) % ring.size
    return rewritten(programs.alltoall_ring(ring, sizes, chunk_elems),
                     lambda step: FORWARD if isinstance(step, Place) and step.origin == behind else step)


def alltoall_that_gives_the_wrong_block(ring: Ring, sizes: list[int], chunk_elems: int) -> Program:
    """Sends another block under the key of block d (blocks of one size: the frames still fit)."""
    def other(step: Any) -> Any:
        if not isinstance(step, Give):
            return step
        d = (step.origin + 1) % ring.size
        return step._replace(origin=d if d != ring.index else (d + 1) % ring.size)
    return rewritten(programs.alltoall_ring(ring, sizes, chunk_elems), other)


def alltoall_that_waits_for_the_farthest_origin_first(ring: Ring, sizes: list[int], chunk_elems: int) -> Program:
    """Right steps in the wrong order: each rank waits first for the block that has come farthest,
    which the ranks before it forward only once they have had theirs: nobody forwards anything."""
    n, me = ring.size, ring.index
    for dist in range(n - 1, 0, -1):
        dest = (me + dist) % n
        for c, (a, b) in enumerate(chunk_bounds(0, sizes[dest], chunk_elems)):
            yield Give(me * n + dest, c, dest, a, b, sizes[dest])
    for behind in range(n - 1, 0, -1):
        origin = (me - behind) % n
        for dist in range(behind, n):
            slot = origin * n + (origin + dist) % n
            size = yield Recv(slot, 0)
            assert size is not None
            for c, (a, b) in enumerate(chunk_bounds(0, size, chunk_elems)):
                if c:
                    yield Recv(slot, c)
                yield Place(origin, a, b, size) if dist == behind else FORWARD


async def run_alltoall(program: Callable[..., Program], world: int) -> list[list[np.ndarray]]:
    blocks = [[np.arange(4, dtype=np.int64) + 10 * o + 100 * d for d in range(world)] for o in range(world)]

    async def call(session: Session, rank: int) -> list[np.ndarray]:
        values = Exchange(np.dtype(np.int64), blocks[rank])
        values.blocks[rank] = blocks[rank][rank]
        await executor.run(session, None, Descriptor("alltoall"), 1.0, program(executor.ring_of(session), [4] * world, 3), values)
        for o, b in enumerate(values.blocks):
            assert b is not None, f"rank {rank} never got the block of rank {o}"
            np.testing.assert_array_equal(b, blocks[o][rank], err_msg=f"rank {rank} from {o}")
        return [b for b in values.blocks if b is not None]

    return await simulate(world, call, seed=world)


async def test_the_simulator_passes_the_shipped_alltoall_and_fails_broken_ones() -> None:
    assert len(await run_alltoall(programs.alltoall_ring, 5)) == 5
    with pytest.raises(CollectiveTimeoutError):
        await run_alltoall(alltoall_that_waits_for_the_farthest_origin_first, 5)
    with pytest.raises(AssertionError, match=r"never got the block"):
        await run_alltoall(alltoall_that_forwards_what_it_should_keep, 5)
    with pytest.raises(AssertionError, match=r"Arrays are not equal"):
        await run_alltoall(alltoall_that_gives_the_wrong_block, 5)


@pytest.mark.parametrize("world", WORLDS)
def test_alltoall_sends_each_block_as_many_hops_as_its_distance(world: int) -> None:
    sizes = [[(3 * o + d) % 5 for d in range(world)] for o in range(world)]
    sent = []
    for me in range(world):
        total, last = 0, 0
        program = programs.alltoall_ring(Ring.whole(me, world), sizes[me], 2)
        reply: int | None = None
        try:
            while True:
                step = program.send(reply)
                reply = None
                if isinstance(step, Recv):
                    origin, dest = divmod(step.slot, world)
                    reply = sizes[origin][dest]
                    last = min(2, reply - 2 * step.chunk) if reply else 0
                elif isinstance(step, Give):
                    total += step.b - step.a
                elif isinstance(step, programs.Forward):
                    total += last
        except StopIteration:
            sent.append(total)
    hops = sum(sizes[o][d] * ((d - o) % world) for o in range(world) for d in range(world))
    assert sum(sent) == hops


# -- grouped allgather and reduce-scatter ----------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
async def test_grouped_allgather_gathers_every_array_of_mixed_dtypes_and_row_counts_in_one_collective(world: int) -> None:
    rng = random.Random(world)
    shapes = [((), np.float16), ((3,), np.int64), ((2, 2), np.uint8), ((0,), np.float32), ((5,), np.float64)]
    inputs = [[data((rng.randint(0, 4), *rest), dtype, seed_of(world, r, i)) for i, (rest, dtype) in enumerate(shapes)]
              for r in range(world)]

    async def call(session: Session, rank: int) -> tuple[list[np.ndarray], int]:
        before = session.counters.collectives_done
        out = await grouped.grouped_allgather(session, inputs[rank], name="g", chunk_bytes=24, timeout_s=T)
        return out, session.counters.collectives_done - before

    results = await simulate(world, call, seed=seed_of("grouped_ag", world))
    for r, (out, collectives_run) in enumerate(results):
        assert collectives_run == 1
        for i in range(len(shapes)):
            want = np.concatenate([inputs[o][i] for o in range(world)], axis=0)
            assert out[i].dtype == want.dtype and out[i].shape == want.shape, (r, i)
            assert out[i].tobytes() == want.tobytes(), (r, i)


@pytest.mark.parametrize("world", WORLDS)
async def test_grouped_reduce_scatter_gives_each_rank_its_rows_of_each_arrays_reduction(world: int) -> None:
    shapes = [((2 * world + 1, 3), np.int32), ((world - 1 or 1,), np.int32), ((4, 2), np.float64), ((1, 1), np.int32)]
    rng = np.random.default_rng(world)
    inputs = [[rng.integers(-9, 9, shape).astype(dtype) for shape, dtype in shapes] for _ in range(world)]

    async def call(session: Session, rank: int) -> list[list[np.ndarray]]:
        return [await grouped.grouped_reduce_scatter(session, inputs[rank], op=op, name=None, chunk_bytes=8, timeout_s=T)
                for op in ("sum", "max", "average")]

    results = await simulate(world, call, seed=seed_of("grouped_rs", world))
    for k, op in enumerate(("sum", "max", "average")):
        for i in range(len(shapes)):
            expected = np.array_split(numpy_reduce([inputs[r][i] for r in range(world)], op), world)
            for r in range(world):
                np.testing.assert_array_equal(results[r][k][i], expected[r], err_msg=f"{op} array {i} rank {r}")


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_a_scalar_in_a_grouped_call_on_one_rank_fails_every_rank_at_once(world: int) -> None:
    async def call(session: Session, rank: int) -> tuple[type, type]:
        arrays = [np.zeros((3, 1))] + ([np.float64(rank)] if rank == 0 else [np.zeros(2)])
        kinds = []
        for fn in (grouped.grouped_reduce_scatter, grouped.grouped_allgather):
            kwargs: dict[str, Any] = {"op": "sum"} if fn is grouped.grouped_reduce_scatter else {}
            try:
                await fn(session, arrays, name=None, chunk_bytes=8, timeout_s=T, **kwargs)
            except (InvalidArgumentError, MismatchError) as exc:
                kinds.append(type(exc))
        return kinds[0], kinds[1]

    outcomes = await simulate(world, call, seed=world, abort_grace_s=0.5, aborts=True)
    assert outcomes[0] == (InvalidArgumentError, InvalidArgumentError)
    assert all(o == (MismatchError, MismatchError) for o in outcomes[1:])


@pytest.mark.parametrize("world", [2, 3, 5, 16])
@pytest.mark.parametrize("ring", [{"checksum": True}, {"lanes": True}], ids=["checksums", "lanes"])
async def test_alltoall_and_grouped_calls_with_checksums_or_through_shared_memory_lanes_are_exact(
        world: int, ring: dict[str, Any]) -> None:
    splits = [[(o + 2 * d) % 4 for d in range(world)] for o in range(world)]
    inputs = [data((sum(splits[o]), 3), np.float32, seed_of("lanes", world, o)) for o in range(world)]

    async def call(session: Session, rank: int) -> list[Any]:
        opts: dict[str, Any] = {"name": None, "chunk_bytes": 20, "timeout_s": T}
        return [await collectives.alltoall(session, inputs[rank], splits=splits[rank], **opts),
                await grouped.grouped_allgather(session, [inputs[rank], inputs[rank][:1]], **opts)]

    results = await simulate(world, call, seed=seed_of("lanes", world), **ring)
    for r, ((got, counts), gathered) in enumerate(results):
        want, want_counts = expected_alltoall(inputs, splits, r)
        assert got.tobytes() == want.tobytes() and counts.tolist() == want_counts
        assert gathered[0].tobytes() == np.concatenate(inputs).tobytes()
        assert gathered[1].tobytes() == np.concatenate([x[:1] for x in inputs]).tobytes()
