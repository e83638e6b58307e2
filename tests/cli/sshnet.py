"""A small network of hosts for the multi-host launcher tests, made of network namespaces.

One namespace is the launching host; each other one is a host with a real sshd of its own (a
host key and an authorized key made by the test, listening only on its own address inside its
namespace). All are joined by a bridge inside the launching host's namespace, so nothing of the
machine's own network changes, and every namespace is removed at the end.

    launching host  10.77.0.1   (the launcher, its coordinator, and the workers of "localhost")
    host-a          10.77.0.11  sshd on 2222
    host-b          10.77.0.12  sshd on 2222
    host-c          10.77.0.13  the host is up, its sshd is not (connection refused)
    host-d          10.77.0.14  nothing answers: a neighbour entry to a MAC no one has swallows
                                every packet, so a connection times out

ssh finds the names through an ssh config file of the test's (``--ssh-config-file``), which also
keeps the host keys out of ~/.ssh/known_hosts.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SSH_PORT = 2222
SUBNET = "10.77.0"
HOSTS = {"host-a": f"{SUBNET}.11", "host-b": f"{SUBNET}.12", "host-c": f"{SUBNET}.13"}
UNREACHABLE = ("host-d", f"{SUBNET}.14")
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
HAVE_ROOT = os.geteuid() == 0 and shutil.which("ip") is not None
NO_ROOT = "needs root and iproute2 to make the test's own network namespaces"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Cluster:
    tag: str
    root: Path
    launcher_ns: str
    namespaces: dict[str, str] = field(default_factory=dict)
    sshds: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def key(self) -> Path:
        return self.root / "id_ed25519"

    @property
    def ssh_config(self) -> Path:
        return self.root / "ssh_config"

    def ssh_flags(self) -> list[str]:
        """The launcher's ssh flags for this network: horovodrun's -p and -i, and the config."""
        return ["-p", str(SSH_PORT), "-i", str(self.key), "--ssh-config-file", str(self.ssh_config)]

    def launcher(self, args: Sequence[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
                 ) -> subprocess.Popen[bytes]:
        """``ringserve <args>`` on the launching host; its output on stdout and stderr pipes."""
        argv = ["ip", "netns", "exec", self.launcher_ns, sys.executable, "-m", "ringserve.cli", *args]
        return subprocess.Popen(argv, cwd=cwd, env={**os.environ, **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_as_from_a_terminal)  # noqa: PLW1509 (the test starts no thread before)

    def run(self, args: Sequence[str], *, timeout: float, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return self.timed_run(args, timeout=timeout, cwd=cwd, env=env)[0]

    def timed_run(self, args: Sequence[str], *, timeout: float, cwd: Path | None = None,
                  env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
        """Runs the launcher to its end; also returns the seconds from its first note (its
        coordinator is up: Python's start-up, slow on a loaded machine, is behind it) to its exit."""
        proc = self.launcher(args, cwd=cwd, env=env)
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            up = time.monotonic()
            out, err = proc.communicate(timeout=timeout)
            seconds = time.monotonic() - up
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return subprocess.CompletedProcess(proc.args, proc.returncode, (first + out).decode(errors="replace"),
                                           err.decode(errors="replace")), seconds

    def start_sshd(self, host: str) -> None:
        ns, address = self.namespaces[host], HOSTS[host]
        config = self.root / f"sshd_{host}.conf"
        pidfile = self.root / f"sshd_{host}.pid"
        pidfile.unlink(missing_ok=True)
        config.write_text(
            f"ListenAddress {address}:{SSH_PORT}\n"
            f"HostKey {self.root / 'host_key'}\n"
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}\n"
            f"PidFile {pidfile}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nStrictModes no\nPrintMotd no\nPrintLastLog no\nUseDNS no\nMaxStartups 64\n"
            "LogLevel ERROR\n"
        )
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        # Its log goes to a file, read only if it does not start: a pipe nobody reads could fill
        # (and reading one to its end would wait for an sshd that is still up).
        log = self.root / f"sshd_{host}.log"
        with log.open("wb") as sink:
            self.sshds[host] = subprocess.Popen(["ip", "netns", "exec", ns, SSHD, "-D", "-e", "-f", str(config)],
                                                stdout=subprocess.DEVNULL, stderr=sink)
        deadline = time.monotonic() + 10
        while not pidfile.exists():  # sshd writes it once it listens
            if self.sshds[host].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {host} did not start: {log.read_text(errors='replace')}")
            time.sleep(0.05)

    def stop_sshd(self, host: str) -> None:
        proc = self.sshds.pop(host, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)

    def close(self) -> None:
        for host in list(self.sshds):
            self.stop_sshd(host)
        for ns in [*self.namespaces.values(), self.launcher_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def make_cluster(root: Path, *, with_sshd: Sequence[str] = ("host-a", "host-b")) -> Iterator[Cluster]:
    """Builds the network (see the module docstring), checks that ssh reaches every host that
    has an sshd, yields it, and takes it all down."""
    if shutil.which("ssh") is None or not os.path.exists(SSHD):
        raise RuntimeError("ssh and sshd are needed (openssh-client, openssh-server: scripts/setup.sh installs "
                           "them when run as root)")
    tag = uuid.uuid4().hex[:6]
    cluster = Cluster(tag=tag, root=root, launcher_ns=f"rs-lh-{tag}")
    try:
        ip("netns", "add", cluster.launcher_ns)
        lns = cluster.launcher_ns
        ip("-n", lns, "link", "set", "lo", "up")
        ip("-n", lns, "link", "add", "br0", "type", "bridge")
        ip("-n", lns, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
        ip("-n", lns, "link", "set", "br0", "up")
        for i, (host, address) in enumerate(HOSTS.items()):
            ns = f"rs-{host[-1]}-{tag}"
            ip("netns", "add", ns)
            cluster.namespaces[host] = ns
            inner, outer = f"v{tag}{i}", f"p{tag}{i}"
            ip("link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", lns)
            ip("-n", lns, "link", "set", outer, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", lns, "neigh", "add", UNREACHABLE[1], "lladdr", "02:00:00:00:77:14", "dev", "br0", "nud", "permanent")
        for name in ("host_key", "id_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True,
                           timeout=30)
        (root / "authorized_keys").write_text((root / "id_ed25519.pub").read_text())
        names = {**HOSTS, UNREACHABLE[0]: UNREACHABLE[1]}
        cluster.ssh_config.write_text(
            "".join(f"Host {h}\n    HostName {a}\n" for h, a in names.items())
            + f"Host *\n    User root\n    UserKnownHostsFile {root / 'known_hosts'}\n"
        )
        for host in with_sshd:
            cluster.start_sshd(host)
        for host in with_sshd:  # the whole path works before any test relies on it
            subprocess.run(["ip", "netns", "exec", lns, "ssh", "-F", str(cluster.ssh_config), "-i", str(cluster.key),
                            "-p", str(SSH_PORT), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                            host, "true"], check=True, capture_output=True, timeout=30)
        yield cluster
    finally:
        cluster.close()


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line holds ``marker`` (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


def _as_from_a_terminal() -> None:
    """SIGINT at its default in the launcher, as in a shell's foreground job.

    A shell without job control starts a background job (``.ci/run &``, a CI runner's step) with
    SIGINT ignored, every process below it inherits that, and Python leaves an inherited SIG_IGN
    alone: the launcher would never see the Ctrl-C a test sends it.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
