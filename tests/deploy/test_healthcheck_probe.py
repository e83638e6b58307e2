"""``python -m ringserve.healthcheck``, the compose health check, against real servers."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from ringserve import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from ringserve.healthcheck import check
from ringserve.loop import LoopThread

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread(use_uvloop=True)
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def coordinator(loop: LoopThread) -> Iterator[Coordinator]:
    coord = Coordinator(CoordinatorConfig(settle_s=0.05, tick_s=0.01))
    loop.run(coord.start(), 30)
    yield coord
    loop.run(coord.stop(), 30)


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ringserve.healthcheck", *args],
                          capture_output=True, text=True, timeout=30)


def test_a_serving_coordinator_passes_the_probe(coordinator: Coordinator) -> None:
    result = probe(coordinator.address)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{coordinator.address} (service '') is SERVING."


def test_the_probe_can_ask_about_the_coordinator_service_by_name(coordinator: Coordinator) -> None:
    result = probe(coordinator.address, "--service", "ringserve.v1.Coordinator")
    assert result.returncode == 0, result.stderr


def test_an_unknown_service_fails_the_probe_with_not_found(coordinator: Coordinator) -> None:
    result = probe(coordinator.address, "--service", "no.such.Service")
    assert result.returncode == 1
    assert "failed with NOT_FOUND" in result.stderr


def test_a_closed_port_fails_the_probe_quickly_naming_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
        result = probe(address, "--timeout", "2")
    assert result.returncode == 1
    assert f"The health check of {address}" in result.stderr
    assert "UNAVAILABLE" in result.stderr or "DEADLINE_EXCEEDED" in result.stderr


def test_a_worker_serves_the_health_service_too(loop: LoopThread, coordinator: Coordinator) -> None:
    worker = Worker(config=WorkerConfig(coordinator=coordinator.address, rendezvous_timeout_s=20, use_uvloop=True))
    loop.run(worker.start(), 30)
    try:
        serving, message = check(worker.address)
        assert serving, message
    finally:
        loop.run(worker.close(), 30)


def test_probe_of_a_stopped_coordinator_fails(loop: LoopThread) -> None:
    coord = Coordinator(CoordinatorConfig())
    loop.run(coord.start(), 30)
    address = coord.address
    assert check(address)[0]
    loop.run(coord.stop(), 30)
    serving, message = check(address, timeout_s=2)
    assert not serving and address in message


