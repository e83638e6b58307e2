"""Benchmark results as JSON, with the machine and the date of the run, for benchmarks/plots.py.

Each benchmark's ``--json PATH`` writes one object::

    {"benchmark": "allreduce", "date": "2026-12-03T08:10:00+00:00", "argv": [...],
     "machine": {"cores": 2, "cpu": "...", "memory_gib": 23.4, "load_average": [5.1, 6.0, 6.2], ...},
     "rows": [...the rows of the table it prints...], ...extra fields}

The rows are the printed table's, values as printed (strings where the table formats them), so that
the JSON and the table never disagree. The load average at the end of the run says how quiet the
machine was: on a shared machine the figures move with it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pathlib
import platform
import sys
from collections.abc import Mapping, Sequence
from typing import Any


def machine() -> dict[str, Any]:
    """What the figures were measured on: cores, CPU model, memory, load average, Python."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = 0.0
    with contextlib.suppress(ValueError, OSError):
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return {"cores": os.cpu_count(), "cpu": cpu, "memory_gib": round(memory_gib, 1),
            "load_average": [round(x, 1) for x in os.getloadavg()], "platform": platform.platform(),
            "python": platform.python_version()}


def save(path: str | os.PathLike[str], benchmark: str, rows: Sequence[Mapping[str, object]],
         **extra: object) -> None:
    """Writes a benchmark's rows and the run's circumstances to ``path`` (its directory is made)."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": benchmark, "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "argv": sys.argv, "machine": machine(), "rows": [dict(r) for r in rows], **extra}
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"results written to {out}")
