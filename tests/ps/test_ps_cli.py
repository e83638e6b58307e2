"""`ringserve run --ps S` and `ringserve ps`: shard processes beside a coordinator and workers.

The launcher starts the coordinator, S shard processes and the workers; the workers find the
shards in the coordinator's directory. A shard process that dies is started again with its
index, and resumes from its checkpoint (RINGSERVE_CHECKPOINT_DIR) while the workers wait for it.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

RINGSERVE = [sys.executable, "-m", "ringserve.cli"]
WORKER = pathlib.Path(__file__).parent / "workers" / "ps_train.py"


def progress(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_ps_job(args: list[str], out: pathlib.Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([*RINGSERVE, "run", *args, sys.executable, str(WORKER), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RINGSERVE_USE_UVLOOP": "0", **(env or {})})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_with_ps_trains_n_workers_through_s_shard_processes(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "progress.jsonl"
    job = run_ps_job(["--ps", "2", "-np", "3", "--"], out)
    output, _ = job.communicate(timeout=100)
    lines = progress(out)
    assert job.returncode == 0, output
    assert "2 parameter-server shards at" in output
    finishers = {line["pid"] for line in lines if line["step"] == 19}   # ranks change as workers leave
    assert len(finishers) == 3, output
    losses = [line["loss"] for line in lines if line["pid"] == min(finishers)]
    assert losses[-1] < 0.2 * losses[0]


def _shard_pids(launcher: int) -> list[int]:
    """The launcher's shard processes (children of its own, by their command line)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == launcher and b"--one-shard" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_shard_process_is_started_again_and_resumes_from_its_checkpoint(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "progress.jsonl"
    env = {"RINGSERVE_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "RINGSERVE_CHECKPOINT_UPDATES": "5",
           "RINGSERVE_HEARTBEAT_TIMEOUT": "2"}
    job = run_ps_job(["--ps", "2", "-np", "2", "--heartbeat-timeout", "2", "--", ], out, env)
    try:
        deadline = time.monotonic() + 60
        while len(progress(out)) < 10 and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.1)
        pids = _shard_pids(job.pid)
        assert len(pids) == 2, pids
        os.kill(pids[0], signal.SIGKILL)
        output, _ = job.communicate(timeout=150)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, output
    assert "starting it again" in output and "resumed from" in output, output
    assert max(line["step"] for line in progress(out)) == 19


@pytest.mark.timeout(120)
def test_a_shard_down_for_good_ends_the_run_instead_of_leaving_its_workers_waiting(tmp_path: pathlib.Path) -> None:
    # With its restarts spent (--max-restarts 1), the shard stays down: the run must end with exit
    # code 1 saying so. It used to go on, the workers failing after shard_wait_s and being started
    # again into the same wait, for ever (found by the chaos campaign's parameter-server job).
    out = tmp_path / "progress.jsonl"
    job = subprocess.Popen([*RINGSERVE, "run", "--ps", "1", "-np", "2", "--restart-failed", "--max-restarts", "1",
                            "--", sys.executable, str(WORKER), "--steps", "0", "--sleep", "0.05", "--out", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "RINGSERVE_USE_UVLOOP": "0"})
    try:
        deadline = time.monotonic() + 60
        while len(progress(out)) < 4 and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.1)
        killed: set[int] = set()
        for _ in range(2):  # the first kill is restarted, the second spends the budget
            while not (pids := [p for p in _shard_pids(job.pid) if p not in killed]) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pids, "no shard process to kill"
            os.kill(pids[0], signal.SIGKILL)
            killed.add(pids[0])
        output, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 1, output[-3000:]
    assert "the 1 restarts allowed are spent" in output, output[-3000:]
