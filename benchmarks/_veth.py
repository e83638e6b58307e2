"""Hosts for benchmarks that must not share a loopback: network namespaces joined by veth pairs.

Each host is a network namespace (``rsl-h<i>-<tag>``) with one veth device, ``rsl0``, whose peer
is a port of a bridge in a switch namespace of its own (``rsl-sw-<tag>``). Nothing limits the rate
or delays a packet: the links are as fast as the kernel moves packets between namespaces (veth,
with its segmentation offloads on, as a NIC has them), so what is measured is the cost of each
framework's own path to the network, with no loopback shortcut and no shared memory between hosts
(the benchmarks turn ringserve's off: the namespaces share one kernel and one PID space).

    host i's namespace             the switch namespace
    +-------------------------+    +---------------------------+
    | rsl0: 10.213.60.<i+1>   |----| rsl-p<i> -- bridge rsl-br |
    +-------------------------+    +---------------------------+

Only namespaces made here are changed; the root namespace gains nothing but them. ``Lan.close``
kills the processes still in them and deletes them, and with them their devices; a run killed
with SIGKILL leaves them behind (``ip netns list``; ``ip netns delete rsl-...``). Needs root and
``ip``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

SUBNET = "10.213.60"
DEVICE = "rsl0"
# The kernel's neighbour (ARP) table is one for every namespace, and past gc_thresh3 entries (1,024
# by default) it drops new ones ("neighbor table overflow"): 33 namespaces that each reach the 32
# others need 1,056, and at 256 workers on 32 hosts the coordinator became unreachable. A run of
# more hosts raises the thresholds to what its hosts need, and puts them back when it closes.
NEIGH = "/proc/sys/net/ipv4/neigh/default/gc_thresh{}"


class LanUnavailable(RuntimeError):
    """This machine cannot make the namespaces (not root, or ``ip`` is missing)."""


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    address: str


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


class Lan:
    """``hosts`` network namespaces on one unlimited bridge; a context manager."""

    def __init__(self, hosts: int, *, mtu: int = 1500) -> None:
        tag = secrets.token_hex(3)
        self.switch = f"rsl-sw-{tag}"
        self.hosts = [Host(i, f"rsl-h{i}-{tag}", f"{SUBNET}.{i + 1}") for i in range(hosts)]
        self.mtu = mtu
        self._tag = tag
        self._made: list[str] = []
        self._thresholds: list[str] = []  # the neighbour table's, as found, where raised

    def __enter__(self) -> Lan:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise LanUnavailable("the hosts of a between-hosts run need root and iproute2 (ip netns)")
        self._room_for_neighbours()
        try:
            _ip("netns", "add", self.switch)
            self._made.append(self.switch)
            _ip("-n", self.switch, "link", "add", "rsl-br", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "rsl-br", "up")
            for host in self.hosts:
                _ip("netns", "add", host.netns)
                self._made.append(host.netns)
                port = f"rsl-p{host.index}"
                _ip("link", "add", DEVICE, "netns", host.netns, "mtu", str(self.mtu), "type", "veth",
                    "peer", "name", port, "netns", self.switch, "mtu", str(self.mtu))
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", DEVICE)
                _ip("-n", host.netns, "link", "set", DEVICE, "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
                _ip("-n", self.switch, "link", "set", port, "master", "rsl-br")
                _ip("-n", self.switch, "link", "set", port, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _room_for_neighbours(self) -> None:
        """Raises the neighbour table's thresholds where these hosts, each reaching every other,
        would pass them (with room to spare for the rest of the machine)."""
        needed = 2 * len(self.hosts) ** 2
        found = [pathlib.Path(NEIGH.format(i)).read_text().strip() for i in (1, 2, 3)]
        if needed <= int(found[1]):
            return
        self._thresholds = found
        for i, value in zip((1, 2, 3), (needed // 4, needed, 2 * needed), strict=True):
            pathlib.Path(NEIGH.format(i)).write_text(str(max(value, int(found[i - 1]))))

    def close(self) -> None:
        """Kills what still runs in the namespaces and deletes them, and puts back the neighbour
        table's thresholds; safe to call twice."""
        while self._made:
            netns = self._made.pop()
            done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
            for pid in done.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True, timeout=30)
        while self._thresholds:
            i = len(self._thresholds)
            pathlib.Path(NEIGH.format(i)).write_text(self._thresholds.pop())

    @staticmethod
    def command(host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
        """``argv`` run in ``host``'s namespace, with ``env`` added to the environment it inherits."""
        prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
        return ["ip", "netns", "exec", host.netns, *prefix, *argv]

    def wait_listening(self, host: Host, port: int, timeout_s: float) -> None:
        """Waits until something accepts TCP connections on ``host``'s address and ``port``."""
        deadline = time.monotonic() + timeout_s
        probe = ["ip", "netns", "exec", host.netns, "python3", "-c",
                 f"import socket; socket.create_connection(('{host.address}', {port}), timeout=1).close()"]
        while subprocess.run(probe, capture_output=True, timeout=30).returncode != 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host.address}:{port} after {timeout_s} s")
            time.sleep(0.1)


def free_port() -> int:
    """A port number that was free on this machine a moment ago (namespaces have their own ports
    anyway; any number not in use will do)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
