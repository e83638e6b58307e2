"""The worker processes of ``ringserve run``: local children, and remote ones under ssh.

Both kinds answer the same calls (``poll``, ``terminate``, ``begin_stop``/``finish_stop``), copy
their output to the launcher's with a ``[rank]`` prefix, and describe their own failure in a
sentence that names the rank and, in a run over several hosts, the host.

A remote worker is ``ssh host 'python -c <launch/remote.py>'`` with the job on its stdin (see
launch.remote for why a wrapper and not ``ssh -tt``). ssh runs without a terminal, never asks
for a password (BatchMode), accepts the key of a host it has never seen but refuses a changed
one (``StrictHostKeyChecking=accept-new``: horovodrun's ``no`` would accept a changed key too),
gives up connecting after the start timeout, and notices a vanished host within 15 s
(ServerAliveInterval 5 s, 3 misses).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ringserve.constants import REMOTE_START_TIMEOUT_S
from ringserve.launch.remote import MARK

# Not forwarded to other hosts: the login session's own identity and terminal (the remote login
# has its own), what horovodrun also drops (bash functions, OLDPWD, CUDA_VISIBLE_DEVICES: each
# host has its own devices), and what the launcher sets for each worker.
NOT_FORWARDED = re.compile(
    r"^(BASH_FUNC_.*|OLDPWD|PWD|SHLVL|_|HOSTNAME|HOME|USER|LOGNAME|MAIL|SHELL|DISPLAY|XAUTHORITY"
    r"|SSH_.*|TMUX|TMUX_PANE|STY|WINDOW|.*CUDA_VISIBLE_DEVICES"
    r"|RINGSERVE_(COORDINATOR|RANK_HINT|HOSTNAME|BIND_HOST|ADVERTISE_HOST)"
    r"|HOROVOD_(RANK|SIZE|LOCAL_RANK|LOCAL_SIZE|CROSS_RANK|CROSS_SIZE|HOSTNAME))$"
)
RESOLVE_TIMEOUT_S = 2.0
TAIL_LINES = 5
START_MARGIN_S = 2.0
PUMP_DRAIN_S = 5.0  # how long, after the workers stopped, their output may take to be copied out


def forwarded_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables a remote worker gets from the launcher's environment (see NOT_FORWARDED)."""
    return {k: v for k, v in env.items() if not NOT_FORWARDED.match(k)}


def _resolve(name: str) -> list[str]:
    found: list[str] = []

    def look() -> None:
        with contextlib.suppress(OSError, UnicodeError):
            found.extend(str(info[4][0]) for info in socket.getaddrinfo(name, None))

    thread = threading.Thread(target=look, daemon=True)  # a dead DNS server must not hang the launch
    thread.start()
    thread.join(RESOLVE_TIMEOUT_S)
    return list(found)


def _is_own_address(address: str) -> bool:
    if address.startswith("127.") or address == "::1":
        return True
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((address, 0))  # only an address of one of this host's interfaces binds
        return True
    except OSError:
        return False


def is_local_host(name: str) -> bool:
    """Whether ``name`` is this host: localhost, 127.0.0.1, this host's name, or a name that
    resolves to an address of one of its interfaces. ``user@host`` is never local (it asks for
    another login)."""
    if "@" in name:
        return False
    bare = name.strip("[]")
    if bare in ("localhost", "127.0.0.1", "::1", socket.gethostname()):
        return True
    return any(_is_own_address(a) for a in _resolve(bare))


def guess_own_address(hosts: Sequence[str]) -> str:
    """An address of this host for workers elsewhere to dial, when no remote worker has told us
    one: the source of the route to the first of ``hosts`` that resolves, else this host's name's."""
    for host in hosts:
        for address in _resolve(host.rsplit("@", 1)[-1].strip("[]")):
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            try:
                with socket.socket(family, socket.SOCK_DGRAM) as probe:
                    probe.connect((address, 9))  # UDP: picks the route, sends nothing
                    own = str(probe.getsockname()[0])
                return f"[{own}]" if ":" in own else own
            except OSError:
                continue
    return socket.gethostbyname(socket.gethostname())


