"""`ringserve run`'s host rules without ssh: "localhost" and "127.0.0.1" are two hosts of this one
(each runs its workers without ssh), so blacklisting, discovery and bad host arguments can be
tested anywhere. The same rules over real ssh are in test_launcher_hosts.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

RINGSERVE = [sys.executable, "-m", "ringserve.cli"]
WORKERS = Path(__file__).parent / "workers"


def run(args: list[str], timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(RINGSERVE + args, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def timed_run(args: list[str], timeout: float) -> tuple[subprocess.CompletedProcess[str], float]:
    """Runs the launcher; also returns the seconds from its first note (the coordinator is up:
    Python's start-up, slow on a loaded machine, is behind it) to its exit."""
    proc = subprocess.Popen(RINGSERVE + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        up = time.monotonic()
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, first + out, err), time.monotonic() - up
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(90)
def test_a_failing_host_is_blacklisted_for_good_its_other_worker_leaves_and_the_other_host_finishes(
    tmp_path: Path,
) -> None:
    stop = tmp_path / "stop"
    err = tmp_path / "launcher.err"  # its log (its coordinator's too), read only on failure: a pipe could fill
    with err.open("w") as sink:
        launcher = subprocess.Popen(
            [*RINGSERVE, "run", "-np", "4", "--min-np", "2", "-H", "localhost:2,127.0.0.1:2", sys.executable, str(WORKERS / "elastic_train.py"), str(stop), "127.0.0.1"],
            stdout=subprocess.PIPE, stderr=sink, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout or []), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any("size=2" in line for line in lines[_blacklisted(lines):]) or not _blacklisted(lines):
            assert time.monotonic() < deadline and launcher.poll() is None, "".join(lines[-30:])
            time.sleep(0.05)
        stop.write_text("")
        assert launcher.wait(60) == 0, "".join(lines[-30:]) + err.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    reader.join(5)
    note = lines[_blacklisted(lines) - 1]
    assert "on 127.0.0.1 exited with code 3; host 127.0.0.1 is blacklisted for good, and its 1 other worker(s) " \
           "stopped; the others go on" in note, note
    assert any("on 127.0.0.1 left (exit code 0)" in line for line in lines), "".join(lines)
    done = [line for line in lines if "done step=" in line]
    assert len(done) == 2 and len({line.rsplit("sha=", 1)[1] for line in done}) == 1, done
    assert not any("starting" in line and "127.0.0.1" in line for line in lines[_blacklisted(lines):])


def _blacklisted(lines: list[str]) -> int:
    """The number of lines up to the blacklisting note (0 while there is none)."""
    for i, line in enumerate(lines):
        if "is blacklisted" in line:
            return i + 1
    return 0


@pytest.mark.timeout(60)
def test_a_discovery_script_that_fails_on_its_first_run_fails_the_launch_at_once(tmp_path: Path) -> None:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho 'no inventory' >&2\nexit 4\n")
    script.chmod(0o755)
    result, seconds = timed_run(["run", "-np", "2", "--host-discovery-script", str(script), sys.executable, "-c",
                                 "pass"], timeout=50)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"the host discovery script '{script}' exited with code 4: no inventory" in result.stderr
    assert seconds < 5, f"the launch took {seconds:.1f} s to fail"


@pytest.mark.timeout(60)
def test_too_few_discovered_slots_end_the_launch_after_the_elastic_timeout_naming_what_was_found() -> None:
    result, seconds = timed_run(["run", "-np", "2", "--elastic-timeout", "2", "--host-discovery-script",
                                 "echo localhost:1", sys.executable, "-c", "pass"], timeout=50)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "waited 2 s for 2 slots (-np); the hosts offer 1: {'localhost': 1}" in result.stderr
    assert 2 <= seconds < 8, f"the launch took {seconds:.1f} s to give up"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "said"), [
    (["-np", "5", "-H", "localhost:2,127.0.0.1:2"], "-np 5 asks for more processes than the hosts have slots (4: "),
    (["-np", "2", "-H", "localhost:two"], "The host 'localhost:two' in -H 'localhost:two' must have the form"),
    (["-np", "2", "--hostfile", "/nonexistent/hosts"], "The hostfile '/nonexistent/hosts' cannot be read"),
    (["-np", "2", "-H", "localhost:2", "--hostfile", "h"], "not allowed with argument"),
])
def test_bad_host_arguments_are_a_clear_error_before_anything_starts(args: list[str], said: str) -> None:
    result = run(["run", *args, sys.executable, "-c", "pass"], timeout=50)
    assert result.returncode == 2, result.stdout + result.stderr
    assert said in result.stderr
    assert "coordinator at" not in result.stdout


@pytest.mark.timeout(60)
def test_hosts_of_this_machine_run_without_ssh_each_its_own_local_ranks() -> None:
    script = "import ringserve as rs; rs.init(); print('places', rs.rank(), rs.local_rank(), rs.local_size(), rs.cross_rank()); rs.shutdown()"
    result = run(["run", "-np", "3", "-H", "localhost:2,127.0.0.1:1", sys.executable, "-c", script], timeout=50)
    assert result.returncode == 0, result.stdout + result.stderr
    places = sorted(line for line in result.stdout.splitlines() if "places" in line)
    assert places == ["[0] places 0 0 2 0", "[1] places 1 1 2 0", "[2] places 2 0 1 1"]
