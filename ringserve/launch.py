"""``ringserve run -np N command...``: a coordinator and N local worker processes, like torchrun.

The coordinator runs inside the launcher on a background loop. Each worker gets
RINGSERVE_COORDINATOR and RINGSERVE_RANK_HINT (its process index, which becomes its rank in the
first view), and Horovod's and torchrun's variables (see launch_env). Output lines are prefixed with the rank. When one worker fails, the others are
stopped (SIGTERM, then SIGKILL after a grace) and the launcher exits with that worker's code.

A worker that exits with STATE_LOST_EXIT_CODE (65: an uncaught StateLostError, see
ringserve.elastic.run) lost the job's committed state. Elastic or not, with --restart-failed or
not, nobody is restarted (a fresh process holds even less): the others are stopped and the
launcher exits with 65.
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
from typing import IO, Any

from ringserve.config import CoordinatorConfig
from ringserve.coordinator import Coordinator
from ringserve.errors import STATE_LOST_EXIT_CODE, InvalidArgumentError
from ringserve.launch_env import free_port, horovod_env, torch_env
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


FINISH_GRACE_S = 30.0


class _Group:
    """The worker processes, each with an output pump; a slot can be started again."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], address: str, sink: IO[bytes],
                 num_proc: int = 1) -> None:
        self._num_proc = num_proc
        self._command = list(command)
        self._env = dict(env)
        self._address = address
        self._sink = sink
        self._master_port = free_port()  # torch's store, for torch.distributed scripts (launch_env)
        self._lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.pumps: list[threading.Thread] = []

    def start(self, slot: int) -> None:
        child_env = {
            **self._env,
            **horovod_env(slot, self._num_proc),  # what horovodrun exports: see launch_env
            **torch_env(slot, self._num_proc, self._master_port),  # and torchrun
            "RINGSERVE_COORDINATOR": self._address,
            "RINGSERVE_RANK_HINT": str(slot),
            "PYTHONUNBUFFERED": "1",
        }
        proc = subprocess.Popen(
            self._command, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self.procs[slot] = proc
        assert proc.stdout is not None
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{slot}] ".encode(), self._sink, self._lock), daemon=True)
        pump.start()
        self.pumps.append(pump)

    def note(self, text: str) -> None:
        with self._lock:
            self._sink.write(f"ringserve run: {text}\n".encode())
            self._sink.flush()

    def stop(self) -> None:
        _stop_all(list(self.procs.values()))
        for pump in self.pumps:
            pump.join(5.0)


def launch(
    num_proc: int,
    command: Sequence[str],
    *,
    coordinator: CoordinatorConfig | None = None,
    env: Mapping[str, str] | None = None,
    out: IO[bytes] | None = None,
    elastic: bool = False,
    restart_failed: bool = False,
    max_restarts: int = 10,
) -> Outcome:
    """Runs ``command`` as ``num_proc`` workers of a fresh coordinator, and waits for them.

    Args:
        num_proc: number of worker processes started.
        command: the program and its arguments.
        coordinator: coordinator settings; min and max workers default to num_proc.
        env: environment for the workers; defaults to this process's.
        out: where the prefixed output goes; defaults to this process's stdout.
        elastic: a failed worker does not stop the others (they go on in a smaller world).
        restart_failed: start a failed worker again, up to max_restarts times in all; it rejoins.
            Implies elastic.

    Returns:
        The Outcome. Not elastic: 0 when every worker exited 0, else the first failing worker's
        code and slot. Elastic: 0 when some worker finished with 0 (the stragglers are stopped
        after a grace), else the last failure; STATE_LOST_EXIT_CODE as soon as a worker exits
        with it.
    """
    if num_proc < 1:
        raise InvalidArgumentError(f"The number of processes ({num_proc}) must be at least 1.")
    if not command:
        raise InvalidArgumentError("ringserve run needs a command to start, e.g. python train.py.")
    config = coordinator or CoordinatorConfig(min_workers=num_proc, max_workers=num_proc, settle_s=0.2)
    thread = LoopThread(use_uvloop=True, name="ringserve-launcher")
    coord = Coordinator(config)
    group: _Group | None = None
    # SIGTERM (a scheduler, `timeout`) must stop the workers too: they run in sessions of their
    # own, so only this process can. Turning it into SystemExit runs the cleanup below.
    previous = _exit_on_sigterm()
    try:
        thread.run(coord.start(), 30.0)
        group = _Group(command, os.environ if env is None else env, coord.address, out or sys.stdout.buffer,
                       num_proc=num_proc)
        group.note(f"coordinator at {coord.address}; starting {num_proc} workers")
        for slot in range(num_proc):
            group.start(slot)
        if elastic or restart_failed:
            return _supervise_elastic(group, max_restarts if restart_failed else 0)
        return _wait(group.procs)
    except KeyboardInterrupt:
        return Outcome(130)
    finally:
        if group is not None:
            group.stop()
        try:
            thread.run(coord.stop(0.2), 10.0)
        finally:
            thread.stop()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm() -> Any:
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


def _exit_code(code: int) -> int:
    return code if code > 0 else 128 - code


def _wait(procs: Mapping[int, subprocess.Popen[bytes]]) -> Outcome:
    remaining = set(procs)
    while remaining:
        for slot in sorted(remaining):
            code = procs[slot].poll()
            if code is None:
                continue
            remaining.discard(slot)
            if code != 0:
                return Outcome(_exit_code(code), failed_rank=slot)
        time.sleep(0.05)
    return Outcome(0)


def _supervise_elastic(group: _Group, restarts_left: int) -> Outcome:
    running = set(group.procs)
    finished_at: float | None = None
    last_failure: Outcome | None = None
    while running:
        for slot in sorted(running):
            code = group.procs[slot].poll()
            if code is None:
                continue
            running.discard(slot)
            if code == 0:
                finished_at = finished_at or time.monotonic()
                continue
            last_failure = Outcome(_exit_code(code), failed_rank=slot)
            if code == STATE_LOST_EXIT_CODE:
                group.note(f"worker {slot} lost the job's committed state (exit code {code}, StateLostError); "
                           f"restarting nobody and ending the run")
                return last_failure
            if finished_at is None and restarts_left > 0:
                restarts_left -= 1
                group.note(f"worker {slot} exited with code {code}; starting it again ({restarts_left} restarts left)")
                group.start(slot)
                running.add(slot)
            else:
                group.note(f"worker {slot} exited with code {code}; the others go on")
        if finished_at is not None and running and time.monotonic() - finished_at > FINISH_GRACE_S:
            group.note(f"training finished; stopping {len(running)} worker(s) still waiting to join")
            break
        time.sleep(0.05)
    if finished_at is not None:
        return Outcome(0)
    return last_failure or Outcome(0)