@dataclass(frozen=True, kw_only=True)
class SshSettings:
    """How remote workers are reached (horovodrun's -p, -i, and its start timeout).

    Attributes:
        port: the ssh port on every host (-p); None: ssh's default or the ssh config's.
        identity_file: the private key to log in with (-i); empty: ssh's defaults.
        config_file: an ssh config file used instead of ~/.ssh/config (ssh -F); empty: the usual.
        start_timeout_s: a remote worker that has not started within this fails the run (ssh's
            ConnectTimeout is the same).
        ping_interval_s: how often the launcher tells each remote wrapper it is alive.
        ping_timeout_s: a remote wrapper that heard nothing for this long stops its worker.
        python: the interpreter that runs the wrapper on the remote host (python3 where it is
            missing); the worker's own command is the user's, found on the forwarded PATH.
    """

    port: int | None = None
    identity_file: str = ""
    config_file: str = ""
    start_timeout_s: float = REMOTE_START_TIMEOUT_S
    ping_interval_s: float = 2.0
    ping_timeout_s: float = 20.0
    python: str = sys.executable

    def argv(self, host: str) -> list[str]:
        options = ["BatchMode=yes", "StrictHostKeyChecking=accept-new", "LogLevel=ERROR",
                   f"ConnectTimeout={max(1, math.ceil(self.start_timeout_s))}",
                   "ServerAliveInterval=5", "ServerAliveCountMax=3"]
        argv = ["ssh", "-T", "-x", "-a"]
        for option in options:
            argv += ["-o", option]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file:
            argv += ["-i", self.identity_file]
        if self.config_file:
            argv += ["-F", self.config_file]
        source = Path(__file__).with_name("remote.py").read_text()
        python = shlex.quote(self.python)
        remote = f"PY={python}; [ -x \"$PY\" ] || PY=python3; exec \"$PY\" -c {shlex.quote(source)}"
        return [*argv, host, remote]


def pump(stream: IO[bytes], prefix: bytes, out: IO[bytes], lock: threading.Lock,
         saw: Callable[[bytes], None] | None = None) -> None:
    """Copies a child's output line by line, each line (and each carriage-return redraw, as a
    progress bar makes) prefixed with the rank; whole lines only, so ranks never interleave.

    A redraw starts with a carriage return (tqdm writes ``"\rbar"``), which alone would make a
    line of its own: it is dropped, as every line written here ends where the next one begins.
    Kept, it made ``[0] \r[0] bar``, which a log shows as ``[0] [0] bar``."""
    pending = b""
    while True:
        data = os.read(stream.fileno(), 65536)
        if not data:
            break
        parts = (pending + data).splitlines(keepends=True)
        pending = parts.pop() if not parts[-1].endswith((b"\n", b"\r")) else b""
        if parts:
            with lock:
                out.write(b"".join(prefix + part for part in parts if part != b"\r"))
                out.flush()
            if saw is not None:
                saw(parts[-1])
    if pending:
        if saw is not None:
            saw(pending)
        with lock:
            out.write(prefix + pending + b"\n")
            out.flush()
    stream.close()


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(code - 128).name
    except ValueError:
        return ""


def describe_exit(label: str, code: int) -> str:
    name = _signal_name(code) if code > 128 else ""
    return f"{label} was killed by {name} (exit code {code})" if name else f"{label} exited with code {code}"


class Proc:
    """What the launcher knows of one worker, wherever it runs."""

    def __init__(self, index: int, host: str, local: int, label: str) -> None:
        self.index = index
        self.key = (host, local)
        self.host = host
        self.label = label  # "rank 3" or "rank 3 on host-b": the rank it started with
        self.pumps: list[threading.Thread] = []
        self.started_at = time.monotonic()
        self._last = b""

    @property
    def last_line(self) -> str:
        """The last line it wrote (an error's last line, when it died of one)."""
        return self._last.decode(errors="replace").strip()

    def _saw(self, line: bytes) -> None:
        if line.strip():
            self._last = line

    def _pump(self, stream: IO[bytes] | None, sink: IO[bytes], lock: threading.Lock) -> None:
        assert stream is not None
        thread = threading.Thread(target=pump, args=(stream, f"[{self.index}] ".encode(), sink, lock, self._saw),
                                  daemon=True)
        thread.start()
        self.pumps.append(thread)

    def poll(self) -> int | None:
        raise NotImplementedError

    def reason(self) -> str:
        """Why it ended, in a sentence naming the rank (and host); once poll gave a code."""
        raise NotImplementedError

    def terminate(self) -> None:
        """SIGTERM: an elastic worker leaves at its next commit."""
        raise NotImplementedError

    def begin_stop(self) -> None:
        raise NotImplementedError

    def finish_stop(self, deadline: float) -> None:
        raise NotImplementedError

    def join_pumps(self, deadline: float) -> None:
        """Waits until ``deadline`` (time.monotonic) at most for the output to be copied out."""
        for thread in self.pumps:
            thread.join(max(0.0, deadline - time.monotonic()))


