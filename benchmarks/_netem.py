"""A wide-area network for benchmarks: hosts in network namespaces, joined by a delaying TUN switch.

Why this design: ``tc netem`` would be the usual tool, but this kernel has no ``sch_netem`` (``tc
qdisc add ... netem`` answers "Specified qdisc kind is unknown"). A delaying TCP proxy on each ring
edge would delay ringserve's peer connections but not gloo's, which dials its peers' listening
addresses directly, so DDP would see a different network. The delay is therefore added at layer 3,
below every TCP connection, where both frameworks see the same latency and bandwidth.

The layout, for ``n`` hosts (namespaces ``rsw-h<i>-<tag>``, ``<tag>`` random per run)::

    host i's namespace                       the switch process (root namespace)
    +--------------------------------+        +-------------------------------------+
    | rsw0: TUN, 10.213.50.<i+1>/24  | -----> | reads IP packets from every TUN fd, |
    | egress qdisc: tbf <rate_mbit>  |        | holds each one for delay_ms, then   |
    | route 10.213.50.0/24 dev rsw0  | <----- | writes it to the TUN fd of the host |
    +--------------------------------+        | that owns its destination address   |
                                              +-------------------------------------+

- Each host's TUN device is its only link. Its egress qdisc is ``tbf`` at ``rate_mbit``: the host's
  uplink. The switch is a pure delay line: every packet waits ``delay_ms`` from the moment it leaves
  its sender's tbf, so each direction of each edge gets the delay (RTT = 2 x delay_ms).
- The switch holds the TUN file descriptors of all hosts: it enters each namespace with
  ``setns(2)`` (a TUN fd stays bound to the namespace it was attached in), then returns to its own.
  It counts the IP bytes each host sends ("bytes on the wire", headers and ACKs included) in a small
  memory-mapped file that any process, in any namespace, can read with ``read_counters``.
- The MTU is 1500 by default, as on real links: TCP then counts its window in segments of 1448
  bytes, from an initial 10, and starts again from there after an idle gap (slow start after
  idle), as it does across a real WAN. Forwarding 8,300 packets a second per host at 100 Mbit/s is
  too much for a Python switch on a loaded machine (four hosts sending at once got 66-71 Mbit/s
  each), so the TUN devices take TCP segmentation offload, as NICs do (``offload``, on by
  default): the kernel hands the switch TCP packets of up to 64 KiB that stand for several
  1500-byte segments, and the receiving host's kernel takes them as such (86 Mbit/s each, four at
  once; at MTU 65000 without offload, 93). The TCP segment size, the windows and the per-packet
  overhead on the wire stay those of MTU 1500: tbf charges each segment's headers (its bucket is
  70 kB, so that it passes an offloaded packet whole), and the switch counts the bytes of the
  segments a packet stands for (``wire_bytes``). The switch runs at a raised priority (nice -10)
  because a real network does not share the hosts' CPUs.
- Traffic between two processes of one host stays on that host's loopback, as it would on a machine.

Only namespaces made here are changed, and all addresses are in 10.213.50.0/24 inside them; the
root namespace gains nothing but the namespaces. ``Wan.__exit__`` kills the processes still in them
and deletes them, and with them their devices; a run killed with SIGKILL leaves them behind
(``ip netns list``; ``ip netns delete rsw-h<i>-<tag>``). Needs root, ``ip``, ``tc`` and
``/dev/net/tun``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import multiprocessing
import os
import secrets
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.synchronize import Event as EventType
from types import TracebackType

SUBNET = "10.213.50"
DEVICE = "rsw0"
TBF_LATENCY_MS = 200
_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000
_TUNSETOFFLOAD = 0x400454D0
_TUN_F_CSUM, _TUN_F_TSO4, _TUN_F_TSO6 = 0x01, 0x02, 0x04
_VNET_HDR = 10  # struct virtio_net_hdr: flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
_GSO_BURST = 70000  # tbf's bucket with offload: a whole 64 KiB TSO packet, so that tbf passes it unsplit
_READ_BYTES = 1 << 17
_SWITCH_NICE = -10


class EmulationUnavailable(RuntimeError):
    """This machine cannot run the emulation (not root, or a tool or /dev/net/tun is missing)."""


@dataclass(frozen=True)
class Host:
    """One emulated host: a network namespace with one link, the TUN device ``DEVICE``."""

    index: int
    netns: str
    address: str


def check_environment() -> None:
    """Raises EmulationUnavailable, saying what is missing, unless the emulation can run here."""
    if os.geteuid() != 0:
        raise EmulationUnavailable("the WAN emulation needs root (network namespaces, TUN devices, tc)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulationUnavailable(f"the WAN emulation needs {' and '.join(missing)} (iproute2)")
    if not os.path.exists("/dev/net/tun"):
        raise EmulationUnavailable("the WAN emulation needs /dev/net/tun")


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(netns: str) -> Iterator[None]:
    """Runs the block with the calling thread in network namespace ``netns``.

    Sockets and TUN fds opened in the block stay in that namespace after it.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


