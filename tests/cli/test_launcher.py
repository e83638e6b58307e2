"""`ringserve run`: a real coordinator and real worker processes on loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

RINGSERVE = [sys.executable, "-m", "ringserve.cli"]

ALLREDUCE_SCRIPT = """
import numpy as np, ringserve as rs
rs.init()
out = rs.allreduce(np.array([float(rs.rank())]), op="sum", name="t")
print(f"rank={rs.rank()} size={rs.size()} local={rs.local_rank()}/{rs.local_size()} sum={out[0]:g}")
rs.shutdown()
"""


def run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(RINGSERVE + args, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(90)
def test_run_starts_n_workers_that_form_one_world_with_ranks_in_process_order() -> None:
    result = run(["run", "-np", "3", sys.executable, "-c", ALLREDUCE_SCRIPT], timeout=80)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if "rank=" in line)
    assert lines == [f"[{i}] rank={i} size=3 local={i}/3 sum=3" for i in range(3)]


@pytest.mark.timeout(90)
def test_a_failing_rank_stops_the_others_and_is_named_in_the_exit() -> None:
    script = (
        "import sys, time, ringserve as rs\n"
        "rs.init()\n"
        "print('ready', flush=True)\n"
        "if rs.rank() == 1: sys.exit(7)\n"
        "time.sleep(120)\n"
    )
    started = time.monotonic()
    result = run(["run", "-np", "3", sys.executable, "-c", script], timeout=80)
    elapsed = time.monotonic() - started
    assert result.returncode == 7
    assert "rank 1 exited with code 7" in result.stderr
    assert elapsed < 40, f"the sleeping ranks were not stopped ({elapsed:.1f} s)"


@pytest.mark.timeout(60)
def test_progress_bar_redraws_keep_their_rank_prefix() -> None:
    script = "import sys\nfor i in range(3): sys.stdout.write(f'\\rstep {i}')\nprint()\n"
    result = subprocess.run([*RINGSERVE, "run", "-np", "2", sys.executable, "-c", script],
                            capture_output=True, timeout=50)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        for step in range(2):
            assert f"[{rank}] step {step}\r".encode() in result.stdout, result.stdout


def test_run_without_a_command_is_a_clear_error() -> None:
    result = run(["run", "-np", "2"], timeout=30)
    assert result.returncode != 0
    assert "needs a command" in result.stderr


@pytest.mark.timeout(60)
def test_sigterm_to_the_launcher_stops_its_workers_too() -> None:
    import os
    import signal

    script = "import time, ringserve as rs\nrs.init()\nprint('up', flush=True)\ntime.sleep(120)\n"
    launcher = subprocess.Popen([*RINGSERVE, "run", "-np", "2", sys.executable, "-c", script],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert launcher.stdout is not None
        assert "coordinator at" in launcher.stdout.readline()
        lines = [launcher.stdout.readline() for _ in range(2)]
        assert all("up" in line for line in lines), lines
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        assert len(children) == 2
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(30)
        deadline = time.monotonic() + 10
        alive = children
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in children if os.path.exists(f"/proc/{pid}") and
                     Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]
            time.sleep(0.1)
        assert not alive, f"workers {alive} outlived the launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.timeout(90)
def test_a_worker_that_lost_the_state_is_not_restarted_and_ends_the_run_with_its_code() -> None:
    # Exit 65 is what an uncaught StateLostError becomes (ringserve.elastic.run).
    script = "import os, sys, time\nif os.environ['RINGSERVE_RANK_HINT'] == '0': sys.exit(65)\ntime.sleep(120)\n"
    started = time.monotonic()
    result = run(["run", "-np", "2", "--min-np", "1", "--restart-failed", sys.executable, "-c", script], timeout=80)
    assert result.returncode == 65, result.stdout + result.stderr
    assert "worker 0 lost the job's committed state" in result.stdout
    assert "starting it again" not in result.stdout
    assert "rank 0 exited with code 65 (StateLostError" in result.stderr
    assert time.monotonic() - started < 40


@pytest.mark.timeout(90)
def test_a_worker_that_finds_the_state_gone_after_training_finished_ends_nothing() -> None:
    """A restarted worker that comes too late, after the others finished and left with the state,
    exits 65 (StateLostError): it took no part, so the run ends as the finished worker did."""
    script = ("import os, sys, time\nif os.environ['RINGSERVE_RANK_HINT'] == '0': sys.exit(0)\n"
              "time.sleep(1.0)\nsys.exit(65)\n")
    result = run(["run", "-np", "2", "--min-np", "1", "--restart-failed", sys.executable, "-c", script], timeout=80)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "worker 1 found the job's state gone after training finished" in result.stdout
    assert "starting it again" not in result.stdout
