"""Every collective of real workers over loopback, against numpy's answer, for worlds of 1 to 5.

The worlds are shared by the tests of this module (one per size, with tiny chunks so that short
arrays already cross many chunks). Values are small integers, so that sums in every dtype are
exact in any order: numpy's answer is then the one right answer, bit for bit.
"""

from __future__ import annotations

import asyncio
import pickle
import zlib
from typing import Any

import numpy as np
import pytest
from reference import numpy_reduce

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIZES = [1, 2, 3, 4, 5]
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
OPS = ["sum", "average", "min", "max"]


def shapes_for(n: int) -> list[tuple[int, ...]]:
    """Zero, one, fewer elements than ranks, uneven, many chunks, two dimensions and a scalar."""
    lengths = sorted({0, 1, max(n - 1, 1), n + 1, 2 * n + 3, 101})
    return [(k,) for k in lengths] + [(3, 7), ()]


def seed_of(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def small_ints(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-8, 9, size=shape).astype(dtype)


def random_bits(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    """Arbitrary bytes, NaN payloads and negative zeros included: a test of byte-exact transport."""
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.random.default_rng(seed).integers(0, 256, size=count * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def assert_same_bytes(got: np.ndarray, expected: np.ndarray, where: str) -> None:
    assert got.dtype == expected.dtype, f"{where}: dtype {got.dtype}, expected {expected.dtype}"
    assert got.shape == expected.shape, f"{where}: shape {got.shape}, expected {expected.shape}"
    assert got.tobytes() == expected.tobytes(), f"{where}: {got!r} != {expected!r}"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
async def test_allreduce_equals_numpys_answer_bit_for_bit_on_every_rank(shared_worlds, n: int, dtype: Any, op: str) -> None:
    world = await shared_worlds(n)
    for shape in shapes_for(n):
        xs = [small_ints(shape, dtype, seed_of(n, dtype, op, shape, r)) for r in range(n)]
        inputs = [x.copy() for x in xs]
        name = f"allreduce/{np.dtype(dtype)}/{op}/{shape}"
        outs = await world.map("allreduce", xs, op=op, name=name)
        expected = numpy_reduce(inputs, op)
        for r, out in enumerate(outs):
            assert_same_bytes(out, expected, f"rank {r} of {n}, shape {shape}")
            assert out is not xs[r]
            assert_same_bytes(xs[r], inputs[r], f"rank {r}'s input after the allreduce")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
async def test_allreduce_of_inexact_floats_is_bit_identical_across_ranks_and_close_to_numpy(shared_worlds, n: int, dtype: Any) -> None:
    world = await shared_worlds(n)
    for op in ("sum", "average"):
        xs = [np.random.default_rng(seed_of(n, r, op)).standard_normal(517).astype(dtype) for r in range(n)]
        outs = await world.map("allreduce", xs, op=op, name=f"inexact/{op}")
        for r, out in enumerate(outs):
            assert out.tobytes() == outs[0].tobytes(), f"rank {r} differs from rank 0 ({op})"
        reference = numpy_reduce([x.astype(np.float64) for x in xs], op)
        tolerance = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}[dtype]
        np.testing.assert_allclose(outs[0].astype(np.float64), reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
async def test_broadcast_from_every_root_delivers_the_roots_bytes_to_every_rank(shared_worlds, n: int, dtype: Any) -> None:
    world = await shared_worlds(n)
    for root in range(n):
        for shape in shapes_for(n):
            xs = [random_bits(shape, dtype, seed_of(n, dtype, root, shape, r)) for r in range(n)]
            name = f"broadcast/{np.dtype(dtype)}/{root}/{shape}"
            outs = await world.map("broadcast", xs, root=root, name=name)
            for r, out in enumerate(outs):
                assert_same_bytes(out, xs[root], f"rank {r} of {n}, root {root}, shape {shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
async def test_allgather_concatenates_blocks_of_different_lengths_in_rank_order(shared_worlds, n: int, dtype: Any) -> None:
    world = await shared_worlds(n)
    row_patterns = {
        "equal": [2] * n,
        "different, one empty": [(3 * r + 1) % 5 if r != n // 2 else 0 for r in range(n)],
        "all empty": [0] * n,
        "many chunks": [40 + r for r in range(n)],
    }
    for pattern, rows in row_patterns.items():
        for rest in ((), (3,), (2, 2)):
            xs = [random_bits((rows[r], *rest), dtype, seed_of(n, pattern, rest, r)) for r in range(n)]
            name = f"allgather/{np.dtype(dtype)}/{pattern}/{rest}"
            outs = await world.map("allgather", xs, name=name)
            expected = np.concatenate(xs, axis=0)
            for r, out in enumerate(outs):
                assert_same_bytes(out, expected, f"rank {r} of {n}, {pattern}, rest {rest}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
async def test_reduce_scatter_gives_each_rank_its_rows_of_numpys_answer(shared_worlds, n: int, dtype: Any, op: str) -> None:
    world = await shared_worlds(n)
    for rows in sorted({0, 1, max(n - 1, 1), n, 2 * n + 1, 37}):
        for rest in ((), (2,)):
            xs = [small_ints((rows, *rest), dtype, seed_of(n, dtype, op, rows, rest, r)) for r in range(n)]
            name = f"reduce_scatter/{np.dtype(dtype)}/{op}/{rows}/{rest}"
            outs = await world.map("reduce_scatter", xs, op=op, name=name)
            parts = np.array_split(numpy_reduce(xs, op), n, axis=0)
            for r, out in enumerate(outs):
                assert_same_bytes(out, parts[r], f"rank {r} of {n}, rows {rows}, rest {rest}")


@pytest.mark.parametrize("n", SIZES)
async def test_barrier_returns_on_no_rank_before_every_rank_has_called_it(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)
    early = [asyncio.create_task(w.barrier()) for w in world.workers[:-1]]
    await asyncio.sleep(0.2)
    assert not any(t.done() for t in early), "a rank left the barrier before the last rank reached it"
    async with asyncio.timeout(10):
        await world.workers[-1].barrier()
        await asyncio.gather(*early)


@pytest.mark.parametrize("n", SIZES)
async def test_broadcast_object_from_every_root_gives_every_rank_an_equal_object(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)
    objects: list[object] = [
        None,
        {"lr": 0.1, "layers": [1, 2, 3], "name": "model", "nested": {"t": (1, "x")}},
        bytes(range(256)) * 40,  # far larger than a chunk
        np.arange(12.0).reshape(3, 4),
    ]
    for root in range(n):
        for i, obj in enumerate(objects):
            given = [obj if r == root else f"not the root {r}" for r in range(n)]
            outs = await world.map("broadcast_object", given, root=root, name=f"bo/{root}/{i}")
            for r, out in enumerate(outs):
                assert pickle.dumps(out) == pickle.dumps(obj), f"rank {r} of {n}, root {root}, object {i}"


@pytest.mark.parametrize("n", SIZES)
async def test_allgather_object_gives_every_rank_every_ranks_object_in_rank_order(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)
    objs = [{"rank": r, "payload": "x" * (r * 97)} if r % 2 else None for r in range(n)]
    outs = await world.map("allgather_object", objs, name="ago")
    for r, out in enumerate(outs):
        assert out == objs, f"rank {r} of {n}"


@pytest.mark.parametrize("n", SIZES)
async def test_unnamed_collectives_called_in_the_same_order_match_up_by_occurrence(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)

    async def sequence(w) -> list[Any]:
        a = await w.allreduce(np.full(3, w.rank + 1, dtype=np.int64), op="sum")
        b = await w.broadcast(np.full(2, w.rank, dtype=np.int32), root=n - 1)
        c = await w.allgather(np.full((1,), w.rank, dtype=np.int64))
        await w.barrier()
        d = await w.allreduce(np.full(4, w.rank, dtype=np.float32), op="max")
        return [a, b, c, d]

    outs = await world.each(sequence)
    for r, (a, b, c, d) in enumerate(outs):
        assert a.tolist() == [n * (n + 1) // 2] * 3, r
        assert b.tolist() == [n - 1] * 2, r
        assert c.tolist() == list(range(n)), r
        assert d.tolist() == [n - 1] * 4, r


@pytest.mark.parametrize("n", [3])
async def test_allreduce_accepts_lists_and_non_contiguous_arrays_and_keeps_their_shape(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)
    base = [np.arange(24, dtype=np.float64).reshape(4, 6) * (r + 1) for r in range(n)]
    views = [b.T[::2] for b in base]  # non-contiguous, shape (3, 4)
    outs = await world.map("allreduce", views, op="sum", name="noncontiguous")
    for out in outs:
        assert_same_bytes(out, np.ascontiguousarray(sum(views)), "non-contiguous input")
    lists = await world.each(lambda w: w.allreduce([1, 2, w.rank], op="sum", name="list"))
    for out in lists:
        assert out.tolist() == [n, 2 * n, sum(range(n))]


@pytest.mark.parametrize("n", SIZES)
async def test_ranks_sizes_and_views_describe_one_world(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)
    assert [w.rank for w in world.workers] == list(range(n))
    assert {w.size for w in world.workers} == {n}
    assert len({w.view_id for w in world.workers}) == 1
    # All workers of a test run on one host.
    assert [w.local_rank for w in world.workers] == list(range(n))
    assert {(w.local_size, w.cross_rank, w.cross_size) for w in world.workers} == {(n, 0, 1)}
