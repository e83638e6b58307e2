"""A chaos job's worker (benchmarks/chaos.py): sets up the process, then becomes CHAOS_WORKER.

With CHAOS_LANE set, the worker is a host of its own (a hostname of its own, so its payloads cross
the TCP payload lane rather than shared memory), and its payload lane listens on a port chosen
here and written, with the pid, to CHAOS_PORTS: the campaign resets that port's sockets.
"""

from __future__ import annotations

import os
import socket
import sys

if os.environ.get("CHAOS_LANE"):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ["RINGSERVE_PAYLOAD_PORT"] = str(port)
    os.environ["RINGSERVE_HOSTNAME"] = f"chaos-host-{os.getpid()}"
    with open(os.environ["CHAOS_PORTS"], "a", encoding="utf-8") as ports:
        ports.write(f"{os.getpid()} {port}\n")
os.execv(sys.executable, [sys.executable, os.environ["CHAOS_WORKER"], *sys.argv[1:]])
