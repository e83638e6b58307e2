"""``transform`` on a DataFrame larger than the driver's memory: transform_beyond_memory.py in a process
of its own (a 512 MiB JVM heap, which in local mode holds the executors too) on 8M rows made on the
executors, at least 832 MB of doubles. Minutes on two busy cores, so marked ``slow``:
``pytest -m slow tests/spark_estimators/test_spark_ml_memory.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROWS = 8_000_000
HERE = Path(__file__).resolve().parent


def test_transform_goes_through_a_dataframe_larger_than_the_driver_in_batches() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), str(HERE),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(HERE / "transform_beyond_memory.py"), str(ROWS)], env=env,
                          capture_output=True, text=True, timeout=1100, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    print(got)
    assert got["rows"] == ROWS
    assert got["data_bytes_at_least"] > got["heap"], got
    assert math.isclose(got["total"], got["local_total"], rel_tol=1e-6, abs_tol=1e-2), got
    assert math.isclose(got["top"], got["local_top"], rel_tol=1e-6), got
