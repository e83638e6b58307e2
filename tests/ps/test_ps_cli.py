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
