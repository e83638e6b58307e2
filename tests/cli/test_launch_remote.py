"""The remote wrapper (launch.remote) on its own: run here as ssh would run it, its stdin a pipe.

What it must do whatever happens to the launcher: stop its worker when the session ends (stdin
closed), when the launcher's pings stop, or when the wrapper itself is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringserve.launch.remote import MARK

SOURCE = (Path(__file__).resolve().parents[2] / "ringserve" / "launch" / "remote.py").read_text()
SLEEPER = "import os, sys, time; print('up', os.environ['RINGSERVE_COORDINATOR'], os.getcwd(), flush=True); time.sleep(60)"


def wrapper(job: dict[str, object], ssh_connection: str = "10.1.2.3 50000 10.1.2.4 22") -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", SOURCE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "SSH_CONNECTION": ssh_connection})
    assert proc.stdin is not None
    full = {"env": {}, "cwd": "/", "coordinator_port": 4321, "coordinator_host": "", "grace_s": 2.0,
            "ping_timeout_s": 30.0, **job}
    proc.stdin.write((json.dumps(full) + "\n").encode())
    proc.stdin.flush()
    return proc


def protocol(proc: subprocess.Popen[bytes]) -> dict[str, str]:
    """Reads the wrapper's stderr up to its 'started' line; the line's fields."""
    assert proc.stderr is not None
    while True:
        line = proc.stderr.readline().decode()
        assert line, "the wrapper ended before its worker started"
        if line.startswith(MARK + "started"):
            return dict(w.split("=", 1) for w in line.split()[2:])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


@pytest.mark.timeout(30)
def test_the_worker_dials_the_coordinator_at_the_address_the_ssh_connection_came_from(tmp_path: Path) -> None:
    proc = wrapper({"argv": [sys.executable, "-c", SLEEPER], "cwd": str(tmp_path)})
    fields = protocol(proc)
    assert fields["client"] == "10.1.2.3"
    assert proc.stdout is not None
    assert proc.stdout.readline().decode().split() == ["up", "10.1.2.3:4321", str(tmp_path)]
    proc.kill()
    assert gone_within(int(fields["pid"]), 5)


@pytest.mark.timeout(30)
def test_a_named_coordinator_host_wins_and_an_ipv6_client_is_bracketed() -> None:
    for host, connection, expected in (("10.9.9.9", "10.1.2.3 5 10.1.2.4 22", "10.9.9.9:4321"),
                                       ("", "fd00::1 5 fd00::2 22", "[fd00::1]:4321")):
        proc = wrapper({"argv": [sys.executable, "-c", SLEEPER], "coordinator_host": host}, connection)
        fields = protocol(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().decode().split()[1] == expected
        proc.kill()
        assert gone_within(int(fields["pid"]), 5)


@pytest.mark.timeout(30)
def test_the_end_of_the_session_stops_the_worker_with_sigterm_and_reports_it() -> None:
    proc = wrapper({"argv": [sys.executable, "-c", SLEEPER]})
    pid = int(protocol(proc)["pid"])
    assert proc.stdin is not None
    proc.stdin.close()  # what the launcher's death, or ssh's, looks like from here
    assert gone_within(pid, 5)
    assert proc.wait(5) == 128 + signal.SIGTERM
    assert proc.stderr is not None
    assert f"{MARK}signal {int(signal.SIGTERM)}" in proc.stderr.read().decode()


@pytest.mark.timeout(30)
def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    proc = wrapper({"argv": [sys.executable, "-c", stubborn], "grace_s": 0.5})
    pid = int(protocol(proc)["pid"])
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"  # SIGTERM is ignored from here on
    started = time.monotonic()
    assert proc.stdin is not None
    proc.stdin.close()
    assert gone_within(pid, 5)
    assert 0.4 < time.monotonic() - started < 4
    assert proc.wait(5) == 128 + signal.SIGKILL


@pytest.mark.timeout(30)
def test_when_the_launchers_pings_stop_the_worker_is_stopped() -> None:
    proc = wrapper({"argv": [sys.executable, "-c", SLEEPER], "ping_timeout_s": 1.0})
    pid = int(protocol(proc)["pid"])
    assert proc.stdin is not None
    for _ in range(4):  # pings keep it going past the timeout
        time.sleep(0.5)
        proc.stdin.write(b"ping\n")
        proc.stdin.flush()
    assert alive(pid)
    assert gone_within(pid, 5)  # then silence, with the connection still open
    assert proc.wait(5) == 128 + signal.SIGTERM
    proc.stdin.close()


@pytest.mark.timeout(30)
def test_term_sends_sigterm_only_and_the_workers_own_exit_code_comes_back() -> None:
    graceful = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                "print('up', flush=True)\ntime.sleep(60)\n")
    proc = wrapper({"argv": [sys.executable, "-c", graceful]})
    protocol(proc)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    assert proc.stdin is not None
    proc.stdin.write(b"term\n")
    proc.stdin.flush()
    assert proc.wait(10) == 0
    assert proc.stderr is not None
    assert f"{MARK}exit 0" in proc.stderr.read().decode()


@pytest.mark.timeout(30)
def test_a_killed_wrapper_takes_its_worker_with_it() -> None:
    proc = wrapper({"argv": [sys.executable, "-c", SLEEPER]})
    pid = int(protocol(proc)["pid"])
    proc.kill()
    proc.wait(5)
    assert gone_within(pid, 5), "the worker outlived its wrapper"


@pytest.mark.timeout(30)
def test_a_command_that_does_not_exist_exits_127_saying_so() -> None:
    proc = wrapper({"argv": ["/nonexistent/python", "train.py"]})
    assert proc.wait(10) == 127
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    assert "cannot start '/nonexistent/python'" in err and f"{MARK}exit 127" in err
