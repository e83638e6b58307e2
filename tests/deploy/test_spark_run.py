"""ringserve.spark.run on a real local Spark session (local[4]): barrier tasks as ringserve workers.

One session serves the module (a JVM takes seconds to start). The driver and the executors stay on
loopback. The functions that run in the tasks are defined inside the tests, so that cloudpickle
ships them by value (the executors cannot import this test module).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ringserve.spark
from ringserve.errors import InvalidArgumentError
from ringserve.spark import SparkTaskError

DEMO = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"
SPARK_TIMEOUT_S = 180  # the first test also starts the JVM


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    saved = {k: os.environ.get(k) for k in ("PYSPARK_PYTHON", "SPARK_LOCAL_IP")}
    # The executors' Python must be this one (it has ringserve); everything stays on loopback.
    os.environ.update(PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    session = (
        SparkSession.builder.master("local[4]")
        .appName("ringserve-spark-test")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.mark.timeout(SPARK_TIMEOUT_S)
def test_four_barrier_tasks_allreduce_and_return_their_results_in_rank_order(spark: Any) -> None:
    def task(offset: float) -> tuple[int, int, float, int]:
        import os

        import numpy as np

        import ringserve as rs

        rs.init()
        total = rs.allreduce(np.array([rs.rank() + offset]), op="sum", name="spark.sum")
        result = (rs.rank(), rs.size(), float(total[0]), os.getpid())
        rs.shutdown()
        return result

    results = ringserve.spark.run(task, args=(10.0,), num_proc=4)
    assert [r[:3] for r in results] == [(rank, 4, 46.0) for rank in range(4)]  # 0+1+2+3 + 4*10
    assert len({r[3] for r in results}) == 4, "the four ranks must be four processes"


@pytest.mark.timeout(SPARK_TIMEOUT_S)
def test_four_barrier_tasks_train_the_demo_to_identical_parameters(spark: Any) -> None:
    demo = str(DEMO)

    def train(epochs: int) -> tuple[int, int]:
        import importlib.util

        import ringserve.torch as hvd

        spec = importlib.util.spec_from_file_location("train_digits", demo)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        args = module.parse_args(["--epochs", str(epochs), "--hidden", "64"])
        hvd.init()  # the demo's own init() then finds this worker; its rank is read here first
        rank = hvd.rank()
        return rank, module.train(args)

    results = ringserve.spark.run(train, kwargs={"epochs": 2}, num_proc=4)
    # The demo gathers every rank's parameter hash at its end, and returns 1 unless all are equal.
    assert results == [(0, 0), (1, 0), (2, 0), (3, 0)]


@pytest.mark.timeout(SPARK_TIMEOUT_S)
def test_a_failing_task_stops_the_job_and_the_error_names_its_rank(spark: Any) -> None:
    def task() -> None:
        import time

        import numpy as np

        import ringserve as rs

        rs.init()
        if rs.rank() == 2:
            raise ValueError("rank two gives up")
        rs.allreduce(np.ones(3), name="never.completes")
        time.sleep(300)

    started = time.monotonic()
    with pytest.raises(SparkTaskError) as caught:
        ringserve.spark.run(task)  # num_proc defaults to the default parallelism: 4
    assert caught.value.rank == 2
    assert "rank 2" in str(caught.value) and "ValueError: rank two gives up" in str(caught.value)
    assert time.monotonic() - started < 60, "the other tasks were not stopped"


@pytest.mark.timeout(SPARK_TIMEOUT_S)
def test_more_processes_than_local_slots_are_refused_before_any_task_starts(spark: Any) -> None:
    started = time.monotonic()
    with pytest.raises(InvalidArgumentError, match=r"num_proc=5\) is more than the 4 task slots"):
        ringserve.spark.run(lambda: None, num_proc=5)
    assert time.monotonic() - started < 5


@pytest.mark.timeout(SPARK_TIMEOUT_S)
def test_the_session_still_runs_jobs_after_a_failed_run(spark: Any) -> None:
    def task() -> int:
        import ringserve as rs

        rs.init()
        rank = rs.rank()
        rs.barrier()
        # No shutdown(): run() leaves the world for the task, as Spark may reuse this process.
        return rank

    assert ringserve.spark.run(task, num_proc=2) == [0, 1]
    assert ringserve.spark.run(task, num_proc=3) == [0, 1, 2]
