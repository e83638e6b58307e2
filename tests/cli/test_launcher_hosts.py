"""`ringserve run` over several hosts, as horovodrun runs: real sshd servers in network namespaces.

The hosts are namespaces the test makes (see sshnet): the launcher runs in one, and each of
host-a and host-b has an sshd of its own; host-c has none, and host-d swallows every packet.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import sshnet

pytestmark = pytest.mark.skipif(not sshnet.HAVE_ROOT, reason=sshnet.NO_ROOT)

WORKERS = Path(__file__).parent / "workers"
STEPS = 12


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sshnet.Cluster]:
    yield from sshnet.make_cluster(tmp_path_factory.mktemp("sshnet"))


@pytest.fixture
def script(tmp_path: Path) -> Path:
    """The training script, copied to a path of this test's own, which finds its processes."""
    copy = tmp_path / "hosts_train.py"
    copy.write_text((WORKERS / "hosts_train.py").read_text())
    return copy


def reports(stdout: str) -> dict[int, dict[str, object]]:
    """Each worker's JSON line, by the rank in its output prefix."""
    found = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition("] ")
        if prefix.startswith("[") and rest.startswith("{"):
            found[int(prefix[1:])] = json.loads(rest)
    return found


def reference_weights(world: int) -> list[float]:
    """The same training in one process: every step takes the mean of the ranks' gradients."""
    sys.path.insert(0, str(WORKERS))
    try:
        from hosts_train import DIM, gradient
    finally:
        sys.path.pop(0)
    w = np.zeros(DIM)
    for step in range(STEPS):
        w = w - 0.05 * np.mean([gradient(w, r, step) for r in range(world)], axis=0)
    return list(w)


