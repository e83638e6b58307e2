"""Rank 0's request to admit the waiting workers at a commit outlives a coordinator that does not
answer for a while (it restarts, or stalls): every other rank has already decided that the world
changes at that commit and waits for the view the request makes, so rank 0 asks again, within
elastic_timeout_s, instead of dying of CoordinatorUnreachableError (issue 40)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from worlds import free_port

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent(
    """
    import sys, time
    import ringserve as rs
    from ringserve.elastic import state
    rs.init()
    view = rs.api.context().worker.view_id
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    try:
        state._admit([], view, retry=sys.argv[1] == "retry")
        print(f"admitted after {time.monotonic() - started:.2f} s", flush=True)
    except Exception as exc:
        print(f"raised {type(exc).__name__} after {time.monotonic() - started:.2f} s", flush=True)
    rs.shutdown()
    """
)


@pytest.mark.parametrize("retry", ["retry", "once"])
def test_the_request_to_admit_is_asked_again_until_a_stalled_coordinator_answers(retry: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "coordinator.log"
    with log.open("wb") as sink:  # its log, read by nobody: in a pipe it could fill and stop it
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "ringserve.cli", "coordinator", "--port", str(port), "--min-workers", "1",
             "--settle-seconds", "0.1", "--heartbeat-timeout", "30"],
            stdout=subprocess.PIPE, stderr=sink)
    env = {**os.environ, "RINGSERVE_COORDINATOR": f"127.0.0.1:{port}", "RINGSERVE_RPC_TIMEOUT_S": "0.5",
           "RINGSERVE_ELASTIC_TIMEOUT_S": "30", "PYTHONUNBUFFERED": "1"}
    worker = subprocess.Popen([sys.executable, "-c", SCRIPT, retry], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert coordinator.stdout is not None
        first = coordinator.stdout.readline().decode()
        assert "listening on" in first, first + log.read_text()[-3000:]
        assert worker.stdout is not None and worker.stdin is not None
        line = worker.stdout.readline()
        assert line.strip() == "ready", line + worker.stdout.read()
        coordinator.send_signal(signal.SIGSTOP)  # it answers nothing, as while it restarts
        worker.stdin.write("go\n")
        worker.stdin.flush()
        time.sleep(2.5)
        coordinator.send_signal(signal.SIGCONT)
        out, _ = worker.communicate(timeout=60)
    finally:
        for proc in (worker, coordinator):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait()
    if retry == "retry":
        assert "admitted after" in out, out[-3000:]
        assert float(out.split("admitted after ")[1].split()[0]) >= 2.0, out[-3000:]
        assert "asking again" in out
    else:
        assert "raised CoordinatorUnreachableError" in out, out[-3000:]
