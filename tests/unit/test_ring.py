"""The pure ring schedule, proved by an in-memory simulator of the ring for worlds 1..16.

The simulator runs every rank as a generator that yields the (step, chunk) frame it waits for, and
a seeded random scheduler interleaves the ranks, so the pipelined schedule is checked under many
orders of arrival. Each simulated frame carries the segment its sender meant to send: a receiver
asserts that it is the segment the schedule tells it to expect, which proves that the ranks' schedules
agree. Nothing here opens a socket or an event loop.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable, Generator
from functools import partial
from typing import Any

import numpy as np
import pytest
from reference import numpy_reduce

from ringserve.errors import InvalidArgumentError
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

WORLDS = list(range(1, 17))
CHUNK_ELEMS = (1, 4, 1000)

Key = tuple[int, int]
Frame = tuple[Any, np.ndarray]
Program = Generator[Key, Frame, Any]


class SimRing:
    """Frames in flight between ranks: each rank sends only to its successor, keyed by (step, chunk)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.inboxes: list[dict[Key, tuple[int, Any, np.ndarray]]] = [{} for _ in range(world)]
        self.elems_sent = [0] * world
        self.frames_sent = [0] * world

    def send(self, src: int, key: Key, data: np.ndarray, tag: Any) -> None:
        box = self.inboxes[successor(src, self.world)]
        assert key not in box, f"rank {src} sent frame {key} twice"
        # The real transport serialises at send time, so later writes to the buffer never leak.
        box[key] = (src, tag, np.array(data, copy=True))
        self.elems_sent[src] += data.size
        self.frames_sent[src] += 1


def simulate(world: int, program: Callable[[int, SimRing], Program], seed: int) -> tuple[list[Any], SimRing]:
    """Runs ``program(rank, ring)`` for every rank under a seeded random interleaving.

    Fails on a deadlock (no rank can make progress), on a frame that is not from the predecessor,
    and on a frame that nobody consumed.
    """
    ring = SimRing(world)
    rng = random.Random(seed)
    gens = {r: program(r, ring) for r in range(world)}
    waiting: dict[int, Key | None] = {r: None for r in range(world)}
    started: set[int] = set()
    results: list[Any] = [None] * world
    while gens:
        runnable = [r for r in gens if r not in started or waiting[r] in ring.inboxes[r]]
        assert runnable, f"the ring deadlocked: ranks wait for {waiting}, frames queued {[sorted(b) for b in ring.inboxes]}"
        r = rng.choice(runnable)
        try:
            if r not in started:
                started.add(r)
                waiting[r] = next(gens[r])
            else:
                src, tag, data = ring.inboxes[r].pop(waiting[r])  # type: ignore[arg-type]
                assert src == predecessor(r, world), f"rank {r} got a frame from rank {src}"
                waiting[r] = gens[r].send((tag, data))
        except StopIteration as stop:
            results[r] = stop.value
            del gens[r]
            waiting.pop(r)
    leftover = {r: sorted(box) for r, box in enumerate(ring.inboxes) if box}
    assert not leftover, f"frames were sent but never consumed: {leftover}"
    return results, ring


# -- the programs: ring.py's schedule, driven the way ringserve/worker/collectives.py drives it -----


