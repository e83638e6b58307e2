"""Adasum (worker/ops/adasum.py), run by the ring simulator for worlds 1..16 that are powers of two: the
result is numpy's Adasum of the whole vectors (tests/reference.py), the same bytes on every rank, a
sum for orthogonal gradients and an average for parallel ones; other worlds and integer dtypes are
refused as Horovod refuses them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from reference import numpy_adasum
from ringsim import simulate

from ringserve.errors import InvalidArgumentError, MismatchError, UnsupportedError
from ringserve.worker.dataplane.session import Session
from ringserve.worker.ops import adasum, join

T = 10.0
POWERS = [1, 2, 4, 8, 16]


def tolerance(dtype: Any) -> float:
    return {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}[np.dtype(dtype).type]


async def run(world: int, inputs: list[np.ndarray], parts: list[int] | None = None, chunk: int = 24,
              **ring: Any) -> list[np.ndarray]:
    async def call(session: Session, rank: int) -> np.ndarray:
        return await adasum.allreduce(session, inputs[rank], name="g", chunk_bytes=chunk, timeout_s=T, parts=parts)
    return await simulate(world, call, seed=world, **ring)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("world", POWERS)
async def test_adasum_equals_numpys_adasum_of_the_whole_vectors_in_the_same_bytes_on_every_rank(world: int, dtype: Any) -> None:
    rng = np.random.default_rng(world)
    for length, parts in [(0, None), (1, None), (world + 3, None), (101, [40, 0, 61]), (37, [37])]:
        inputs = [rng.standard_normal(length).astype(dtype) for _ in range(world)]
        outs = await run(world, inputs, parts)
        for r, out in enumerate(outs):
            assert out.dtype == inputs[0].dtype and out.shape == inputs[0].shape
            assert out.tobytes() == outs[0].tobytes(), f"rank {r} differs from rank 0 (length {length})"
        expected = numpy_adasum(inputs, parts)
        np.testing.assert_allclose(outs[0].astype(np.float64), expected.astype(np.float64),
                                   rtol=tolerance(dtype), atol=tolerance(dtype))


@pytest.mark.parametrize("world", [2, 4, 8])
async def test_adasum_sums_orthogonal_gradients_and_averages_parallel_ones(world: int) -> None:
    # As Horovod's own Adasum tests: columns of an orthogonal matrix add up; scaled copies of one
    # vector average.
    rng = np.random.default_rng(world)
    q, _ = np.linalg.qr(rng.standard_normal((3 * world + 5, world)))
    orthogonal = [q[:, r].copy() for r in range(world)]
    np.testing.assert_allclose((await run(world, orthogonal))[0], q.sum(axis=1), atol=1e-12)
    base = rng.standard_normal(50)
    scales = rng.uniform(0.1, 3.0, world)
    parallel = [base * s for s in scales]
    np.testing.assert_allclose((await run(world, parallel))[0], base * scales.mean(), rtol=1e-12)


async def test_each_part_gets_its_own_coefficients() -> None:
    # Part 0 parallel (averaged), part 1 orthogonal (summed): one set of coefficients would do neither.
    a = np.array([1.0, 2.0, 1.0, 0.0])
    b = np.array([3.0, 6.0, 0.0, 1.0])
    out = (await run(2, [a, b], parts=[2, 2]))[0]
    np.testing.assert_allclose(out, [2.0, 4.0, 1.0, 1.0])


async def test_a_joined_rank_adds_zeros_which_leave_the_others_adasum_as_it_is() -> None:
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(30) for _ in range(4)]

    async def call(session: Session, rank: int) -> Any:
        if rank == 3:
            return await join.join(session, chunk_bytes=24, timeout_s=T, join_timeout_s=T)
        out = await adasum.allreduce(session, inputs[rank], name="g", chunk_bytes=24, timeout_s=T)
        await join.join(session, chunk_bytes=24, timeout_s=T, join_timeout_s=T)
        return out

    outs = await simulate(4, call, seed=4)
    expected = numpy_adasum([*inputs[:3], np.zeros(30)])
    for out in outs[:3]:
        np.testing.assert_allclose(out, expected, rtol=1e-12)
    np.testing.assert_allclose(expected[:], numpy_adasum([numpy_adasum(inputs[:2]), inputs[2]]), rtol=1e-12)


@pytest.mark.parametrize("world", [3, 5, 6])
async def test_a_world_whose_size_is_not_a_power_of_two_is_refused_as_horovod_refuses_it(world: int) -> None:
    async def call(session: Session, rank: int) -> Any:
        return await adasum.allreduce(session, np.ones(4), name=None, chunk_bytes=8, timeout_s=T)

    with pytest.raises(UnsupportedError, match=r"non-power of 2") as caught:
        await simulate(world, call, seed=world)
    assert isinstance(caught.value, NotImplementedError)


async def test_integer_arrays_and_parts_that_do_not_tile_the_array_are_refused() -> None:
    async def ints(session: Session, rank: int) -> Any:
        return await adasum.allreduce(session, np.ones(4, dtype=np.int32), name=None, chunk_bytes=8, timeout_s=T)

    with pytest.raises(InvalidArgumentError, match=r"floating point"):
        await simulate(2, ints, seed=2)

    async def parts(session: Session, rank: int) -> Any:
        return await adasum.allreduce(session, np.ones(4), name=None, chunk_bytes=8, timeout_s=T, parts=[1, 2])

    with pytest.raises(InvalidArgumentError, match=r"sum to the array's 4 elements"):
        await simulate(2, parts, seed=2)


async def test_adasum_through_shared_memory_lanes_and_with_checksums_is_the_same(tmp_path: Any) -> None:
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(77).astype(np.float32) for _ in range(4)]
    plain = await run(4, inputs)
    assert (await run(4, inputs, lanes=True))[0].tobytes() == plain[0].tobytes()
    assert (await run(4, inputs, checksum=True))[0].tobytes() == plain[0].tobytes()


async def test_ranks_whose_adasum_arguments_differ_fail_with_a_mismatch() -> None:
    async def call(session: Session, rank: int) -> Any:
        return await adasum.allreduce(session, np.ones(4 + rank), name="m", chunk_bytes=8, timeout_s=T)

    with pytest.raises(MismatchError):
        await simulate(2, call, seed=1, abort_grace_s=0.5)
