"""alltoall, grouped allgather and reduce-scatter, join and Adasum between real workers over loopback
(the gRPC stream, and shared memory on all but one worker), for worlds of 2 to 5, against numpy."""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

import numpy as np
import pytest
from reference import numpy_adasum, numpy_reduce

from ringserve import InvalidArgumentError, MismatchError, UnsupportedError, Worker

pytestmark = pytest.mark.asyncio(loop_scope="module")

SIZES = [2, 3, 4, 5]


def seed_of(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def bits(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.random.default_rng(seed).integers(0, 256, size=count * np.dtype(dtype).itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("n", SIZES)
async def test_alltoall_with_uneven_splits_runs_beside_allreduces_and_moves_bytes_unchanged(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)
    rng = np.random.default_rng(n)
    splits = [[int(rng.integers(0, 30)) for _ in range(n)] for _ in range(n)]
    cases = [(np.float16, ()), (np.int64, (3,)), (np.uint8, (2, 5)), (np.float64, (0,))]
    inputs = {i: [bits((sum(splits[r]), *rest), dtype, seed_of(n, i, r)) for r in range(n)]
              for i, (dtype, rest) in enumerate(cases)}

    async def call(w: Worker) -> list[Any]:
        r = w.rank
        exchanges = [w.alltoall(inputs[i][r], splits=splits[r], name=f"a2a/{i}") for i in inputs]
        reduced = w.allreduce(np.full(1000, r, dtype=np.int64), op="sum", name="beside")
        return list(await asyncio.gather(*exchanges, reduced))

    outs = await world.each(call)
    for r in range(n):
        for i in inputs:
            got, counts = outs[r][i]
            parts = [inputs[i][o][sum(splits[o][:r]): sum(splits[o][: r + 1])] for o in range(n)]
            want = np.concatenate(parts)
            assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), (r, i)
            assert counts.tolist() == [splits[o][r] for o in range(n)]
        assert outs[r][-1].tolist() == [sum(range(n))] * 1000


@pytest.mark.parametrize("n", SIZES)
async def test_wrong_splits_on_one_worker_fail_every_worker_within_the_abort_grace(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)

    async def call(w: Worker) -> tuple[type, float]:
        started = time.monotonic()
        splits = [2] * n if w.rank != 1 else [3] * n
        try:
            await w.alltoall(np.zeros((2 * n, 4), dtype=np.float32), splits=splits, name="bad splits")
        except (InvalidArgumentError, MismatchError) as exc:
            return type(exc), time.monotonic() - started
        return type(None), time.monotonic() - started

    outcomes = await world.each(call)
    grace = world.workers[0].config.abort_grace_s
    for r, (kind, took) in enumerate(outcomes):
        assert kind is (InvalidArgumentError if r == 1 else MismatchError), (r, kind)
        assert took < grace + 2.0, f"rank {r} took {took:.2f} s"
    # The world goes on.
    assert [o.tolist() for o in await world.map("allreduce", [np.ones(2)] * n, op="sum", name="after bad")] == [[n, n]] * n


@pytest.mark.parametrize("n", SIZES)
async def test_grouped_allgather_and_reduce_scatter_equal_one_collective_per_array(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)
    gathers = [[bits((r + k, 3), dtype, seed_of(n, r, k)) for k, dtype in enumerate((np.float32, np.int8, np.float64))]
               for r in range(n)]
    reduces = [[np.random.default_rng(seed_of(n, r, k)).integers(-9, 9, shape).astype(np.int32)
                for k, shape in enumerate([(2 * n + 1, 2), (n,), (1,)])] for r in range(n)]

    async def call(w: Worker) -> tuple[list[np.ndarray], list[np.ndarray]]:
        return (await w.grouped_allgather(gathers[w.rank], name="grouped ag"),
                await w.grouped_reduce_scatter(reduces[w.rank], op="sum", name="grouped rs"))

    outs = await world.each(call)
    for r, (gathered, scattered) in enumerate(outs):
        for k in range(3):
            want = np.concatenate([gathers[o][k] for o in range(n)])
            assert gathered[k].tobytes() == want.tobytes() and gathered[k].shape == want.shape
            part = np.array_split(numpy_reduce([reduces[o][k] for o in range(n)], "sum"), n)[r]
            np.testing.assert_array_equal(scattered[k], part)


@pytest.mark.parametrize("n", SIZES)
async def test_workers_that_join_early_add_zeros_until_the_last_joins(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)

    async def call(w: Worker) -> tuple[list[np.ndarray], int, np.ndarray]:
        sums = []
        for step in range(w.rank + 1):  # rank r has r + 1 batches
            sums.append(await w.allreduce(np.full(257, w.rank + 1.0), op="average", name=f"join/{step}"))
        last = await w.join()
        return sums, last, await w.allgather(np.array([w.rank]), name="join/after")  # all back at work

    outs = await world.each(call)
    for sums, last, after in outs:
        assert last == n - 1
        assert after.tolist() == list(range(n))
        for step, got in enumerate(sums):
            live = range(step, n)
            np.testing.assert_allclose(got, np.full(257, sum(k + 1.0 for k in live) / n))


@pytest.mark.parametrize("n", SIZES)
async def test_adasum_is_numpys_adasum_in_the_same_bytes_on_every_worker_or_is_refused(shared_worlds, n: int) -> None:
    world = await shared_worlds(n)
    xs = [np.random.default_rng(seed_of(n, r)).standard_normal(3001).astype(np.float32) for r in range(n)]
    if n & (n - 1):
        outcomes = await world.each_outcome(lambda w: w.allreduce(xs[w.rank], op="adasum", name="adasum"))
        assert all(isinstance(o, UnsupportedError) and isinstance(o, NotImplementedError) for o in outcomes)
        return
    outs = await world.map("allreduce", xs, op="adasum", name="adasum")
    for out in outs:
        assert out.tobytes() == outs[0].tobytes()
    np.testing.assert_allclose(outs[0], numpy_adasum(xs), rtol=1e-5, atol=1e-6)