def ring_reduce(
    rank: int,
    ring: SimRing,
    *,
    bufs: list[np.ndarray],
    op: str,
    bounds: list[tuple[int, int]],
    chunk_elems: int,
    gather: bool,
) -> Program:
    """Reduce-scatter, then (with ``gather``) allgather ``bufs[rank]`` in place, chunk by chunk."""
    world = ring.world
    buf = bufs[rank]
    if world == 1:
        finish_into(buf, op, world)
        return buf
    send_seg, _ = reduce_scatter_step(rank, world, 0)
    for c, (a, b) in enumerate(chunk_bounds(*bounds[send_seg], chunk_elems)):
        ring.send(rank, (0, c), buf[a:b], tag=("rs", send_seg, a, b))
    for step in range(world - 1):
        _, recv_seg = reduce_scatter_step(rank, world, step)
        for c, (a, b) in enumerate(chunk_bounds(*bounds[recv_seg], chunk_elems)):
            tag, data = yield (step, c)
            assert tag == ("rs", recv_seg, a, b), f"rank {rank} step {step}: got {tag}, expected segment {recv_seg}"
            combine_into(buf[a:b], data, op)
            if step < world - 2:
                # Pipelining: what arrives at step s is exactly what leaves at step s + 1.
                assert reduce_scatter_step(rank, world, step + 1)[0] == recv_seg
                ring.send(rank, (step + 1, c), buf[a:b], tag=("rs", recv_seg, a, b))
                continue
            assert recv_seg == rank, f"rank {rank} ends the reduce-scatter owning segment {recv_seg}"
            finish_into(buf[a:b], op, world)
            if gather:
                assert allgather_step(rank, world, 0)[0] == recv_seg
                ring.send(rank, (world - 1 + recv_seg, c), buf[a:b], tag=("ag", recv_seg, a, b))
    if not gather:
        return buf
    for step in range(world - 1):
        _, recv_seg = allgather_step(rank, world, step)
        for c, (a, b) in enumerate(chunk_bounds(*bounds[recv_seg], chunk_elems)):
            # Allgather frames are keyed by segment, so a frame is forwarded with its key unchanged.
            tag, data = yield (world - 1 + recv_seg, c)
            assert tag == ("ag", recv_seg, a, b), f"rank {rank} allgather step {step}: got {tag}"
            buf[a:b] = data
            if step < world - 2:
                assert allgather_step(rank, world, step + 1)[0] == recv_seg
                ring.send(rank, (world - 1 + recv_seg, c), data, tag=("ag", recv_seg, a, b))
    return buf


def allgather_blocks(rank: int, ring: SimRing, *, blocks_in: list[np.ndarray], chunk_elems: int) -> Program:
    """Blocks of different sizes around the ring; a block's size travels in its first frame."""
    world = ring.world
    block = blocks_in[rank]
    blocks: list[np.ndarray | None] = [None] * world
    blocks[rank] = block
    if world == 1:
        return blocks
    for c, (a, b) in enumerate(chunk_bounds(0, block.size, chunk_elems)):
        ring.send(rank, (rank, c), block[a:b], tag=(rank, block.size))
    for step in range(world - 1):
        _, origin = allgather_step(rank, world, step)
        (got_origin, total), data = yield (origin, 0)
        assert got_origin == origin, f"rank {rank} step {step}: got block {got_origin}, expected {origin}"
        out = np.empty(total, dtype=block.dtype)
        for c, (a, b) in enumerate(chunk_bounds(0, total, chunk_elems)):
            if c:
                (got_origin, _), data = yield (origin, c)
                assert got_origin == origin
            out[a:b] = data
            if step < world - 2:
                assert allgather_step(rank, world, step + 1)[0] == origin
                ring.send(rank, (origin, c), data, tag=(origin, total))
        blocks[origin] = out
    return blocks


def broadcast_chain(rank: int, ring: SimRing, *, root: int, data: np.ndarray, chunk_elems: int) -> Program:
    """root -> root+1 -> ... -> root-1, and an empty frame from the last rank back to the root."""
    world = ring.world
    nxt = successor(rank, world)
    if rank == root:  # only the root reads data
        if world > 1:
            for c, (a, b) in enumerate(chunk_bounds(0, data.size, chunk_elems)):
                ring.send(rank, (0, c), data[a:b], tag=data.size)
            tag, ack = yield (1, 0)
            assert tag == "done" and ack.size == 0
        return data
    total, payload = yield (0, 0)
    out = np.empty(total, dtype=payload.dtype)
    for c, (a, b) in enumerate(chunk_bounds(0, total, chunk_elems)):
        if c:
            _, payload = yield (0, c)
        out[a:b] = payload
        if nxt != root:
            ring.send(rank, (0, c), payload, tag=total)
    if nxt == root:
        ring.send(rank, (1, 0), payload[:0], tag="done")
    return out


# -- helpers ---------------------------------------------------------------------------------------


def lengths_for(world: int) -> list[int]:
    """Zero, one, fewer elements than ranks, exactly as many, uneven, and a longer odd length."""
    return sorted({0, 1, 2, max(world - 1, 0), world, world + 1, 3 * world + 2, 61})


