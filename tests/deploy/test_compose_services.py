"""The compose services' own commands and environment, run as local processes, train the elastic demo.

What Docker would do for ``docker compose up --scale worker=N`` is done here by hand: the file is
interpolated (with a free port for RINGSERVE_PORT), each container's environment is the image's
ENV plus the service's ``environment``, the service name ``coordinator`` resolves to 127.0.0.1, the
coordinator's own health-check command is retried as compose retries it, and only then do the N
workers start (``depends_on: service_healthy``), in the image's WORKDIR (the repository root
here, since the Dockerfile copies the repository's files there). Each named volume is a directory
of the test's, and 0.0.0.0 is loopback: nothing listens beyond this machine.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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


def container_env(service: Mapping[str, object], names: list[str], volumes: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}
    env.update(dockerfile().env)
    env.update({k: mounted(service, resolve_service_names(v, names), volumes) for k, v in environment(service).items()})
    # A container's every interface is, here, this machine's loopback: nothing binds beyond it.
    return {k: LOOPBACK if v == "0.0.0.0" else v for k, v in env.items()}


def mounted(service: Mapping[str, object], value: str, volumes: Path) -> str:
    """What a path in a container's volume is here: the named volume is a directory under
    ``volumes``, one for every service that mounts it (as on one host)."""
    for mount in service.get("volumes", []) or []:  # type: ignore[attr-defined]
        name, target = str(mount).split(":")[:2]
        if value == target or value.startswith(target + "/"):
            (volumes / name).mkdir(parents=True, exist_ok=True)
            return str(volumes / name) + value[len(target):]
    return value


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


@dataclass
class Up:
    """The coordinator service running and healthy, with what its workers need."""

    coordinator: subprocess.Popen[str]
    coordinator_log: Path
    worker_argv: list[str]
    worker_env: dict[str, str]
    epochs: int

    def start_worker(self, log: Path) -> subprocess.Popen[str]:
        with log.open("w") as out:
            return subprocess.Popen(self.worker_argv, env=self.worker_env, cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)


def up(processes: list[subprocess.Popen[str]], tmp_path: Path, shell: Mapping[str, str]) -> Up:
    """What ``docker compose up`` does before it starts the workers, with ``shell``'s settings."""
    compose = load({"RINGSERVE_PORT": str(free_port()), **shell})
    services = compose["services"]
    names = list(services)
    coordinator_service, worker_service = services["coordinator"], services["worker"]

    # Short, as a container's /run/... is: a Unix socket's path in the rings' volume holds 107 bytes.
    volumes = Path(tempfile.mkdtemp(prefix="rsv-"))
    atexit.register(shutil.rmtree, volumes, True)
    coordinator_env = container_env(coordinator_service, names, volumes)
    coordinator_log = tmp_path / "coordinator.log"
    coordinator_argv = [mounted(coordinator_service, arg, volumes) for arg in command(coordinator_service["command"])]
    with coordinator_log.open("w") as log_file:
        coordinator = subprocess.Popen(
            local_argv(coordinator_argv), env=coordinator_env, cwd=ROOT,
            stdout=log_file, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    processes.append(coordinator)
    wait_until_healthy(coordinator_service, coordinator_env, names, coordinator)

    # The workers' shared volume (a tmpfs on one host) and the token's: a directory each here.
    worker_env = container_env(worker_service, names, volumes)
    assert worker_env.get("RINGSERVE_SHARED_DIR") == str(volumes / "rings")
    assert worker_env.get("RINGSERVE_TOKEN_FILE", "").startswith(str(volumes / "token"))
    assert worker_env["RINGSERVE_COORDINATOR"] == f"{LOOPBACK}:{coordinator_env['RINGSERVE_PORT']}"
    argv = command(worker_service["command"])
    return Up(coordinator, coordinator_log, local_argv(argv), worker_env, int(argv[argv.index("--epochs") + 1]))


def final_hashes(output: str, size: int) -> set[str]:
    """The parameter hashes that ranks of a world of ``size`` printed at the end."""
    return set(re.findall(rf"^rank \d+ of {size}: parameters sha256 ([0-9a-f]{{64}})$", output, flags=re.M))


def wait_for(pattern: str, logs: list[Path], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for log in logs:
            found = re.search(pattern, log.read_text(), flags=re.M)
            if found:
                return found.group(0)
        time.sleep(0.2)
    pytest.fail(f"no worker printed {pattern!r} within {timeout_s} s:\n" + "\n".join(log.read_text()[-2000:] for log in logs))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scale", [2, 4])
def test_scale_worker_n_trains_the_elastic_demo_to_completion_with_n_identical_replicas(
    processes: list[subprocess.Popen[str]], scale: int, tmp_path: Path,
) -> None:
    started = up(processes, tmp_path, {})
    logs = [tmp_path / f"worker-{i}.log" for i in range(scale)]
    workers = [started.start_worker(log) for log in logs]
    processes.extend(workers)
    for i, w in enumerate(workers):
        code = w.wait(200)
        assert code == 0, f"worker {i} exited with {code}:\n{logs[i].read_text()}\ncoordinator:\n{started.coordinator_log.read_text()}"
    everything = "\n".join(log.read_text() for log in logs)
    # Rank 0 prints these once the last epoch is committed and every rank's parameters were
    # gathered and compared (late replicas join at a commit, so the last world holds all N).
    epochs = started.epochs
    assert re.search(rf"epoch {epochs}/{epochs} on {scale} workers: .* test accuracy [\d.]+%", everything), everything
    assert f"all {scale} ranks hold identical parameters" in everything, everything
    assert len(final_hashes(everything, scale)) == 1, everything
    assert started.coordinator.poll() is None, "the coordinator stopped while the workers trained"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_replica_added_while_the_demo_trains_joins_at_a_commit_and_one_stopped_leaves_at_one(
    processes: list[subprocess.Popen[str]], tmp_path: Path,
) -> None:
    """``--scale worker=3`` on a running world of 2, then ``docker stop`` (SIGTERM) of a first one."""
    started = up(processes, tmp_path, {"DEMO_EPOCHS": "200"})
    logs = [tmp_path / f"worker-{i}.log" for i in range(3)]
    workers = [started.start_worker(log) for log in logs[:2]]
    processes.extend(workers)
    wait_for(r"^epoch 1/200 on 2 workers", logs[:2], 120)
    workers.append(started.start_worker(logs[2]))
    processes.append(workers[2])
    joined = wait_for(r"^training on 3 workers from commit (\d+)", logs, 120)
    assert int(joined.split()[-1]) > 0, joined
    wait_for(r"^epoch \d+/200 on 3 workers", logs, 120)
    workers[1].send_signal(signal.SIGTERM)
    assert workers[1].wait(30) == 0, logs[1].read_text()
    assert "leaving the world after a commit, as SIGTERM asked" in logs[1].read_text()
    wait_for(r"^training on 2 workers from commit [1-9]", [logs[0], logs[2]], 60)
    for i in (0, 2):
        assert workers[i].wait(240) == 0, logs[i].read_text()
    everything = logs[0].read_text() + logs[2].read_text()
    assert "epoch 200/200 on 2 workers" in everything, everything
    assert len(final_hashes(everything, 2)) == 1 and "all 2 ranks hold identical parameters" in everything, everything


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_ps_profile_trains_the_parameter_server_demo_through_its_shards(
    processes: list[subprocess.Popen[str]], tmp_path: Path,
) -> None:
    """``docker compose --profile ps up --scale worker=2 --scale ps=2``: the ps service's command as
    two shard processes (each on a port of its own here; containers would share one number), then
    the workers, which find the shards in the coordinator's directory and run the ps demo."""
    started = up(processes, tmp_path, {"DEMO_EPOCHS": "3"})
    compose = load({"RINGSERVE_PORT": started.worker_env["RINGSERVE_COORDINATOR"].rsplit(":", 1)[1]})
    ps_service = compose["services"]["ps"]
    names = list(compose["services"])
    shard_logs = [tmp_path / f"ps-{i}.log" for i in range(2)]
    for log in shard_logs:
        env = {**container_env(ps_service, names), "RINGSERVE_BIND_PORT": str(free_port()),
               "RINGSERVE_CHECKPOINT_DIR": str(tmp_path / "ps-checkpoints")}
        with log.open("w") as out:
            processes.append(subprocess.Popen(local_argv(command(ps_service["command"])), env=env, cwd=ROOT,
                                              stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True))
    wait_for(r"shard 1 of 2 serving", shard_logs, 60)
    logs = [tmp_path / f"worker-{i}.log" for i in range(2)]
    workers = [started.start_worker(log) for log in logs]
    processes.extend(workers)
    for i, w in enumerate(workers):
        assert w.wait(240) == 0, logs[i].read_text()
    everything = "\n".join(log.read_text() for log in logs)
    accuracies = re.findall(r"^rank \d: test accuracy ([\d.]+)% after \d+ steps \(ssp mode", everything, flags=re.M)
    assert len(accuracies) == 2 and all(float(a) > 50 for a in accuracies), everything
