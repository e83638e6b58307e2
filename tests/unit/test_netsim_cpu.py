"""The simulator's machine (netsim.Cpu): ranks that share a few cores wait for them, by the model's
figures exactly, and a model without one keeps CPU free (test_vsim.py holds the rest)."""

from __future__ import annotations

import numpy as np
import pytest

from ringserve.testing import netsim, vclock
from ringserve.worker.dataplane.session import Session
from ringserve.worker.ops import collectives


def test_work_queues_for_the_first_free_core_and_each_rank_runs_on_one_core_at_a_time() -> None:
    network = netsim.Network(netsim.Model(latency_s=0.0, bytes_per_s=1e9, cpu=netsim.Cpu(2, 0.0, 0.0)), 3)
    assert [network.compute(r, 1.0, 0.0) for r in range(3)] == [1.0, 1.0, 2.0]  # the third waits for a core
    assert network.compute(0, 1.0, 0.5) == 2.0  # rank 0's second: once its first is done, on that core
    assert network.compute(1, 1.0, 0.5) == 3.0  # rank 1's: both cores are taken until 2
    assert network.cpu_s == [2.0, 2.0, 1.0]


def test_a_model_without_cores_has_no_work_to_queue() -> None:
    network = netsim.Network(netsim.Model(latency_s=0.0, bytes_per_s=1e9), 2)
    with pytest.raises(ValueError, match="no cores"):
        network.compute(0, 1.0, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        netsim.Cpu(0, 1e-6, 0.0)


@pytest.mark.parametrize("cores", [1, 2, 4])
def test_a_cpu_bound_ring_allreduce_takes_its_ranks_cpu_divided_by_the_cores(cores: int) -> None:
    # Links that cost nothing, a second a frame to send and a second to take: each of 4 ranks
    # sends 6 frames (3 steps to reduce, 3 to gather) and takes 6, 12 s of CPU each, 48 in all.
    x = np.ones(4, dtype=np.float32)
    model = netsim.Model(latency_s=0.0, bytes_per_s=1e18, cpu=netsim.Cpu(cores, 1.0, 0.0))

    async def call(session: Session, rank: int) -> np.ndarray:
        return await collectives.allreduce(session, x, op="sum", name="x", chunk_bytes=1 << 20, timeout_s=1e6)

    outcome = vclock.run(netsim.simulate(4, call, model, algorithm="ring", links=model.links()))
    assert all((out == 4).all() for out in outcome.results)
    assert outcome.cpu_s == [12.0] * 4
    assert outcome.seconds == pytest.approx(48.0 / cores, abs=1e-3)


def test_a_frames_bytes_cost_cpu_on_both_sides_and_a_call_adds_its_own_work() -> None:
    x = np.ones(1 << 10, dtype=np.float32)
    model = netsim.Model(latency_s=0.0, bytes_per_s=1e18, cpu=netsim.Cpu(2, 0.0, 1e-3, handoffs=2))
    network = netsim.Network(model, 2)

    async def call(session: Session, rank: int) -> np.ndarray:
        await network.work(rank, 5.0)
        return await collectives.allreduce(session, x, op="sum", name="x", chunk_bytes=1 << 20, timeout_s=1e6)

    outcome = vclock.run(netsim.simulate(2, call, model, algorithm="ring", links=model.links(), network=network))
    # Each rank sends and takes two frames of half the vector (2 KiB) and a header.
    assert network.frames == [4, 4]
    per_rank = 5.0 + network.handled[0] * 1e-3
    assert network.handled[0] > 4 * 2048
    assert outcome.cpu_s == pytest.approx([per_rank] * 2)
    assert outcome.seconds == pytest.approx(per_rank, abs=1e-3)  # two ranks, two cores: never a wait