def rank_data(world: int, length: int, dtype: np.dtype, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(length).astype(dtype) for _ in range(world)]
    return [rng.integers(-1000, 1000, length).astype(dtype) for _ in range(world)]


def assert_bit_identical(results: list[np.ndarray]) -> None:
    first = results[0].tobytes()
    for r, out in enumerate(results):
        assert out.tobytes() == first, f"rank {r} ended with different bytes than rank 0"


def case_seed(*parts: object) -> int:
    """A seed that is stable across runs (str hashes are salted per process)."""
    return zlib.crc32(repr(parts).encode())


CASES = [(world, length) for world in WORLDS for length in lengths_for(world)]


# -- the simulated collectives ---------------------------------------------------------------------


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize(("world", "length"), CASES)
def test_ring_allreduce_gives_every_rank_the_same_bytes_equal_to_numpys_answer(world: int, length: int, op: str) -> None:
    for dtype in (np.int64, np.float64):
        xs = rank_data(world, length, dtype, seed=case_seed(world, length, op))
        expected = numpy_reduce(xs, op)
        bounds = segment_bounds(length, world)
        for chunk in CHUNK_ELEMS:
            bufs = [x.copy() for x in xs]
            program = partial(ring_reduce, bufs=bufs, op=op, bounds=bounds, chunk_elems=chunk, gather=True)
            results, _ = simulate(world, program, seed=case_seed(world, length, op, chunk))
            assert_bit_identical(results)
            where = f"{np.dtype(dtype)} world={world} length={length} chunk={chunk}"
            if dtype is np.int64 or op in ("min", "max"):
                np.testing.assert_array_equal(results[0], expected, err_msg=where)
            else:
                np.testing.assert_allclose(results[0], expected, rtol=1e-12, atol=1e-12, err_msg=where)


@pytest.mark.parametrize(("world", "length"), CASES)
def test_ring_allreduce_sends_exactly_the_ring_optimum_of_elements(world: int, length: int) -> None:
    xs = rank_data(world, length, np.int64, seed=1)
    bounds = segment_bounds(length, world)
    _, ring = simulate(world, partial(ring_reduce, bufs=xs, op="sum", bounds=bounds, chunk_elems=4, gather=True), seed=2)
    # Rank r sends every segment but its own in the reduce-scatter and every segment but its
    # successor's in the allgather: 2(N-1)/N x S per rank when N divides S, 2(N-1) x S in all.
    assert sum(ring.elems_sent) == 2 * (world - 1) * length
    for r, sent in enumerate(ring.elems_sent):
        assert sent == 2 * length - (bounds[r][1] - bounds[r][0]) - (bounds[successor(r, world)][1] - bounds[successor(r, world)][0])
        assert sent <= 2 * (world - 1) * math.ceil(length / world)
        if length % world == 0:
            assert sent == 2 * (world - 1) * length // world


@pytest.mark.parametrize(("world", "length"), CASES)
def test_every_ring_step_carries_at_least_one_frame_even_for_empty_segments(world: int, length: int) -> None:
    xs = rank_data(world, length, np.int64, seed=3)
    bounds = segment_bounds(length, world)
    _, ring = simulate(world, partial(ring_reduce, bufs=xs, op="sum", bounds=bounds, chunk_elems=1000, gather=True), seed=4)
    # One frame per step at least is what lets each rank check its predecessor's arguments.
    for sent in ring.frames_sent:
        assert sent >= 2 * (world - 1)


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("world", WORLDS)
def test_ring_reduce_scatter_gives_each_rank_its_rows_of_numpys_answer(world: int, op: str) -> None:
    cols = 3
    for rows in sorted({0, 1, world - 1, world, 2 * world + 1}):
        xs = [x.reshape(rows, cols) for x in rank_data(world, rows * cols, np.int64, seed=case_seed(world, rows, op))]
        expected = np.array_split(numpy_reduce(xs, op), world)
        bounds = segment_bounds(rows, world, cols)
        for chunk in CHUNK_ELEMS:
            bufs = [x.reshape(-1).copy() for x in xs]
            program = partial(ring_reduce, bufs=bufs, op=op, bounds=bounds, chunk_elems=chunk, gather=False)
            results, ring = simulate(world, program, seed=case_seed(world, rows, chunk))
            for r in range(world):
                a, b = bounds[r]
                np.testing.assert_array_equal(
                    results[r][a:b].reshape(-1, cols), expected[r], err_msg=f"rank {r} rows={rows} chunk={chunk}"
                )
            assert sum(ring.elems_sent) == (world - 1) * rows * cols


