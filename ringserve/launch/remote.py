"""The remote end of ``ringserve run`` on another host: one worker under ssh that dies with its session.

``ringserve run`` sends this file's source over ssh as ``python -c`` (so it needs nothing but the
standard library on the remote host, and imports nothing from ringserve), then writes one line of
JSON to its stdin: the command, the environment, the working directory and the coordinator's port.
The environment travels on stdin rather than on the command line, so that the job token and the
user's variables never show in ``ps`` on either host.

It then starts the worker in a process group of its own, with stdout and stderr on its own stdout
(the ssh channel: the launcher prefixes each line with the rank), and keeps its own stderr for a
small protocol with the launcher, lines starting with ``MARK``:

- ``started pid=<pid> client=<address>``: the worker runs; ``client`` is the launching host's
  address as this host sees it (from ``SSH_CONNECTION``). The worker dials the coordinator there,
  unless the launcher named an address.
- ``exit <code>``: the worker ended with that code; ``signal <n>``: signal ``n`` killed it.

Why not ``ssh -tt``: a pty would merge stderr into stdout, turn newlines into CRLF, and stop the
worker only with a hangup it may ignore. Here the worker is stopped whenever the session goes:

- stdin reaches EOF (the launcher exited, was killed, or closed it on purpose: ssh ends the remote
  stdin when its own ends): SIGTERM to the worker's group, SIGKILL after the grace;
- no ``ping`` line from the launcher for ``ping_timeout_s`` (the launching host vanished without
  closing the connection): the same;
- this wrapper dies abruptly: the worker gets SIGKILL from the kernel (PR_SET_PDEATHSIG, Linux).

A ``term`` line sends SIGTERM only (an elastic worker then leaves at its next commit).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

MARK = "@ringserve-remote "


def _say(text: str) -> None:
    try:
        sys.stderr.write(MARK + text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # the session is gone; the launcher learns that from ssh's exit


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _client_address(env: dict[str, str]) -> str:
    """The launching host's address as the ssh server saw the connection come from it."""
    fields = env.get("SSH_CONNECTION", "").split()
    if not fields:
        return ""
    return f"[{fields[0]}]" if ":" in fields[0] else fields[0]


class _Worker:
    def __init__(self, proc: subprocess.Popen[bytes], grace_s: float) -> None:
        self.proc = proc
        self.grace_s = grace_s
        self.stopping = threading.Event()

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGTERM to the group, then SIGKILL after the grace; once."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(self.grace_s)
        self.signal(signal.SIGKILL)


def _listen(worker: _Worker, ping_timeout_s: float) -> None:
    """Reads the launcher's lines; a closed stdin, or pings that stop coming, stop the worker."""
    last_ping = [time.monotonic()]

    def watchdog() -> None:
        while worker.proc.poll() is None and not worker.stopping.is_set():
            if time.monotonic() - last_ping[0] > ping_timeout_s:
                sys.stderr.write(f"ringserve: no word from the launcher for {ping_timeout_s:g} s; stopping the worker\n")
                worker.stop()
                return
            time.sleep(0.5)

    threading.Thread(target=watchdog, daemon=True).start()
    for line in sys.stdin:
        word = line.strip()
        last_ping[0] = time.monotonic()
        if word == "term":
            worker.signal(signal.SIGTERM)
    worker.stop()


def main() -> int:
    spec = json.loads(sys.stdin.readline() or "null")
    if not isinstance(spec, dict):
        sys.stderr.write("ringserve: the launcher sent no job\n")
        return 2
    env = {**os.environ, **spec["env"]}
    client = _client_address(env)
    host = spec.get("coordinator_host") or client
    env["RINGSERVE_COORDINATOR"] = f"{host}:{spec['coordinator_port']}"
    env.pop("SSH_CONNECTION", None)
    env.pop("SSH_CLIENT", None)
    try:
        os.chdir(spec["cwd"])
    except OSError as exc:
        sys.stderr.write(f"ringserve: cannot enter {spec['cwd']!r} here ({exc.strerror}); running in {os.getcwd()!r}\n")
    try:
        proc = subprocess.Popen(
            spec["argv"], env=env, stdin=subprocess.DEVNULL, stdout=sys.stdout.fileno(),
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,  # noqa: PLW1509 (this wrapper starts no thread before it)
        )
    except OSError as exc:
        sys.stderr.write(f"ringserve: cannot start {spec['argv'][0]!r}: {exc.strerror}\n")
        _say("exit 127")
        return 127
    worker = _Worker(proc, float(spec.get("grace_s", 5.0)))
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: threading.Thread(target=worker.stop, daemon=True).start())
    _say(f"started pid={proc.pid} client={client}")
    threading.Thread(target=_listen, args=(worker, float(spec.get("ping_timeout_s", 20.0))), daemon=True).start()
    code = proc.wait()
    worker.signal(signal.SIGKILL)  # whatever the worker left in its group (data loaders) goes with it
    _say(f"exit {code}" if code >= 0 else f"signal {-code}")
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
