"""Several collectives in flight at once on real workers complete, each with the right answer."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from reference import numpy_reduce


def job_specs(count: int) -> list[tuple[str, tuple[int, ...], type, str]]:
    """Named allreduces of assorted sizes (tiny to many chunks), dtypes and ops."""
    dtypes = [np.float32, np.int64, np.float64, np.int32, np.float16]
    ops = ["sum", "max", "min", "average"]
    lengths = [0, 1, 3, 17, 1000, 40_000]
    return [
        (f"grad.{i}", (lengths[i % len(lengths)],), dtypes[i % len(dtypes)], ops[i % len(ops)]) for i in range(count)
    ]


@pytest.mark.parametrize("world", [{"n": 2, "chunk_bytes": 4096}, {"n": 4, "chunk_bytes": 4096}], indirect=True, ids=["2", "4"])
async def test_named_allreduces_submitted_in_different_orders_on_different_ranks_all_complete_correctly(world) -> None:
    specs = job_specs(18)
    data = {
        name: [np.random.default_rng(r * 1000 + i).integers(-8, 9, size=shape).astype(dtype) for r in range(world.size)]
        for i, (name, shape, dtype, _) in enumerate(specs)
    }

    async def rank_main(w) -> dict[str, np.ndarray]:
        order = list(specs)
        random.Random(w.rank).shuffle(order)
        tasks = {}
        for name, _, _, op in order:
            tasks[name] = asyncio.create_task(w.allreduce(data[name][w.rank], op=op, name=name))
            if w.rank % 2:
                await asyncio.sleep(0)  # odd ranks also interleave submission with progress
        return {name: await t for name, t in tasks.items()}

    results = await world.each(rank_main, timeout_s=60)
    for name, shape, dtype, op in specs:
        expected = numpy_reduce(data[name], op)
        for r in range(world.size):
            got = results[r][name]
            assert got.dtype == np.dtype(dtype) and got.shape == shape, name
            assert got.tobytes() == expected.tobytes(), f"{name} ({op}) on rank {r}"


@pytest.mark.parametrize("world", [3], indirect=True)
async def test_different_kinds_of_collective_in_flight_at_once_do_not_mix_their_frames(world) -> None:
    n = world.size

    async def rank_main(w) -> tuple:
        r = w.rank
        coros = {
            "ar": w.allreduce(np.full(5000, r + 1, dtype=np.int64), op="sum", name="ar"),
            "bc": w.broadcast(np.full(3000, r, dtype=np.float32), root=1, name="bc"),
            "ag": w.allgather(np.full((r + 1, 2), r, dtype=np.int32), name="ag"),
            "rs": w.reduce_scatter(np.arange(12, dtype=np.float64).reshape(6, 2), op="sum", name="rs"),
            "bo": w.broadcast_object({"from": r}, root=2, name="bo"),
            "ao": w.allgather_object(r * 10, name="ao"),
        }
        keys = list(coros)
        random.Random(r + 7).shuffle(keys)
        tasks = {k: asyncio.create_task(coros[k]) for k in keys}
        return {k: await t for k, t in tasks.items()}

    results = await world.each(rank_main)
    for r, out in enumerate(results):
        assert out["ar"].tolist() == [n * (n + 1) // 2] * 5000
        assert out["bc"].tolist() == [1.0] * 3000
        assert out["ag"].tolist() == [[q, q] for q in range(n) for _ in range(q + 1)]
        assert out["rs"].tolist() == np.array_split(np.arange(12.0).reshape(6, 2) * n, n)[r].tolist()
        assert out["bo"] == {"from": 2}
        assert out["ao"] == [q * 10 for q in range(n)]


@pytest.mark.parametrize("world", [3], indirect=True)
async def test_the_same_name_used_many_times_matches_by_occurrence(world) -> None:
    async def rank_main(w) -> list[np.ndarray]:
        # Issued in the same order on every rank, all in flight together.
        tasks = [asyncio.create_task(w.allreduce(np.full(7, i * (w.rank + 1), dtype=np.int64), op="sum", name="grad")) for i in range(20)]
        return await asyncio.gather(*tasks)

    results = await world.each(rank_main)
    for r, outs in enumerate(results):
        assert [o.tolist() for o in outs] == [[i * 6] * 7 for i in range(20)], f"rank {r}"


@pytest.mark.parametrize("world", [{"n": 3, "chunk_bytes": 256}], indirect=True, ids=["3"])
async def test_a_rank_that_starts_a_collective_late_still_gets_the_frames_sent_before_it_asked(world) -> None:
    x = np.arange(3000, dtype=np.float64)

    async def rank_main(w):
        if w.rank == 1:
            await asyncio.sleep(0.5)
        return await w.allreduce(x, op="max", name="late")

    for out in await world.each(rank_main):
        assert out.tobytes() == x.tobytes()


@pytest.mark.parametrize("world", [2], indirect=True)
async def test_a_thousand_small_allreduces_in_a_row_complete(world) -> None:
    async def rank_main(w):
        total = 0
        for i in range(1000):
            out = await w.allreduce(np.array([i], dtype=np.int64), op="sum", name="step")
            total += int(out[0])
        return total

    assert await world.each(rank_main, timeout_s=60) == [2 * sum(range(1000))] * 2
