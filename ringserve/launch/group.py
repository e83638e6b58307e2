"""The workers of one ``ringserve run``: where they go, what each one is given, and how they end.

``Workers.start`` puts a worker in a slot: a child process on this host, or one under ssh on
another (launch.procs). Every worker gets RINGSERVE_COORDINATOR, RINGSERVE_RANK_HINT (its index,
which becomes its rank in the first view), Horovod's variables for its slot (launch.env), and,
when hosts were named, RINGSERVE_HOSTNAME (the host's name as given, so that local_rank and
cross_rank group the workers by host).

In a run that spans hosts ("networked"), workers must reach one another and the coordinator
across the network:
- the coordinator binds 0.0.0.0 (unless told otherwise) and, without a token or client
  certificates of the user's (or RINGSERVE_INSECURE=1), requires a token made for the run
  (config.secured_job), which reaches the workers only through their environment (ssh's stdin
  for remote ones, never a command line);
- every worker binds 0.0.0.0; a remote one advertises the address of its interface that routes
  to the coordinator (``auto``) and dials the coordinator at the launching host's address as
  its ssh connection came from it; a local one advertises that address too, learnt from the
  first remote worker to start (or given with --advertise-host).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import IO

from ringserve.config import CoordinatorConfig, is_loopback, secured_job
from ringserve.constants import ELASTIC_TIMEOUT_S
from ringserve.errors import InvalidArgumentError
from ringserve.launch.env import free_port, slot_env, torch_env
from ringserve.launch.hosts import HostSpec, Slot
from ringserve.launch.procs import (
    LocalProc,
    Proc,
    RemoteProc,
    SshSettings,
    forwarded_env,
    guess_own_address,
    is_local_host,
    stop_all,
)

TERMINATE_GRACE_S = 5.0
ANY_ADDRESS = "0.0.0.0"


def payload_ports(env: Mapping[str, str], local: int) -> dict[str, str]:
    """The payload ports of a host's ``local``-th worker: a pinned RINGSERVE_PAYLOAD_PORT P (and
    RINGSERVE_PAYLOAD_ADVERTISE_PORT) is the first of a range, P + local, so that the workers of one
    host do not all bind one port (open P to P + slots - 1 on each host). Unpinned (0 or unset):
    every worker takes a free port of its own."""
    ports = {}
    for name in ("RINGSERVE_PAYLOAD_PORT", "RINGSERVE_PAYLOAD_ADVERTISE_PORT"):
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            ports[name] = str(int(value) + local)
    return ports


@dataclass
class Outcome:
    """How a launch ended: the exit code, and the worker that failed first (None if none did).

    ``failed_rank`` is the worker's index (its rank when it started); ``reason`` a sentence naming
    it and, over several hosts, its host.
    """

    code: int
    failed_rank: int | None = None
    host: str | None = None
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a launch's workers run, when not all on this host (horovodrun's host arguments).

    Attributes:
        hosts: the hosts and their slots (-H or --hostfile); empty with a discovery script.
        discovery_script: a command printing ``host:slots`` lines, polled in an elastic run.
        slots_per_host: slots of a discovered host printed without ``:slots``.
        discovery_interval_s: how often the script runs (horovodrun: every second).
        ssh: how remote hosts are reached.
        advertise_host: this host's address for workers elsewhere; empty: as their ssh saw it.
        cooldown_range: (min, max) seconds a failing host stays blacklisted; None: for good.
        elastic_timeout_s: how long an elastic run waits for -np slots to be discovered.
        verbose: note each ssh command and slot as it starts.
    """

    hosts: tuple[HostSpec, ...] = ()
    discovery_script: str = ""
    slots_per_host: int = 1
    discovery_interval_s: float = 1.0
    ssh: SshSettings = field(default_factory=SshSettings)
    advertise_host: str = ""
    cooldown_range: tuple[int, int] | None = None
    elastic_timeout_s: float = ELASTIC_TIMEOUT_S
    verbose: bool = False


def networked_config(config: CoordinatorConfig) -> CoordinatorConfig:
    """The coordinator's settings for a run over several hosts: reachable from them, and secure by
    default (config.secured_job: a token made for the run unless the user gave one, or TLS with
    client certificates, or opted out by name)."""
    if is_loopback(config.host):
        config = replace(config, host=ANY_ADDRESS)
    return secured_job(config)