def wait_gone(marker: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := sshnet.processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.timeout(90)
def test_two_hosts_of_two_slots_train_to_identical_parameters_with_horovods_ranks_and_the_env_forwarded(
    cluster: sshnet.Cluster, script: Path, tmp_path: Path
) -> None:
    result = cluster.run(["run", "-np", "4", "-H", "host-a:2,host-b:2", *cluster.ssh_flags(),
                          sys.executable, str(script), str(STEPS)],
                         timeout=80, cwd=tmp_path, env={"RS_TEST_FORWARDED": "it came along"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = reports(result.stdout)
    assert sorted(got) == [0, 1, 2, 3], result.stdout
    places = {r: (g["rank"], g["host"], g["local"], g["cross"]) for r, g in got.items()}
    assert places == {
        0: (0, "host-a", [0, 2], [0, 2]), 1: (1, "host-a", [1, 2], [0, 2]),
        2: (2, "host-b", [0, 2], [1, 2]), 3: (3, "host-b", [1, 2], [1, 2]),
    }
    for r, g in got.items():
        host = "host-a" if r < 2 else "host-b"
        assert g["horovod"] == {
            "HOROVOD_RANK": str(r), "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": str(r % 2),
            "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": str(r // 2), "HOROVOD_CROSS_SIZE": "2",
            "HOROVOD_HOSTNAME": host,
        }
        assert g["forwarded"] == "it came along"
        assert g["cwd"] == str(tmp_path)
    weights = [g["w"] for g in got.values()]
    assert all(w == weights[0] for w in weights), "the ranks' parameters differ"
    np.testing.assert_allclose(weights[0], reference_weights(4), rtol=1e-10)
    assert wait_gone(str(script), 10) == []


@pytest.mark.timeout(90)
def test_with_a_pinned_payload_port_each_worker_of_a_host_gets_its_own_and_every_edge_has_its_lane(
    cluster: sshnet.Cluster, script: Path, tmp_path: Path
) -> None:
    # Shared memory off (the namespaces share one kernel), the lane required: a worker whose lane
    # could not bind or attach would fail the run with PayloadLaneError.
    env = {"RINGSERVE_SHARED_MEMORY": "0", "RINGSERVE_PAYLOAD_LANE": "tcp", "RINGSERVE_PAYLOAD_PORT": "45000"}
    result = cluster.run(["run", "-np", "4", "-H", "host-a:2,host-b:2", *cluster.ssh_flags(),
                          sys.executable, str(script), str(STEPS)], timeout=80, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = reports(result.stdout)
    assert {r: g["payload_port"] for r, g in got.items()} == {0: "45000", 1: "45001", 2: "45000", 3: "45001"}
    assert all(g["lane_bytes"] > 0 for g in got.values())
    weights = [g["w"] for g in got.values()]
    assert all(w == weights[0] for w in weights)
    np.testing.assert_allclose(weights[0], reference_weights(4), rtol=1e-10)


@pytest.mark.timeout(90)
def test_a_hostfile_mixing_this_host_and_a_remote_one_runs_the_local_slot_without_ssh(
    cluster: sshnet.Cluster, script: Path, tmp_path: Path
) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the launching host first\nlocalhost slots=1\nhost-a slots=2  # two workers\n")
    result = cluster.run(["run", "-np", "3", "--hostfile", str(hostfile), "--verbose", *cluster.ssh_flags(),
                          sys.executable, str(script), str(STEPS)], timeout=80, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = reports(result.stdout)
    assert {r: (g["host"], g["local"]) for r, g in got.items()} == {
        0: ("localhost", [0, 1]), 1: ("host-a", [0, 2]), 2: ("host-a", [1, 2]),
    }
    weights = [g["w"] for g in got.values()]
    assert all(w == weights[0] for w in weights)
    np.testing.assert_allclose(weights[0], reference_weights(3), rtol=1e-10)
    ssh_notes = [line for line in result.stdout.splitlines() if line.startswith("ringserve run: rank") and "ssh " in line]
    assert [line.split(":")[1].strip() for line in ssh_notes] == ["rank 1 on host-a", "rank 2 on host-a"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("hosts", "extra", "said", "bound_s"), [
    ("host-a:2,host-c:1", [], "Connection refused", 8.0),
    # A short start timeout would fail host-a too on a loaded machine (its wrapper's Python may
    # take seconds to start): this host's own slot waits without one.
    ("localhost:2,host-d:1", ["--start-timeout", "3"], "timed out", 3.0 + 8.0),
])
def test_a_host_ssh_cannot_reach_fails_the_run_naming_it_within_a_bound(
    cluster: sshnet.Cluster, script: Path, tmp_path: Path, hosts: str, extra: list[str], said: str, bound_s: float
) -> None:
    host = hosts.rsplit(",", 1)[1].split(":", maxsplit=1)[0]
    result, elapsed = cluster.timed_run(["run", "-np", "3", "-H", hosts, *extra, *cluster.ssh_flags(),
                                         sys.executable, str(script), str(STEPS)], timeout=50, cwd=tmp_path)
    assert result.returncode == 255, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"rank 2 on {host}: ssh to {host} " in result.stderr, result.stderr
    # ssh's connect timeout speaks first; on a loaded machine the launcher's start timeout may.
    assert said in result.stderr or "did not start the worker within 3 s" in result.stderr, result.stderr
    assert elapsed < bound_s, f"the failure took {elapsed:.1f} s"
    assert wait_gone(str(script), 10) == [], "the other workers outlived the failed run"


def start_sleeping(cluster: sshnet.Cluster, script: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], dict[int, int]]:
    launcher = cluster.launcher(["run", "-np", "4", "-H", "host-a:2,host-b:2", *cluster.ssh_flags(),
                                 sys.executable, str(script), str(STEPS), "sleep"], cwd=tmp_path)
    assert launcher.stdout is not None
    pids: dict[int, int] = {}
    deadline = time.monotonic() + 60
    while len(pids) < 4:
        assert time.monotonic() < deadline, f"the workers did not all start: {pids}"
        line = launcher.stdout.readline().decode()
        assert line, launcher.stderr.read().decode() if launcher.stderr else ""
        if "pid=" in line:
            pid, rank = (int(field.split("=")[1]) for field in line.split("] ", 1)[1].split())
            pids[rank] = pid
    return launcher, pids


@pytest.mark.timeout(90)
def test_a_worker_killed_on_a_remote_host_stops_the_run_naming_host_and_rank_and_leaves_no_process(
    cluster: sshnet.Cluster, script: Path, tmp_path: Path
) -> None:
    launcher, pids = start_sleeping(cluster, script, tmp_path)
    try:
        os.kill(pids[3], signal.SIGKILL)
        started = time.monotonic()
        _, err = launcher.communicate(timeout=40)
        elapsed = time.monotonic() - started
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 137, err
    assert "rank 3 on host-b was killed by SIGKILL (exit code 137); the other ranks were stopped." in err.decode()
    assert elapsed < 15, f"the run took {elapsed:.1f} s to stop"
    assert wait_gone(str(script), 10) == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_a_launcher_stopped_by_ctrl_c_or_killed_leaves_no_worker_on_any_host(
    cluster: sshnet.Cluster, script: Path, tmp_path: Path, how: str
) -> None:
    launcher, pids = start_sleeping(cluster, script, tmp_path)
    launcher.send_signal(getattr(signal, how))
    launcher.wait(30)
    # SIGKILL gives the launcher no chance to clean up: the remote wrappers see their ssh
    # session end and stop their workers themselves.
    left = wait_gone(str(script), 15)
    assert left == [], f"workers {left} outlived the launcher ({how}); the ranks' pids were {pids}"
    if how == "SIGINT":
        assert launcher.returncode == 130


class Watched:
    """A launcher whose output lines are collected by a thread as they come."""

    def __init__(self, launcher: subprocess.Popen[bytes]) -> None:
        self.launcher = launcher
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        # Its stderr (its coordinator's log) is drained too: a pipe read only at the end could fill.
        self._err: list[bytes] = []
        self._err_thread = threading.Thread(target=lambda: self._err.extend(launcher.stderr or []), daemon=True)
        self._err_thread.start()

    def _read(self) -> None:
        assert self.launcher.stdout is not None
        for raw in self.launcher.stdout:
            self.lines.append(raw.decode(errors="replace"))

    def wait_for(self, text: str, after: int = 0, seconds: float = 60) -> int:
        """Waits for a line holding ``text`` after the first ``after`` lines; returns the number of
        lines up to and including it (where the next wait starts)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for i, line in enumerate(self.lines[after:], after):
                if text in line:
                    return i + 1
            assert self.launcher.poll() is None or self._thread.is_alive(), "".join(self.lines[-40:])
            time.sleep(0.05)
        raise AssertionError(f"no line with {text!r} in {seconds} s:\n" + self.digest())

    def digest(self) -> str:
        """The launcher's own notes and the last lines, for a failure's message."""
        notes = [line for line in self.lines if line.startswith("ringserve run:") or "] ringserve" in line]
        return "".join(notes[-30:]) + "...\n" + "".join(self.lines[-15:])

    def finish(self, seconds: float) -> tuple[int, str]:
        try:
            self.launcher.wait(seconds)
        finally:
            if self.launcher.poll() is None:
                self.launcher.kill()
                self.launcher.wait()
        self._thread.join(5)
        self._err_thread.join(5)
        return self.launcher.returncode, b"".join(self._err).decode(errors="replace")


def digests(lines: list[str]) -> set[str]:
    return {line.rsplit("sha=", 1)[1].strip() for line in lines if "done step=" in line}


@pytest.mark.timeout(120)
def test_the_discovery_script_adds_a_host_whose_workers_join_and_removes_it_whose_workers_leave(
    cluster: sshnet.Cluster, tmp_path: Path
) -> None:
    discovered = tmp_path / "hosts.txt"
    discovered.write_text("host-a:2\n")
    stop = tmp_path / "stop"
    script = tmp_path / "elastic_train.py"
    script.write_text((WORKERS / "elastic_train.py").read_text())
    run = Watched(cluster.launcher(
        ["run", "-np", "2", "--min-np", "2", "--max-np", "4", "--host-discovery-script", f"cat {discovered}",
         *cluster.ssh_flags(), sys.executable, str(script), str(stop)], cwd=tmp_path))
    seen = run.wait_for("size=2")
    discovered.write_text("host-a:2\nhost-b:2\n")
    seen = run.wait_for("starting 2 worker(s) on host-b; they join at the next commit", seen)
    seen = run.wait_for("size=4", seen)
    discovered.write_text("host-a:2\n")
    seen = run.wait_for("host host-b lost 2 slot(s); stopping 2 worker(s) there", seen)
    for index in (2, 3):
        run.wait_for(f"worker {index} on host-b left (exit code 0)", seen)
    seen = run.wait_for("size=2", seen)
    stop.write_text("")
    code, err = run.finish(60)
    assert code == 0, err[-3000:] + "".join(run.lines[-40:])
    done = [line for line in run.lines if "done step=" in line]
    assert len(done) == 2 and len(digests(run.lines)) == 1, done  # host-a's two, in agreement
    # Host-b's two left at one commit, in one view: host-a's never restored (they did, when each
    # leaver made a view of its own and the survivors synced in the one still holding the other).
    restored = [line for line in run.lines if "restoring the last commit" in line]
    assert not restored, restored
    assert wait_gone(str(script), 10) == []


@pytest.mark.timeout(120)
def test_a_failing_host_is_blacklisted_its_other_worker_stopped_and_after_its_cooldown_it_is_used_again(
    cluster: sshnet.Cluster, tmp_path: Path
) -> None:
    discovered = tmp_path / "hosts.txt"
    discovered.write_text("host-a:2\nhost-b:2\n")
    stop = tmp_path / "stop"
    script = tmp_path / "elastic_train.py"
    script.write_text((WORKERS / "elastic_train.py").read_text())
    run = Watched(cluster.launcher(
        ["run", "-np", "4", "--min-np", "2", "--host-discovery-script", f"cat {discovered}",
         "--blacklist-cooldown-range", "1", "2", *cluster.ssh_flags(), sys.executable, str(script), str(stop),
         "host-b"], cwd=tmp_path))
    seen = run.wait_for("failing on purpose")
    seen = run.wait_for("on host-b exited with code 3; host host-b is blacklisted for ", seen)
    assert "s, and its 1 other worker(s) stopped; the others go on" in run.lines[seen - 1], run.lines[seen - 1]
    seen = run.wait_for("size=2", seen)
    seen = run.wait_for("starting 2 worker(s) on host-b; they join at the next commit", seen, seconds=30)
    seen = run.wait_for("size=4", seen)
    stop.write_text("")
    code, err = run.finish(60)
    assert code == 0, err[-3000:] + "".join(run.lines[-40:])
    done = [line for line in run.lines if "done step=" in line]
    assert len(done) == 4 and len(digests(run.lines)) == 1, done
    assert wait_gone(str(script), 10) == []
