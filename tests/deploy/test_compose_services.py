"""The compose services' own commands and environment, run as local processes, train the demo.

What Docker would do for ``docker compose up --scale worker=N`` is done here by hand: the file is
interpolated (with a free port for RINGSERVE_PORT), each container's environment is the image's
ENV plus the service's ``environment``, the service name ``coordinator`` resolves to 127.0.0.1, the
coordinator's own health-check command is retried as compose retries it, and only then do the N
workers start (``depends_on: service_healthy``), in the image's WORKDIR (the repository root
here, since the Dockerfile copies the repository's files there).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from _compose import ROOT, command, dockerfile, environment, load, seconds
from worlds import free_port

VENV_BIN = Path(sys.executable).parent
LOOPBACK = "127.0.0.1"


def resolve_service_names(value: str, names: list[str]) -> str:
    """What the compose network's DNS does for ``coordinator:50051``: the name becomes an address."""
    for name in names:
        value = re.sub(rf"(?<![\w.-]){re.escape(name)}(?=:\d)", LOOPBACK, value)
    return value


def local_argv(argv: list[str]) -> list[str]:
    """The container's executables (python, ringserve) are this virtualenv's."""
    found = shutil.which(argv[0], path=str(VENV_BIN))
    assert found, f"{argv[0]} is not in {VENV_BIN}"
    return [found, *argv[1:]]


def container_env(service: Mapping[str, object], names: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}
    env.update(dockerfile().env)
    env.update({k: resolve_service_names(v, names) for k, v in environment(service).items()})
    return env


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in started:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_until_healthy(service: Mapping[str, object], env: dict[str, str], names: list[str],
                       coordinator: subprocess.Popen[str]) -> None:
    check = service["healthcheck"]
    assert isinstance(check, dict)
    test = command(check["test"])
    assert test[0] == "CMD"
    argv = local_argv([resolve_service_names(arg, names) for arg in test[1:]])
    interval, timeout = seconds(check.get("interval", "30s")), seconds(check.get("timeout", "30s"))
    deadline = time.monotonic() + seconds(check.get("start_period", "0s")) + interval * int(check.get("retries", 3))
    last = None
    while time.monotonic() < deadline:
        assert coordinator.poll() is None, f"the coordinator exited with {coordinator.returncode}"
        last = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 10)
        if last.returncode == 0:
            return
        time.sleep(min(interval, 0.5))
    pytest.fail(f"the coordinator never became healthy: {last.stdout if last else ''}{last.stderr if last else ''}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scale", [2, 4])
def test_scale_worker_n_forms_one_view_of_n_and_trains_the_demo_to_completion(
    processes: list[subprocess.Popen[str]], scale: int, tmp_path: Path,
) -> None:
    compose = load({"RINGSERVE_PORT": str(free_port())})
    services = compose["services"]
    names = list(services)
    coordinator_service, worker_service = services["coordinator"], services["worker"]

    coordinator_env = container_env(coordinator_service, names)
    coordinator_log = tmp_path / "coordinator.log"
    with coordinator_log.open("w") as log_file:
        coordinator = subprocess.Popen(
            local_argv(command(coordinator_service["command"])), env=coordinator_env, cwd=ROOT,
            stdout=log_file, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    processes.append(coordinator)
    wait_until_healthy(coordinator_service, coordinator_env, names, coordinator)

    worker_env = container_env(worker_service, names)
    assert worker_env["RINGSERVE_COORDINATOR"] == f"{LOOPBACK}:{coordinator_env['RINGSERVE_PORT']}"
    workers = [
        subprocess.Popen(local_argv(command(worker_service["command"])), env=worker_env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for _ in range(scale)
    ]
    processes.extend(workers)
    outputs = [w.communicate(timeout=200)[0] for w in workers]
    for i, (w, out) in enumerate(zip(workers, outputs, strict=True)):
        assert w.returncode == 0, f"worker {i} exited with {w.returncode}:\n{out}\ncoordinator:\n{coordinator_log.read_text()}"
    everything = "\n".join(outputs)
    # Rank 0 prints these once every rank's parameters were gathered and compared: one view of 4.
    assert re.search(r"final: train loss [\d.]+, test accuracy [\d.]+%", everything), everything
    assert f"all {scale} ranks hold identical parameters" in everything, everything
    assert coordinator.poll() is None, "the coordinator stopped while the workers trained"
