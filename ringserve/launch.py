"""``ringserve run -np N command...``: a coordinator and N local worker processes, like torchrun.

The coordinator runs inside the launcher on a background loop. Each worker gets
RINGSERVE_COORDINATOR and RINGSERVE_RANK_HINT (its process index, which becomes its rank in the
first view). Output lines are prefixed with the rank. When one worker fails, the others are
stopped (SIGTERM, then SIGKILL after a grace) and the launcher exits with that worker's code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from ringserve.config import CoordinatorConfig
from ringserve.coordinator import Coordinator
from ringserve.errors import InvalidArgumentError
from ringserve.loop import LoopThread

TERMINATE_GRACE_S = 5.0


@dataclass
class Outcome:
    """How a launch ended: the exit code, and the rank that failed first (None if none did)."""

    code: int
    failed_rank: int | None = None


def _pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock) -> None:
    """Copies a child's output line by line, each line (and each carriage-return redraw, as a
    progress bar makes) prefixed with the rank; whole lines only, so ranks never interleave."""
    pending = b""
    while True:
        data = os.read(stream.fileno(), 65536)
        if not data:
            break
        parts = (pending + data).splitlines(keepends=True)
        pending = parts.pop() if not parts[-1].endswith((b"\n", b"\r")) else b""
        if parts:
            with lock:
                out.write(b"".join(prefix + part for part in parts))
                out.flush()
    if pending:
        with lock:
            out.write(prefix + pending + b"\n")
            out.flush()
    stream.close()


def _stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            with _suppress_lookup():
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with _suppress_lookup():
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


class _suppress_lookup:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is ProcessLookupError


def launch(
    num_proc: int,
    command: Sequence[str],
    *,
    coordinator: CoordinatorConfig | None = None,
    env: Mapping[str, str] | None = None,
    out: IO[bytes] | None = None,
) -> Outcome:
    """Runs ``command`` as ``num_proc`` workers of a fresh coordinator, and waits for them.

    Args:
        num_proc: number of worker processes (the world size).
        command: the program and its arguments.
        coordinator: coordinator settings; min and max workers default to num_proc.
        env: environment for the workers; defaults to this process's.
        out: where the prefixed output goes; defaults to this process's stdout.

    Returns:
        The Outcome: code 0 when every worker exited 0, else the first failing worker's code.
    """
    if num_proc < 1:
        raise InvalidArgumentError(f"The number of processes ({num_proc}) must be at least 1.")
    if not command:
        raise InvalidArgumentError("ringserve run needs a command to start, e.g. python train.py.")
    config = coordinator or CoordinatorConfig(min_workers=num_proc, max_workers=num_proc, settle_s=0.2)
    sink = out or sys.stdout.buffer
    thread = LoopThread(use_uvloop=True, name="ringserve-launcher")
    coord = Coordinator(config)
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    lock = threading.Lock()
    try:
        thread.run(coord.start(), 30.0)
        base = dict(os.environ if env is None else env)
        for i in range(num_proc):
            child_env = {
                **base,
                "RINGSERVE_COORDINATOR": coord.address,
                "RINGSERVE_RANK_HINT": str(i),
                "PYTHONUNBUFFERED": "1",
            }
            proc = subprocess.Popen(
                list(command), env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
            procs.append(proc)
            assert proc.stdout is not None
            pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{i}] ".encode(), sink, lock), daemon=True)
            pump.start()
            pumps.append(pump)
        outcome = _wait(procs)
        if outcome.failed_rank is not None:
            _stop_all(procs)
        return outcome
    except KeyboardInterrupt:
        _stop_all(procs)
        return Outcome(130)
    finally:
        _stop_all(procs)
        for pump in pumps:
            pump.join(5.0)
        try:
            thread.run(coord.stop(0.2), 10.0)
        finally:
            thread.stop()


def _wait(procs: Sequence[subprocess.Popen[bytes]]) -> Outcome:
    remaining = set(range(len(procs)))
    while remaining:
        for i in sorted(remaining):
            code = procs[i].poll()
            if code is None:
                continue
            remaining.discard(i)
            if code != 0:
                return Outcome(code if code > 0 else 128 - code, failed_rank=i)
        time.sleep(0.05)
    return Outcome(0)
