"""Helpers shared by the benchmarks: free ports, child processes, and table printing."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(argv_for_rank: Sequence[Sequence[str]], env: dict[str, str], timeout_s: float) -> None:
    """Starts one process per rank and waits for all; raises if any fails or runs past timeout_s."""
    procs = [subprocess.Popen(list(argv), env={**os.environ, **env, "RINGSERVE_RANK_HINT": str(i)})
             for i, argv in enumerate(argv_for_rank)]
    wait_all(procs, timeout_s)


def wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Waits for every process, all within ``timeout_s``; raises if one fails, and kills the rest."""
    deadline = time.monotonic() + timeout_s
    try:
        for i, p in enumerate(procs):
            if p.wait(max(1.0, deadline - time.monotonic())) != 0:
                raise RuntimeError(f"benchmark rank {i} exited with code {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Ends a server process: SIGTERM, then SIGKILL if it has not exited within ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def table(rows: list[dict[str, object]], columns: Sequence[tuple[str, str]]) -> str:
    widths = [max(len(title), *(len(str(r[key])) for r in rows)) for key, title in columns]
    lines = ["| " + " | ".join(t.ljust(w) for (_, t), w in zip(columns, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(r[k]).rjust(w) for (k, _), w in zip(columns, widths, strict=True)) + " |")
    return "\n".join(lines)


PYTHON = sys.executable
# The environment of a coordinator that a benchmark starts in network namespaces of its own, off
# loopback, without a token: open, by name (ringserve.config.secured_job refuses it otherwise).
OPEN_COORDINATOR = {"RINGSERVE_INSECURE": "1"}
