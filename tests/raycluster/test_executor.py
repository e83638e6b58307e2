"""RayExecutor on a real local Ray cluster: the digits demo at 2 and 4 workers, the Horovod-shaped
calls, and a failing rank named.

    bash scripts/test_ray.sh            # installs the ray extra, runs tests/raycluster (-m ray)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import ray_digits

import ringserve
import ringserve.ray
from ringserve.ray import RayExecutor, RayWorkerError

pytestmark = pytest.mark.ray


EPOCHS, SEED, BATCH = 6, 0, 64


# A loaded 2-core machine can deschedule a worker for seconds: a heartbeat timeout with room for it
# (a killed worker is found at once all the same, by its peers' broken streams).
COORDINATOR = {"heartbeat_timeout_s": 15.0}


def _executor(num_workers: int, **settings: Any) -> RayExecutor:
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=90, coordinator=COORDINATOR, **settings),
                     num_workers=num_workers, cpus_per_worker=1, use_gpu=False)
    ex.start()
    return ex


@pytest.mark.timeout(400)
def test_the_digits_demo_trains_to_the_same_parameters_on_2_and_4_workers(ray_cluster: Any) -> None:
    reference = ray_digits.train_reference(EPOCHS, SEED, BATCH)
    by_size = {}
    for size in (2, 4):
        ex = _executor(size)
        try:
            results = ex.run(ray_digits.train, args=[EPOCHS, SEED, BATCH])
        finally:
            ex.shutdown()
        assert [r["rank"] for r in results] == list(range(size)), "one result per rank, in rank order"
        assert all(r["size"] == size and r["identical"] for r in results)
        assert len({r["digest"] for r in results}) == 1, "every rank of a world holds the same parameters"
        assert results[0]["accuracy"] > 0.9, results[0]
        by_size[size] = results[0]["params"]
    # The same global batches, whatever the world: 2 workers, 4 workers and one process agree, up to
    # the order in which floats were added.
    for size, params in by_size.items():
        np.testing.assert_allclose(params, reference, rtol=1e-3, atol=2e-5, err_msg=f"{size} workers")
    np.testing.assert_allclose(by_size[2], by_size[4], rtol=1e-3, atol=2e-5)


def _where(_executable: Any) -> tuple[str, int]:
    import os

    return os.environ["RINGSERVE_COORDINATOR"], int(os.environ["RINGSERVE_RANK_HINT"])


def _sum_of_ranks(scale: float) -> float:
    import numpy as np

    import ringserve as rs

    rs.init()
    return float(rs.allreduce(np.array([rs.rank() * scale]), op="sum")[0])


class Counter:
    def __init__(self, start: int) -> None:
        self.value = start


def test_run_remote_execute_and_execute_single_behave_as_horovods(ray_cluster: Any) -> None:
    import ray

    ex = RayExecutor(RayExecutor.create_settings(timeout_s=90, coordinator=COORDINATOR), num_workers=2)
    ex.start(executable_cls=Counter, executable_args=[5])
    try:
        assert ex.execute(_where) == [(ex.coordinator_address, 0), (ex.coordinator_address, 1)]
        assert ex.execute_single(lambda counter: counter.value) == 5
        refs = ex.run_remote(_sum_of_ranks, kwargs={"scale": 2.0})
        assert len(refs) == 2 and all(isinstance(r, ray.ObjectRef) for r in refs)
        assert ray.get(refs) == [2.0, 2.0]
        status = ex.status()
        assert status.view_size == 2 and [m.member.rank for m in status.members] == [0, 1]
    finally:
        ex.shutdown()
    ex.shutdown()  # twice is harmless


def _fails_on_rank_1() -> int:
    import numpy as np

    import ringserve as rs

    rs.init()
    if rs.rank() == 1:
        raise ValueError("rank 1 gives up")
    rs.allreduce(np.ones(4), name="after")
    return rs.rank()


def test_a_rank_that_raises_is_named_and_the_others_do_not_hang(ray_cluster: Any) -> None:
    ex = _executor(3, env={"RINGSERVE_COLLECTIVE_TIMEOUT_S": "120"})
    try:
        with pytest.raises(RayWorkerError, match=r"rank 1 .*ValueError: rank 1 gives up") as caught:
            ex.run(_fails_on_rank_1)
        assert caught.value.rank == 1 and not caught.value.died
    finally:
        ex.shutdown()


def test_bad_sizes_are_refused_with_the_values_named() -> None:
    with pytest.raises(ringserve.InvalidArgumentError, match=r"num_workers=0"):
        RayExecutor(num_workers=0)
    with pytest.raises(ringserve.InvalidArgumentError, match=r"min_workers \(3\) <= num_workers \(2\)"):
        RayExecutor(num_workers=2, min_workers=3, max_workers=4)
    with pytest.raises(ringserve.UsageError, match="start"):
        RayExecutor(num_workers=2).run(_sum_of_ranks)