class LocalProc(Proc):
    def __init__(self, index: int, host: str, local: int, label: str, argv: Sequence[str],
                 env: Mapping[str, str], sink: IO[bytes], lock: threading.Lock) -> None:
        super().__init__(index, host, local, label)
        self.popen = subprocess.Popen(
            list(argv), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        self._pump(self.popen.stdout, sink, lock)

    def poll(self) -> int | None:
        code = self.popen.poll()
        return None if code is None else (code if code >= 0 else 128 - code)

    def reason(self) -> str:
        code = self.poll()
        assert code is not None
        return describe_exit(self.label, code)

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def begin_stop(self) -> None:
        if self.popen.poll() is None:
            self._signal(signal.SIGTERM)

    def finish_stop(self, deadline: float) -> None:
        try:
            self.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.popen.wait()


class RemoteProc(Proc):
    """A worker on another host, under ssh and launch.remote's wrapper."""

    def __init__(self, index: int, host: str, local: int, label: str, argv: Sequence[str],
                 env: Mapping[str, str], *, cwd: str, coordinator_port: int, coordinator_host: str,
                 ssh: SshSettings, grace_s: float, sink: IO[bytes], lock: threading.Lock) -> None:
        super().__init__(index, host, local, label)
        self.ssh = ssh
        self.started = threading.Event()
        self.client = ""  # the launching host's address, as the remote host saw it
        self.remote_pid = 0
        self._reported: int | None = None
        self._timed_out = False
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._stdin_lock = threading.Lock()
        self._sink, self._lock = sink, lock
        self.ssh_argv = ssh.argv(host)
        self.popen = subprocess.Popen(
            self.ssh_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C reaches the launcher, which stops the workers in order
        )
        self.spawned_at = time.monotonic()
        job = {"argv": list(argv), "env": dict(env), "cwd": cwd, "coordinator_port": coordinator_port,
               "coordinator_host": coordinator_host, "grace_s": grace_s, "ping_timeout_s": ssh.ping_timeout_s}
        self._write(json.dumps(job) + "\n")
        self._pump(self.popen.stdout, sink, lock)
        self._stderr = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr.start()

    def _write(self, text: str) -> None:
        with self._stdin_lock:
            stdin = self.popen.stdin
            if stdin is None or stdin.closed:
                return
            try:
                stdin.write(text.encode())
                stdin.flush()
            except (OSError, ValueError):
                pass  # ssh is gone; poll says why

    def _read_stderr(self) -> None:
        assert self.popen.stderr is not None
        for raw in self.popen.stderr:
            line = raw.decode(errors="replace").rstrip("\r\n")
            if line.startswith(MARK):
                self._protocol(line[len(MARK):].split())
                continue
            self._tail.append(line)
            with self._lock:
                self._sink.write(f"[{self.index}] {line}\n".encode())
                self._sink.flush()

    def _protocol(self, words: list[str]) -> None:
        if words[:1] == ["started"]:
            fields = dict(w.split("=", 1) for w in words[1:] if "=" in w)
            self.remote_pid = int(fields.get("pid", "0"))
            self.client = fields.get("client", "")
            self.started.set()
        elif words[:1] == ["exit"] and len(words) == 2:
            self._reported = int(words[1])
        elif words[:1] == ["signal"] and len(words) == 2:
            self._reported = 128 + int(words[1])

    def ping(self) -> None:
        self._write("ping\n")

    def poll(self) -> int | None:
        code = self.popen.poll()
        if code is None:
            # ssh's own ConnectTimeout (the same) says more about an unreachable host: let it speak first.
            if self.started.is_set() or time.monotonic() - self.spawned_at < self.ssh.start_timeout_s + START_MARGIN_S:
                return None
            self._timed_out = True
            self._kill_ssh()
            self.popen.wait()
        self._stderr.join(2.0)  # the wrapper's last line comes just before ssh's exit
        if self._reported is not None:
            return self._reported
        if self._timed_out or code is None or code <= 0:
            return 255  # ssh's own failure code, also when ssh was killed or ended without a word
        return code

    def reason(self) -> str:
        code = self.poll()
        assert code is not None
        tail = "; ".join(line for line in self._tail if line.strip())
        said = f": {tail}" if tail else ""
        if self._reported is not None:
            return describe_exit(self.label, code)
        if self._timed_out:
            return f"{self.label}: ssh to {self.host} did not start the worker within {self.ssh.start_timeout_s:g} s{said}"
        if not self.started.is_set():
            return f"{self.label}: ssh to {self.host} failed (exit code {code}){said}"
        return f"{self.label}: lost the ssh connection to {self.host} (exit code {code}){said}"

    def terminate(self) -> None:
        self._write("term\n")

    def begin_stop(self) -> None:
        # EOF on the wrapper's stdin: it stops the worker (SIGTERM, SIGKILL after the grace).
        with self._stdin_lock:
            if self.popen.stdin is not None and not self.popen.stdin.closed:
                with contextlib.suppress(OSError):
                    self.popen.stdin.close()

    def finish_stop(self, deadline: float) -> None:
        # The wrapper's own SIGKILL comes at the grace; leave it a moment to say so and exit.
        try:
            self.popen.wait(max(0.0, deadline + 3.0 - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._kill_ssh()
            self.popen.wait()

    def _kill_ssh(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)


def stop_all(procs: Sequence[Proc], grace_s: float) -> None:
    """Stops every worker still running: SIGTERM, SIGKILL after the grace, local and remote alike."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.begin_stop()
    deadline = time.monotonic() + grace_s
    for p in running:
        p.finish_stop(deadline)
    # One deadline for every pump: a pump that never sees EOF (a pipe some grandchild still
    # holds) costs the launcher's exit PUMP_DRAIN_S at most, not that much per pump.
    drained = time.monotonic() + PUMP_DRAIN_S
    for p in procs:
        p.join_pumps(drained)
