"""RINGSERVE_ADVERTISE_HOST=auto: a worker bound to every interface advertises the address on its
route to the coordinator (in a container, its own address on the compose network; here, loopback)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from ringserve import WorkerConfig
from ringserve.config import ADVERTISE_AUTO

pytestmark = pytest.mark.timeout(60)


def test_auto_resolves_to_the_interface_that_routes_to_the_coordinator() -> None:
    assert WorkerConfig(coordinator="127.0.0.1:50051", advertise_host=ADVERTISE_AUTO).advertised_host() == "127.0.0.1"
    assert WorkerConfig(coordinator="localhost:50051", advertise_host=ADVERTISE_AUTO).advertised_host() in ("127.0.0.1", "[::1]")


def test_an_explicit_advertise_host_wins_and_the_bind_host_is_the_fallback() -> None:
    assert WorkerConfig(bind_host="0.0.0.0", advertise_host="10.1.2.3").advertised_host() == "10.1.2.3"
    assert WorkerConfig(bind_host="127.0.0.2").advertised_host() == "127.0.0.2"


def test_auto_is_read_from_the_environment_as_compose_sets_it() -> None:
    config = WorkerConfig.from_env({"RINGSERVE_COORDINATOR": "127.0.0.1:6000", "RINGSERVE_BIND_HOST": "0.0.0.0",
                                    "RINGSERVE_ADVERTISE_HOST": "auto"})
    assert config.bind_host == "0.0.0.0" and config.advertised_host() == "127.0.0.1"


# Run in a network namespace this test makes, with loopback alone: workers bound to 0.0.0.0 there
# are reachable from nowhere else.
WORLD = """
import asyncio
import numpy as np
from ringserve import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from ringserve.config import ADVERTISE_AUTO

async def main():
    async with Coordinator(CoordinatorConfig(min_workers=3, settle_s=0.2)) as coord:
        workers = [Worker(config=WorkerConfig(coordinator=coord.address, bind_host="0.0.0.0",
                                              advertise_host=ADVERTISE_AUTO)) for _ in range(3)]
        try:
            await asyncio.gather(*(w.start() for w in workers))
            assert all(w.address.startswith("127.0.0.1:") for w in workers), [w.address for w in workers]
            results = await asyncio.gather(*(w.allreduce(np.full(5, w.rank, dtype=np.float32), op="sum")
                                             for w in workers))
            for r in results:
                np.testing.assert_array_equal(r, np.full(5, 3, dtype=np.float32))
        finally:
            await asyncio.gather(*(w.close() for w in workers))
    print("EXACT")

asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 for its namespace")
def test_workers_bound_to_every_interface_with_auto_advertise_reach_each_other() -> None:
    ns = f"rs-adv-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=10)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, capture_output=True, timeout=10)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}
        proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", WORLD], env=env, capture_output=True,
                              text=True, timeout=50)
        assert proc.returncode == 0 and "EXACT" in proc.stdout, proc.stderr[-4000:]
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