class Workers:
    """Starts workers in slots and keeps every one it started, to stop them all at the end."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], sink: IO[bytes], *,
                 coordinator: CoordinatorConfig, port: int, placement: Placement | None,
                 networked: bool, known_local: Mapping[str, bool] | None = None,
                 grace_s: float = TERMINATE_GRACE_S, joined: Callable[[], bool] = lambda: True) -> None:
        """``joined``: whether any worker has joined the job yet (the coordinator's count)."""
        self.joined = joined
        self._command = list(command)
        self._env = dict(env)
        self._sink = sink
        self._lock = threading.Lock()
        self._port = port
        self._placement = placement
        self._ssh = placement.ssh if placement is not None else SshSettings()
        self.networked = networked
        self._grace_s = grace_s
        self._local: dict[str, bool] = dict(known_local or {})
        self._address = placement.advertise_host if placement is not None else ""
        self._job_env: dict[str, str] = {}
        if networked and coordinator.token and not (self._env.get("RINGSERVE_TOKEN") or self._env.get("RINGSERVE_TOKEN_FILE")):
            self._job_env["RINGSERVE_TOKEN"] = coordinator.token
        self._master_port = free_port()  # torch's store, for torch.distributed scripts (launch.env)
        self.procs: list[Proc] = []
        self._stop = threading.Event()
        self._pinger = threading.Thread(target=self._ping, name="ringserve-ssh-ping", daemon=True)
        self._pinger.start()

    def is_local(self, host: str) -> bool:
        if self._placement is None:
            return True
        if host not in self._local:
            self._local[host] = is_local_host(host)
        return self._local[host]

    def note(self, text: str) -> None:
        with self._lock:
            self._sink.write(f"ringserve run: {text}\n".encode())
            self._sink.flush()

    def label(self, index: int, host: str) -> str:
        return f"rank {index} on {host}" if self._placement is not None else f"rank {index}"

    def name(self, proc: Proc) -> str:
        """How the notes call a worker: "worker 3", or "worker 3 on host-b"."""
        return f"worker {proc.index} on {proc.host}" if self._placement is not None else f"worker {proc.index}"

    def local_address(self) -> str | None:
        """The address local workers advertise in a networked run; None while it is not known
        yet (a remote worker is still starting and will tell it)."""
        if self._address:
            return self._address
        remotes = [p for p in self.procs if isinstance(p, RemoteProc)]
        for p in remotes:
            if p.client:
                self._address = p.client
                return self._address
        if any(p.popen.poll() is None for p in remotes):
            return None
        hosts = [h.name for h in self._placement.hosts] if self._placement is not None else []
        self._address = guess_own_address([h for h in hosts if not self.is_local(h)])
        return self._address

    def _master_address(self) -> str:
        """Where rank 0 serves torch's store (MASTER_ADDR): loopback on one host; over several, the
        first host named, or this host's address when that is this host (or hosts are discovered)."""
        if self._placement is None or not self.networked:
            return "127.0.0.1"
        hosts = [h.name for h in self._placement.hosts]
        if hosts and not self.is_local(hosts[0]):
            return hosts[0]
        return self._address or self._placement.advertise_host or guess_own_address(
            [h for h in hosts if not self.is_local(h)])

    def start(self, index: int, local: int, slot: Slot) -> Proc | None:
        """Starts the worker of ``slot`` (the ``local``-th slot of its host) with prefix ``index``;
        None if it must wait until the launching host's address is known."""
        worker_env = {
            **slot_env(slot),  # what horovodrun exports: see launch.env
            **self._job_env,
            "RINGSERVE_RANK_HINT": str(index),
            "PYTHONUNBUFFERED": "1",
        }
        if self._placement is not None:
            worker_env["RINGSERVE_HOSTNAME"] = slot.host
        worker_env.update(payload_ports(self._env, local))
        worker_env.update(torch_env(slot, self._master_address(), self._master_port))  # and what torchrun exports
        label = self.label(index, slot.host)
        proc: Proc
        if self.is_local(slot.host):
            worker_env["RINGSERVE_COORDINATOR"] = f"127.0.0.1:{self._port}"
            if self.networked:
                address = self.local_address()
                if address is None:
                    return None
                worker_env["RINGSERVE_BIND_HOST"] = ANY_ADDRESS
                worker_env["RINGSERVE_ADVERTISE_HOST"] = address
            proc = LocalProc(index, slot.host, local, label, self._command, {**self._env, **worker_env},
                             self._sink, self._lock)
        else:
            if shutil.which("ssh") is None:
                raise InvalidArgumentError(f"Starting workers on {slot.host} needs ssh, which is not installed here "
                                           f"(the openssh-client package).")
            worker_env["RINGSERVE_BIND_HOST"] = ANY_ADDRESS
            worker_env["RINGSERVE_ADVERTISE_HOST"] = "auto"
            assert self._placement is not None
            remote = RemoteProc(
                index, slot.host, local, label, self._command, {**forwarded_env(self._env), **worker_env},
                cwd=os.getcwd(), coordinator_port=self._port, coordinator_host=self._placement.advertise_host,
                ssh=self._ssh, grace_s=self._grace_s, sink=self._sink, lock=self._lock,
            )
            if self._placement.verbose:
                self.note(f"{label}: {' '.join(remote.ssh_argv[:-1])} '<launch/remote.py>'")
            proc = remote
        self.procs.append(proc)
        return proc

    def _ping(self) -> None:
        while not self._stop.wait(self._ssh.ping_interval_s):
            for p in list(self.procs):
                if isinstance(p, RemoteProc) and p.popen.poll() is None:
                    p.ping()

    def stop(self) -> None:
        """Stops every worker still running (SIGTERM, then SIGKILL after the grace)."""
        try:
            stop_all(self.procs, self._grace_s)
        finally:
            self._stop.set()
            self._pinger.join(5.0)