def read_counters(path: str) -> list[int]:
    """Bytes each host has sent so far, from the switch's counter file."""
    with open(path, "rb") as f:
        data = f.read()
    return list(struct.unpack(f"<{len(data) // 8}Q", data))


def interface_tx_bytes(device: str = DEVICE) -> int:
    """Bytes the kernel says ``device`` of the caller's namespace has sent (its interface counter).

    A process started with ``ip netns exec`` sees its namespace's own /sys, so a rank reads its
    host's uplink: an account of the wire kept by the kernel, apart from the switch's. With
    offload it counts one IP and TCP header per offloaded packet, a few percent under the wire."""
    with open(f"/sys/class/net/{device}/statistics/tx_bytes") as f:
        return int(f.read())


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def _open_tun(netns: str, offload: bool) -> int:
    """Attaches to ``DEVICE`` in ``netns``; returns a non-blocking fd of IP packets.

    With ``offload``, each packet comes after a virtio_net_hdr, and the device takes TCP
    segmentation offload: the kernel hands the switch TCP packets of up to 64 KiB that stand for
    several MTU-sized segments (the header says the segment size), as a NIC with TSO gets them.
    """
    with in_netns(netns):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        try:
            flags = _IFF_TUN | _IFF_NO_PI | (_IFF_VNET_HDR if offload else 0)
            fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", DEVICE.encode(), flags))
            if offload:
                fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6)
        except OSError:
            os.close(fd)
            raise
    return fd


