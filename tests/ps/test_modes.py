"""The four modes on real shards, a real coordinator and real workers on loopback.

- sync: every round applies the mean of the members' gradients, as one process stepping on the
  mean of their losses would (the torch binding is checked against torch and allreduce in
  test_torch_ps.py);
- async, ssp and average train a small least-squares task to a low loss;
- ssp keeps every worker within ``staleness`` steps of the slowest.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from lsq import START, gradients, loss_of, task
from psworlds import PSWorld, start_ps_world

from ringserve.ps import AsyncClient, Optimizer

pytestmark = pytest.mark.timeout(90)

async def init_all(ps: PSWorld, mode: str, **kwargs: object) -> None:
    await ps.each(lambda r, c: c.init(START, mode=mode, seed=r == 0, **kwargs))
    await ps.each(lambda r, c: c.pull())


async def test_sync_rounds_apply_the_mean_of_every_members_gradient() -> None:
    ps = await start_ps_world(3, 2)
    try:
        lr = 0.1
        await init_all(ps, "sync", optimizer=Optimizer(kind="sgd", lr=lr))
        expected = {k: v.copy() for k, v in START.items()}
        for _ in range(5):
            grads = [gradients(c.values, *task(r))[1] for r, c in enumerate(ps.clients)]
            outcomes = await ps.each(lambda r, c, grads=grads: c.push(grads[r]))
            assert sum(o.count("applied") for o in outcomes) == 2  # the last push of each shard's round
            await ps.each(lambda r, c: c.pull())
            for key in expected:
                expected[key] -= lr * np.mean([g[key] for g in grads], axis=0)
            for c in ps.clients:
                for key in expected:
                    np.testing.assert_allclose(c.values[key], expected[key], rtol=1e-5, atol=1e-6)
        assert [c.versions for c in ps.clients] == [[5, 5]] * 3
    finally:
        await ps.close()


async def test_sync_with_sum_applies_the_sum_of_the_rounds_gradients() -> None:
    ps = await start_ps_world(2, 1)
    try:
        await init_all(ps, "sync", optimizer=Optimizer(kind="sgd", lr=1.0), sum=True)
        await ps.each(lambda r, c: c.push({"w": np.full(START['w'].shape, r + 1, np.float32)}))
        await ps.each(lambda r, c: c.pull())
        np.testing.assert_allclose(ps.clients[0].values["w"], -3.0)
    finally:
        await ps.close()


async def train(client: AsyncClient, rank: int, steps: int, *, delay_s: float = 0.0, every: int = 1,
                local_lr: float = 0.05) -> list[tuple[int, int]]:
    """A worker's loop; returns (step, versions seen) per step. ``every`` > 1: average mode's local steps."""
    x, y = task(rank)
    seen = []
    values = {k: v.copy() for k, v in client.values.items()}
    for step in range(steps):
        if every > 1:
            values = {k: v - local_lr * g for k, v, g in
                      ((k, values[k], gradients(values, x, y)[1][k]) for k in values)}
            if (step + 1) % every:
                continue
            await client.push_delta(values)
            values = {k: v.copy() for k, v in (await client.pull()).items()}
        else:
            _, grads = gradients(client.values, x, y)
            if delay_s:
                await asyncio.sleep(delay_s)
            await client.push(grads)
            await client.pull()
        seen.append((step, sum(client.versions)))
    return seen


@pytest.mark.parametrize(("mode", "kwargs"), [
    ("async", {}),
    ("ssp", {"staleness": 2}),
    ("average", {}),
])
async def test_each_mode_trains_a_small_task_to_a_low_loss(mode: str, kwargs: dict) -> None:
    n = 3
    ps = await start_ps_world(n, 2)
    try:
        optimizer = Optimizer(kind="sgd", lr=1.0) if mode == "average" else Optimizer(kind="momentum", lr=0.02, momentum=0.9)
        await init_all(ps, mode, optimizer=optimizer, **kwargs)
        before = loss_of(ps.clients[0].values, n)
        every = 5 if mode == "average" else 1
        await ps.each(lambda r, c: train(c, r, 150 if mode == "average" else 100, every=every, local_lr=0.05))
        final = await ps.clients[0].pull()
        after = loss_of(final, n)
        assert after < 0.01 * before, (before, after)
        assert after < 0.01
    finally:
        await ps.close()


@pytest.mark.parametrize("staleness", [0, 2])
async def test_ssp_never_lets_a_worker_run_more_than_staleness_steps_ahead_of_the_slowest(staleness: int) -> None:
    ps = await start_ps_world(3, 2)
    started = [0, 0, 0]   # pushes begun: at least each worker's clock on the shards
    leads: list[int] = []
    try:
        await init_all(ps, "ssp", optimizer=Optimizer(kind="sgd", lr=0.01), staleness=staleness)

        async def worker(rank: int, client: AsyncClient) -> None:
            x, y = task(rank)
            for step in range(12):
                await client.pull()
                leads.append(step - min(started))   # computing step `step` now
                if rank == 2:
                    await asyncio.sleep(0.05)       # the straggler
                started[rank] += 1
                await client.push(gradients(client.values, x, y)[1])

        await ps.each(worker)
        assert max(leads) <= staleness
        assert max(leads) == staleness, leads          # the fast workers did run ahead, as far as allowed
    finally:
        await ps.close()


@pytest.mark.parametrize(("codec", "tolerance"), [("fp16", 2e-3), ("bf16", 1e-2), ("int8", 2e-2)])
async def test_pushes_travel_with_a_wire_codec_in_fewer_bytes_and_land_within_its_error(codec: str, tolerance: float) -> None:
    ps = await start_ps_world(2, 2, client={"push_codec": codec, "chunk_bytes": 40})
    try:
        await init_all(ps, "sync", optimizer=Optimizer(kind="sgd", lr=1.0))
        grads = [{"w": np.linspace(-1, 1, START["w"].size).astype(np.float32) * (r + 1),
                  "b": np.array([0.5 * (r + 1)], np.float32)} for r in range(2)]
        await ps.each(lambda r, c: c.push(grads[r]))
        values = (await ps.each(lambda r, c: c.pull()))[0]
        for key in grads[0]:
            np.testing.assert_allclose(values[key], -(grads[0][key] + grads[1][key]) / 2, atol=tolerance, rtol=tolerance)
        raw = sum(g.nbytes for g in grads[0].values())
        assert ps.clients[0].counts["bytes_sent"] < raw
    finally:
        await ps.close()


async def test_a_pull_after_the_first_sends_only_the_pieces_changed_since_the_version_held() -> None:
    ps = await start_ps_world(1, 1)
    try:
        client = ps.clients[0]
        await client.init({"big": np.zeros(1000, np.float32), "small": np.zeros(2, np.float32)}, mode="async",
                          optimizer=Optimizer(kind="sgd", lr=1.0))
        await client.pull()
        before = client.counts["bytes_received"]
        await client.push({"small": np.ones(2, np.float32)})
        values = await client.pull()
        assert client.counts["bytes_received"] - before == 8       # "small" only
        np.testing.assert_array_equal(values["small"], -1.0)
        other = ps.client_for(0)
        await other.init({"big": np.zeros(1000, np.float32), "small": np.zeros(2, np.float32)}, mode="async",
                         optimizer=Optimizer(kind="sgd", lr=1.0), seed=False)
        assert (await other.pull())["small"].tolist() == [-1.0, -1.0]   # a first pull: everything
        assert other.counts["bytes_received"] == 4008
        await other.close()
    finally:
        await ps.close()