@pytest.mark.parametrize("world", WORLDS)
def test_ring_allgather_of_blocks_of_different_sizes_concatenates_them_in_rank_order(world: int) -> None:
    rng = np.random.default_rng(world)
    for pattern in ("zeros", "one_empty", "mixed"):
        sizes = {
            "zeros": [0] * world,
            "one_empty": [0 if r == world // 2 else 3 for r in range(world)],
            "mixed": [int(rng.integers(0, 9)) for _ in range(world)],
        }[pattern]
        blocks = [np.arange(s, dtype=np.float32) + 100 * r for r, s in enumerate(sizes)]
        for chunk in CHUNK_ELEMS:
            program = partial(allgather_blocks, blocks_in=blocks, chunk_elems=chunk)
            results, ring = simulate(world, program, seed=case_seed(world, pattern, chunk))
            for r, got in enumerate(results):
                np.testing.assert_array_equal(np.concatenate(got), np.concatenate(blocks), err_msg=f"rank {r} {pattern}")
            total = sum(sizes)
            for r, sent in enumerate(ring.elems_sent):
                assert sent == total - sizes[successor(r, world)]


@pytest.mark.parametrize("world", WORLDS)
def test_chain_broadcast_from_every_root_delivers_the_roots_bytes_to_every_rank(world: int) -> None:
    for length in (0, 1, world + 2, 41):
        for root in range(world):
            data = np.random.default_rng(length).standard_normal(length).astype(np.float32)
            for chunk in CHUNK_ELEMS:
                program = partial(broadcast_chain, root=root, data=data, chunk_elems=chunk)
                results, ring = simulate(world, program, seed=case_seed(world, length, root, chunk))
                for r, got in enumerate(results):
                    assert got.tobytes() == data.tobytes(), f"rank {r} root {root} length {length}"
                assert sum(ring.elems_sent) == (world - 1) * length


def test_the_simulator_detects_a_schedule_whose_ranks_disagree() -> None:
    # A broken schedule (every rank expects the segment it sends) must fail the simulation, or the
    # proofs above would prove nothing.
    def broken(rank: int, ring: SimRing) -> Program:
        ring.send(rank, (0, 0), np.zeros(1), tag=("rs", rank))
        tag, _ = yield (0, 0)
        assert tag == ("rs", rank), "mismatch"

    with pytest.raises(AssertionError, match="mismatch"):
        simulate(3, broken, seed=0)

    def waits_forever(rank: int, ring: SimRing) -> Program:
        yield (5, 0)

    with pytest.raises(AssertionError, match="deadlocked"):
        simulate(2, waits_forever, seed=0)


# -- the schedule's building blocks ----------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
def test_segment_bounds_tile_the_buffer_like_numpy_array_split(world: int) -> None:
    for units in range(0, 3 * world + 3):
        for granule in (1, 3):
            bounds = segment_bounds(units, world, granule)
            assert len(bounds) == world
            assert bounds[0][0] == 0 and bounds[-1][1] == units * granule
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
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
            assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
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
        assert sorted(gathered + [rank]) == list(range(world))


def test_successor_and_predecessor_close_the_ring() -> None:
    for world in WORLDS:
        for rank in range(world):
            assert predecessor(successor(rank, world), world) == rank
        assert successor(world - 1, world) == 0 and predecessor(0, world) == world - 1


def test_an_unknown_reduce_op_is_rejected_with_the_known_ops_named() -> None:
    for op in REDUCE_OPS:
        assert check_op(op) == op
    with pytest.raises(InvalidArgumentError, match=r"The reduce op 'prod' is not supported; use one of sum, average, min, max, product\."):
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
