"""``launch``: ``ringserve run``'s engine as a function (the package docstring, ringserve/launch/__init__.py, maps the rest)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from ringserve.config import CoordinatorConfig, ShardConfig
from ringserve.constants import (
    COORDINATOR_START_S,
    COORDINATOR_STOP_GRACE_S,
    COORDINATOR_STOP_WAIT_S,
    ELASTIC_TIMEOUT_S,
    FIXED_JOB_SETTLE_S,
    POLL_S,
)
from ringserve.coordinator import Coordinator
from ringserve.errors import InvalidArgumentError, UsageError
from ringserve.launch.elastic import Discovery, supervise
from ringserve.launch.group import Outcome, Placement, Workers, networked_config
from ringserve.launch.hosts import Blacklist, HostSpec, assign_slots
from ringserve.launch.procs import is_local_host
from ringserve.launch.shards import ParameterServer
from ringserve.loop import LoopThread

__all__ = ["launch"]


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
    placement: Placement | None = None,
    ps_shards: int = 0,
) -> Outcome:
    """Runs ``command`` as ``num_proc`` workers of a fresh coordinator, and waits for them.

    Args:
        num_proc: number of worker processes started (elastic: the slots needed to start).
        command: the program and its arguments.
        coordinator: coordinator settings; min and max workers default to num_proc.
        env: environment for the workers; defaults to this process's.
        out: where the prefixed output goes; defaults to this process's stdout.
        elastic: a failed worker does not stop the others (they go on in a smaller world).
        restart_failed: start a failed worker again, up to max_restarts times in all; it rejoins.
            Implies elastic.
        placement: the hosts to run on (None: all on this host); a discovery script in it makes
            the run elastic.
        ps_shards: also run this many parameter-server shards (ringserve.ps), one process each,
            on this host, registered with the coordinator; a shard that exits is started again.

    Returns:
        The Outcome. Not elastic: 0 when every worker exited 0, else the first failing worker's
        code, index, host and reason. Elastic: 0 when some worker finished with 0 (the
        stragglers are stopped after a grace), else the last failure; STATE_LOST_EXIT_CODE as
        soon as a worker exits with it.

    Raises:
        InvalidArgumentError: num_proc below 1, no command, or fewer slots than num_proc.
    """
    if num_proc < 1:
        raise InvalidArgumentError(f"The number of processes ({num_proc}) must be at least 1.")
    if not command:
        raise InvalidArgumentError("ringserve run needs a command to start, e.g. python train.py.")
    config = coordinator or CoordinatorConfig(min_workers=num_proc, max_workers=num_proc, settle_s=FIXED_JOB_SETTLE_S)
    discovery_script = placement.discovery_script if placement is not None else ""
    hosts = list(placement.hosts) if placement is not None else [HostSpec(socket.gethostname(), num_proc)]
    if not discovery_script:
        assign_slots(hosts, num_proc)  # fewer slots than -np is an error before anything starts
    if ps_shards and placement is not None:
        raise InvalidArgumentError(
            "--ps runs the parameter-server shards on this host for workers on this host; with hosts, start "
            "`ringserve ps --shards S` where the workers can reach it, with the same coordinator."
        )
    elastic = elastic or restart_failed or bool(discovery_script)
    thread = LoopThread(use_uvloop=True, name="ringserve-launcher")
    workers: Workers | None = None
    discovery: Discovery | None = None
    # SIGTERM (a scheduler, `timeout`) must stop the workers too: they run in sessions of their
    # own, so only this process can. Turning it into SystemExit runs the cleanup below.
    previous = _exit_on_sigterm()
    coord: Coordinator | None = None
    shards: ParameterServer | None = None
    try:
        local = {h.name: is_local_host(h.name) for h in hosts} if placement is not None else {}
        networked = bool(discovery_script) or not all(local.values())
        if placement is None or all(local.values()):
            interpreter_can_import_ringserve(command, os.environ if env is None else env)
        if networked:
            config = networked_config(config)
        # The launcher holds no tensors: a flood's freed heap goes back to the system, as for a
        # coordinator of its own (benchmarks/hostile_memory.py).
        coord = Coordinator(config, release_memory=True)
        thread.run(coord.start(), COORDINATOR_START_S)
        if ps_shards:
            job_env = os.environ if env is None else env
            # The shards' restarts follow --max-restarts too, where it is given (--restart-failed).
            shards = ParameterServer(coord.address, shards=ps_shards, config=ShardConfig.from_env(job_env),
                                     env=job_env, max_restarts=max_restarts if restart_failed else SHARD_RESTARTS).start()
        served = coord.service
        workers = Workers(command, os.environ if env is None else env, out or sys.stdout.buffer,
                          coordinator=config, port=coord.port, placement=placement, networked=networked,
                          known_local=local, joined=lambda: served.joins > 0)
        where = f" on {','.join(f'{h.name}:{h.slots}' for h in hosts)}" if placement is not None and hosts else ""
        if discovery_script:
            where = f" on the hosts {discovery_script!r} discovers"
        workers.note(f"coordinator at {coord.address}; starting {num_proc} workers{where}")
        if coord.status_page is not None:  # its bound port: --http-port 0 picks one
            workers.note(f"status page on {coord.status_page.url}")
        if shards is not None:
            workers.note(f"{ps_shards} parameter-server shards at {', '.join(shards.addresses)}")
        # A shard that is down for good (its restarts spent) ends the run: the workers would
        # otherwise wait for it, fail, be restarted and wait again, for ever.
        fatal = (lambda: shards.failure) if shards is not None else _no_failure
        if not elastic:
            return _run_fixed(workers, hosts, num_proc, fatal)
        if discovery_script:
            assert placement is not None
            discovery = Discovery(discovery_script, placement.slots_per_host, placement.discovery_interval_s,
                                  timeout_s=placement.ssh.start_timeout_s, note=workers.note)
            first = discovery.first()
            if isinstance(first, Outcome):
                return first
            discovery.start()
        return supervise(
            workers, num_proc=num_proc, max_np=max(config.max_workers, num_proc),
            hosts=None if discovery_script else hosts, discovery=discovery,
            restart_failed=restart_failed, max_restarts=max_restarts if restart_failed else 0,
            blacklist=Blacklist(placement.cooldown_range) if placement is not None else None,
            elastic_timeout_s=placement.elastic_timeout_s if placement is not None else ELASTIC_TIMEOUT_S,
            fatal=fatal,
        )
    except KeyboardInterrupt:
        return Outcome(130)
    finally:
        try:
            if discovery is not None:
                discovery.stop()
            if workers is not None:
                workers.stop()
            if shards is not None:
                shards.stop()
        finally:
            try:
                if coord is not None:
                    thread.run(coord.stop(COORDINATOR_STOP_GRACE_S), COORDINATOR_STOP_WAIT_S)
            finally:
                thread.stop()
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)


PYTHON_NAME = re.compile(r"python(\d+(\.\d+)*)?")
INTERPRETER_CHECK_S = 60.0


def interpreter_can_import_ringserve(command: Sequence[str], env: Mapping[str, str]) -> None:
    """When the command starts a python other than this launcher's, checks once that it can import
    ringserve, before N workers find out each on its own (a virtual environment not activated:
    ``.venv/bin/ringserve run -np 4 python train.py`` runs the system's python).

    Raises:
        UsageError: that python cannot import ringserve; the error names it and this launcher's.
    """
    if not command or not PYTHON_NAME.fullmatch(os.path.basename(command[0])):
        return
    found = shutil.which(command[0], path=env.get("PATH", os.defpath))
    if found is None or os.path.abspath(found) == os.path.abspath(sys.executable):
        return
    try:
        probe = subprocess.run([found, "-c", "import ringserve, grpc, numpy"], env=dict(env), capture_output=True, text=True, check=False,
                               timeout=INTERPRETER_CHECK_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return  # slow, not broken: the workers will tell
    if probe.returncode == 0:
        return
    lines = [line for line in probe.stderr.splitlines() if line.strip()]
    why = lines[-1].strip() if lines else f"exit code {probe.returncode}"
    raise UsageError(
        f"The command's {command[0]} ({found}) cannot import ringserve and its core ({why}), so no worker could start; "
        f"this launcher runs under {sys.executable}. Activate its virtual environment, or name that "
        f"interpreter in the command: ringserve run -np N {sys.executable} {' '.join(command[1:]) or 'train.py'}"
    )


def _exit_on_sigterm() -> Any:
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, handler)


SHARD_RESTARTS = 10  # a shard's restarts without --restart-failed (ParameterServer's default)


def _no_failure() -> str:
    return ""


def _run_fixed(workers: Workers, hosts: Sequence[HostSpec], num_proc: int,
               fatal: Callable[[], str] = _no_failure) -> Outcome:
    """Not elastic: every slot gets a worker; the first failure ends the run, and so does a
    ``fatal()`` that says why (a parameter-server shard down for good). Remote workers start
    first, so that local ones can advertise the address the remote hosts see this one by."""
    slots = assign_slots(hosts, num_proc)
    local_index: dict[str, int] = {}
    pending = []
    for index, slot in enumerate(slots):
        local_index[slot.host] = local_index.get(slot.host, -1) + 1
        pending.append((index, local_index[slot.host], slot))
    pending.sort(key=lambda item: workers.is_local(item[2].host))
    started = []
    while True:
        still = []
        for index, local, slot in pending:
            proc = workers.start(index, local, slot)
            if proc is None:
                still.append((index, local, slot))
            else:
                started.append(proc)
        pending = still
        done = 0
        for proc in started:
            code = proc.poll()
            if code is None:
                continue
            if code != 0:
                return Outcome(code, failed_rank=proc.index, host=proc.host, reason=proc.reason())
            done += 1
        if not pending and done == len(started):
            return Outcome(0)
        if why := fatal():
            return Outcome(1, reason=why)
        time.sleep(POLL_S)
