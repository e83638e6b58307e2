"""New-result collectives between real workers take their buffers from the worker's pool
(ringserve/worker/dataplane/pool.py): a result the caller holds is never written again, and a dropped one is
reused."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(60)

N = 300_000  # 1.2 MB of float32: above the pool's smallest size


@pytest.mark.parametrize("shared_memory", [True, False])
async def test_held_results_stay_intact_and_dropped_ones_are_reused(world_factory, shared_memory) -> None:
    world = await world_factory(2, chunk_bytes=256 << 10, shared_memory=shared_memory)
    held = []
    for i in range(4):  # four results alive at once: four buffers
        outs = await world.map("allreduce", [np.full(N, i + r, dtype=np.float32) for r in range(2)], op="sum",
                               name="held")
        held.append(outs)
    for i, outs in enumerate(held):
        for out in outs:
            assert (out == 2 * i + 1).all()
    assert all(w.node.planes.pool.reused == 0 for w in world.workers)
    held.clear()
    out = None
    for i in range(6):  # the loop `out = allreduce(x)`: the last result is alive during the next call
        out = await world.map("allreduce", [np.full(N, i, dtype=np.float32)] * 2, op="sum", name="loop")
        assert all((o == 2 * i).all() for o in out)
    assert all(w.node.planes.pool.reused >= 6 for w in world.workers)
    del out


async def test_reduce_scatter_and_compressed_allreduce_are_exact_over_reused_buffers(world_factory) -> None:
    world = await world_factory(3, chunk_bytes=128 << 10)
    rng = np.random.default_rng(5)
    for _ in range(3):
        inputs = [rng.standard_normal((N // 10, 10)).astype(np.float32) for _ in range(3)]
        parts = await world.map("reduce_scatter", inputs, op="sum", name="rs")
        total = (inputs[0] + inputs[1]) + inputs[2]
        np.testing.assert_allclose(np.concatenate(parts), total, rtol=1e-5, atol=1e-5)
        coded = await world.map("allreduce", inputs, op="average", compression="fp16", name="c")
        assert all(c.tobytes() == coded[0].tobytes() for c in coded)
        np.testing.assert_allclose(coded[0], total / 3, rtol=1e-2, atol=1e-2)
    assert all(w.node.planes.pool.reused > 0 for w in world.workers)


async def test_a_pool_of_zero_bytes_allocates_every_result(world_factory) -> None:
    world = await world_factory(2, result_pool_bytes=0)
    for i in range(3):
        outs = await world.map("allreduce", [np.full(N, i, dtype=np.float32)] * 2, op="sum", name="p")
        assert all((o == 2 * i).all() for o in outs)
    assert all(w.node.planes.pool.reused == 0 and w.node.planes.pool.held_bytes == 0 for w in world.workers)
