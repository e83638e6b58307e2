"""A real local Ray cluster for the tests of ringserve.ray, on loopback only.

Collected only where Ray is installed (scripts/test_ray.sh installs the ray extra); every test here
carries the ``ray`` marker, deselected by default. Ray is kept on 127.0.0.1 (its "local cluster"
mode, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) and sends no usage statistics, both set before Ray is
imported, so that Ray's own processes inherit them.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent

if importlib.util.find_spec("ray") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, str(ROOT / "examples"))  # the digits demo's model and helpers
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """One Ray instance for the session: 4 CPUs' worth of slots, the examples and these helpers on
    every worker's path."""
    import ray
    from ray_digits import WORKER_ENV

    path = os.pathsep.join([str(ROOT / "examples"), str(HERE), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, **WORKER_ENV}})
    assert ray.util.get_node_ip_address() == "127.0.0.1", "Ray must run on loopback in tests"
    try:
        yield ray
    finally:
        ray.shutdown()
