"""Real worlds for the torch binding: a coordinator in this process, N worker processes.

``run_world(script, n, *args)`` starts a ``ringserve.Coordinator`` on a background loop thread,
then ``n`` real Python processes of ``script`` with RINGSERVE_COORDINATOR and RINGSERVE_RANK_HINT
set, waits for them under a deadline, and returns their outputs. A worker script writes what the
test checks under the directory given as its first argument.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from ringserve import Coordinator, CoordinatorConfig
from ringserve.loop import LoopThread

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parents[2]

# The devices the worlds that take one run their tensors on: the GPU too where torch sees one (a
# worker reads RINGSERVE_TEST_DEVICE). On a machine without one, the tests run on the CPU alone.
DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def device_env(device: str) -> dict[str, str]:
    """The environment that puts a world's tensors on ``device``."""
    return {"RINGSERVE_TEST_DEVICE": device}

# Short deadlines: a broken world fails the test in seconds, not in the default minutes.
WORKER_ENV = {
    "RINGSERVE_COLLECTIVE_TIMEOUT_S": "60",
    "RINGSERVE_RENDEZVOUS_TIMEOUT_S": "60",
    "RINGSERVE_ABORT_GRACE_S": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class Run:
    """What a world of worker processes left behind."""

    out_dir: Path
    outputs: list[str]


def _start_coordinator(n: int) -> tuple[LoopThread, Coordinator]:
    thread = LoopThread(use_uvloop=False, name="test-coordinator")
    config = CoordinatorConfig(min_workers=n, max_workers=n, settle_s=0.1, tick_s=0.02,
                               heartbeat_interval_s=0.5, heartbeat_timeout_s=10.0)
    try:
        coordinator = thread.run(Coordinator(config).start(), 10.0)
    except BaseException:
        thread.stop()
        raise
    return thread, coordinator


def _output(sink: IO[bytes]) -> str:
    """What a process wrote to its file ``sink``, its newlines as a text-mode pipe gives them."""
    sink.seek(0)
    return sink.read().decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def run_world(script: Path, n: int, out_dir: Path, args: Sequence[str] = (), *,
              timeout_s: float = 90.0, env: dict[str, str] | None = None) -> Run:
    """Runs ``n`` processes of ``script out_dir *args`` against a fresh coordinator.

    Raises:
        AssertionError: a process failed or ran past ``timeout_s``; its output is in the message.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    thread, coordinator = _start_coordinator(n)
    procs: list[subprocess.Popen[bytes]] = []
    # Each process's output goes to a file: a pipe of one is read only once those before it have
    # ended, and a rank blocked on a full pipe (64 KiB) would stall the whole world.
    sinks = [tempfile.TemporaryFile() for _ in range(n)]  # noqa: SIM115 (closed in the finally below)
    try:
        base = {**os.environ, **WORKER_ENV, **(env or {}), "RINGSERVE_COORDINATOR": coordinator.address,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        for i in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, str(script), str(out_dir), *args], env={**base, "RINGSERVE_RANK_HINT": str(i)},
                stdout=sinks[i], stderr=subprocess.STDOUT, cwd=out_dir,
            ))
        outputs = []
        failed = []
        for i, p in enumerate(procs):
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                failed.append(f"process {i} ran past {timeout_s:g} s")
            else:
                if p.returncode != 0:
                    failed.append(f"process {i} exited with code {p.returncode}")
            outputs.append(_output(sinks[i]))
        if failed:
            listing = "\n".join(f"--- process {i} ---\n{o[-4000:]}" for i, o in enumerate(outputs))
            raise AssertionError(f"{'; '.join(failed)}\n{listing}")
        return Run(out_dir, outputs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for sink in sinks:
            sink.close()
        try:
            thread.run(coordinator.stop(0.2), 10.0)
        finally:
            thread.stop()


RunWorld = Callable[..., Run]