def wire_bytes(packet: bytes, header: int) -> int:
    """The bytes ``packet`` (after ``header`` bytes of virtio_net_hdr) takes on a wire of its segments.

    A TSO packet is one IP and TCP header over the payload of ceil(payload / gso_size) segments;
    on the wire each segment carries the headers again. The header length is read from the IP
    and TCP headers themselves (the virtio header's hdr_len may include payload).
    """
    ip = packet[header:]
    if header == 0 or packet[1] == 0:  # no offload, or gso_type NONE: one packet
        return len(ip)
    gso_size = int.from_bytes(packet[4:6], "little")
    ihl = (ip[0] & 0x0F) * 4
    headers = ihl + (ip[ihl + 12] >> 4) * 4
    payload = len(ip) - headers
    segments = max(1, -(-payload // gso_size)) if gso_size else 1
    return len(ip) + (segments - 1) * headers


def _switch_main(hosts: Sequence[Host], delay_s: float, counters_path: str, offload: bool, ready: EventType) -> None:
    """The switch process: forwards packets between the hosts' TUN fds after ``delay_s``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent cleans up and terminates this process
    os.setpriority(os.PRIO_PROCESS, 0, _SWITCH_NICE)
    fds = [_open_tun(h.netns, offload) for h in hosts]
    routes = {socket.inet_aton(h.address): fd for h, fd in zip(hosts, fds, strict=True)}
    with open(counters_path, "r+b") as f, mmap.mmap(f.fileno(), 8 * len(hosts)) as counters:
        ready.set()
        _forward(fds, routes, delay_s, counters, _VNET_HDR if offload else 0)


def _forward(fds: list[int], routes: Mapping[bytes, int], delay_s: float, counters: mmap.mmap, header: int) -> None:
    """Runs the delay line forever. Constant delay keeps packets in arrival order: a FIFO suffices."""
    selector = selectors.DefaultSelector()
    for index, fd in enumerate(fds):
        selector.register(fd, selectors.EVENT_READ, index)
    line: deque[tuple[float, int, bytes]] = deque()
    sent = [0] * len(fds)
    while True:
        timeout = max(0.0, line[0][0] - time.monotonic()) if line else None
        for key, _ in selector.select(timeout):
            source = key.data
            while True:
                try:
                    packet = os.read(key.fd, _READ_BYTES)
                except BlockingIOError:
                    break
                ip = header
                target = routes.get(packet[ip + 16:ip + 20]) if packet[ip] >> 4 == 4 else None
                if target is None:
                    continue  # not IPv4 (IPv6 router solicitations), or outside the emulated hosts
                line.append((time.monotonic() + delay_s, target, packet))
                sent[source] += wire_bytes(packet, header)
                struct.pack_into("<Q", counters, 8 * source, sent[source])
        now = time.monotonic()
        while line and line[0][0] <= now:
            _, target, packet = line.popleft()
            os.write(target, packet)


class Wan:
    """Hosts in network namespaces, each behind a ``rate_mbit`` uplink, ``delay_ms`` apart one way.

    Use as a context manager; on exit (error and KeyboardInterrupt included) the switch stops and
    the namespaces are deleted, after killing any process still running in them.
    """

    def __init__(self, hosts: int, *, delay_ms: float, rate_mbit: float, mtu: int = 1500, offload: bool = True) -> None:
        tag = secrets.token_hex(3)
        self.hosts = [Host(i, f"rsw-h{i}-{tag}", f"{SUBNET}.{i + 1}") for i in range(hosts)]
        self.delay_ms = delay_ms
        self.rate_mbit = rate_mbit
        self.mtu = mtu
        self.offload = offload
        self.counters_path = ""  # the switch's counter file (see read_counters), once entered
        self._tmp: str | None = None
        self._made: list[str] = []
        self._switch: multiprocessing.process.BaseProcess | None = None

    def __enter__(self) -> Wan:
        check_environment()
        try:
            for host in self.hosts:
                self._make_host(host)
            self._start_switch()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _make_host(self, host: Host) -> None:
        _run("ip", "netns", "add", host.netns)
        self._made.append(host.netns)
        for args in (("link", "set", "lo", "up"),
                     ("tuntap", "add", "dev", DEVICE, "mode", "tun"),
                     ("link", "set", DEVICE, "mtu", str(self.mtu)),
                     ("addr", "add", f"{host.address}/24", "dev", DEVICE),
                     ("link", "set", DEVICE, "up")):
            _run("ip", "-n", host.netns, *args)
        _run("tc", "-n", host.netns, "qdisc", "add", "dev", DEVICE, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
             "burst", str(max(2 * self.mtu, _GSO_BURST) if self.offload else 2 * self.mtu),
             "latency", f"{TBF_LATENCY_MS}ms")

    def _start_switch(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix="rsw-")
        self.counters_path = os.path.join(self._tmp, "counters")
        with open(self.counters_path, "wb") as f:
            f.write(bytes(8 * len(self.hosts)))
        context = multiprocessing.get_context("spawn")
        ready = context.Event()
        self._switch = context.Process(target=_switch_main, name="rsw-switch", daemon=True,
                                       args=(self.hosts, self.delay_ms / 1e3, self.counters_path, self.offload, ready))
        self._switch.start()
        deadline = time.monotonic() + 30
        while not ready.wait(0.1):
            if not self._switch.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the TUN switch did not start (see its traceback above, if any)")

    def close(self) -> None:
        """Stops the switch and deletes the namespaces; safe to call more than once."""
        if self._switch is not None and self._switch.pid is not None:  # a switch that failed to start has none
            self._switch.terminate()
            self._switch.join(5)
            if self._switch.is_alive():
                self._switch.kill()
                self._switch.join(5)
        self._switch = None
        while self._made:
            netns = self._made.pop()
            _kill_processes_in(netns)
            _run("ip", "netns", "delete", netns)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def check_switch(self) -> None:
        """Raises if the switch process has died."""
        if self._switch is None or not self._switch.is_alive():
            raise RuntimeError("the TUN switch is not running")

    def sent_bytes(self) -> list[int]:
        """IP bytes each host has sent so far."""
        return read_counters(self.counters_path)

    @staticmethod
    def command(host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
        """``argv`` run in ``host``'s namespace, with ``env`` added to the environment it inherits."""
        prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
        return ["ip", "netns", "exec", host.netns, *prefix, *argv]

    def wait_listening(self, host: Host, port: int, timeout_s: float) -> None:
        """Waits until something in ``host`` accepts TCP connections on ``port`` (its address)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with in_netns(host.netns), socket.create_connection((host.address, port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nothing listens on {host.address}:{port} after {timeout_s} s") from None
                time.sleep(0.1)

def _kill_processes_in(netns: str) -> None:
    """Kills, by pid, the processes left in ``netns`` (the benchmark's own, started there)."""
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30)
    for pid in done.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
