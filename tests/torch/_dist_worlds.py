"""Real torch.distributed worlds: N processes of a script, started the ways a job starts.

``run_dist(script, n, out_dir, args, launch=...)`` runs ``script out_dir *args`` in ``n``
processes and waits for them under a deadline:

- ``"env"``: a coordinator in this process (RINGSERVE_COORDINATOR) and torch's env:// variables
  (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), as ``ringserve run`` gives them, but with the
  processes in the test's hands (``start_dist`` returns them, to kill one);
- ``"rank0"``: torch's variables only, as torchrun gives them: rank 0 starts the coordinator;
- ``"ringserve-run"``: the real launcher, ``python -m ringserve.cli run -np n``;
- ``"torchrun"``: the real torchrun, ``--standalone --nproc-per-node n``.

The script's first argument is ``out_dir``, where it writes what the test checks (``out_dir=False``:
the script gets only ``args``, and runs in ``out_dir``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from _worlds import REPO, WORKER_ENV, WORKERS, Run, _output, _start_coordinator

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
DIST_WORKERS = WORKERS

__all__ = ["DIST_WORKERS", "Run", "Started", "run_dist", "start_dist"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _base_env(env: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, **WORKER_ENV, **(env or {}),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@dataclass
class Started:
    """The processes of a world, in rank order (one process for the launchers)."""

    procs: list[subprocess.Popen[bytes]]
    out_dir: Path
    sinks: list[IO[bytes]]  # their output, a file each (see start_dist)

    def wait(self, timeout_s: float, killed: frozenset[int] = frozenset()) -> Run:
        """Waits for every process; raises AssertionError with their output if any failed or hung
        (the processes in ``killed`` must have been killed by SIGKILL instead)."""
        outputs, failed = [], []
        for i, p in enumerate(self.procs):
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                failed.append(f"process {i} ran past {timeout_s:g} s")
            else:
                expected = -9 if i in killed else 0
                if p.returncode != expected:
                    failed.append(f"process {i} exited with code {p.returncode}, not {expected}")
            outputs.append(_output(self.sinks[i]))
        if failed:
            listing = "\n".join(f"--- process {i} ---\n{o[-5000:]}" for i, o in enumerate(outputs))
            raise AssertionError(f"{'; '.join(failed)}\n{listing}")
        return Run(self.out_dir, outputs)


@contextmanager
def start_dist(script: Path, n: int, out_dir: Path, args: Sequence[str] = (), *, launch: str = "env",
               env: dict[str, str] | None = None, pass_out_dir: bool = True,
               launcher_args: Sequence[str] = ()) -> Iterator[Started]:
    """Starts the world and yields it; every process left is killed on the way out.
    ``launcher_args`` go to the launcher (``--max-restarts 1``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = _base_env(env)
    argv = [str(script), *([str(out_dir)] if pass_out_dir else []), *args]
    thread = coordinator = None
    procs: list[subprocess.Popen[bytes]] = []
    # Each process's output goes to a file: a pipe of one is read only once those before it have
    # ended (and not at all while the test holds the world), and a rank blocked on a full pipe
    # (64 KiB) would stall the whole world.
    sinks: list[IO[bytes]] = []

    def popen(command: list[str], extra: dict[str, str]) -> None:
        sinks.append(tempfile.TemporaryFile())  # noqa: SIM115 (closed in the finally below)
        procs.append(subprocess.Popen(command, env={**base, **extra}, stdout=sinks[-1],
                                      stderr=subprocess.STDOUT, cwd=out_dir))

    try:
        if launch in ("env", "rank0"):
            torch_env = {"WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
            if launch == "env":
                thread, coordinator = _start_coordinator(n)
                torch_env["RINGSERVE_COORDINATOR"] = coordinator.address
            else:
                base.pop("RINGSERVE_COORDINATOR", None)
            for rank in range(n):
                popen([sys.executable, *argv], {**torch_env, "RANK": str(rank), "LOCAL_RANK": str(rank)})
        elif launch == "ringserve-run":
            popen([sys.executable, "-m", "ringserve.cli", "run", "-np", str(n), *launcher_args, sys.executable, *argv], {})
        elif launch == "torchrun":
            base.pop("RINGSERVE_COORDINATOR", None)
            popen([TORCHRUN, "--standalone", "--nproc-per-node", str(n), *launcher_args, *argv], {})
        else:
            raise ValueError(f"unknown launch {launch!r}")
        yield Started(procs, out_dir, sinks)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for sink in sinks:
            sink.close()
        if thread is not None and coordinator is not None:
            try:
                thread.run(coordinator.stop(0.2), 10.0)
            finally:
                thread.stop()


def run_dist(script: Path, n: int, out_dir: Path, args: Sequence[str] = (), *, launch: str = "env",
             timeout_s: float = 90.0, env: dict[str, str] | None = None, pass_out_dir: bool = True,
             killed: frozenset[int] = frozenset(), launcher_args: Sequence[str] = ()) -> Run:
    """Runs the world to its end (see the module docstring)."""
    with start_dist(script, n, out_dir, args, launch=launch, env=env, pass_out_dir=pass_out_dir,
                    launcher_args=launcher_args) as world:
        return world.wait(timeout_s, killed)
