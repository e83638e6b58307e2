"""What a worker counts and records: counters, latency histograms by op, and the timeline.

Counting is plain attribute arithmetic on the data path; Prometheus reads the numbers only when it
scrapes (see metrics.py). The timeline writes Chrome trace events (chrome://tracing, Perfetto):
one complete event per collective and one per phase (waiting for the peers, reduce-scatter,
allgather, ...), with the bytes each moved.
"""

from __future__ import annotations

import json
import os
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import IO, Any

from ringserve.atomic import write_atomic

# Upper bounds, in seconds, of the latency buckets (Prometheus adds +Inf).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class Latency:
    """A cumulative-bucket histogram of one op's latency."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    count: int = 0
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.count += 1
        self.total_s += seconds


@dataclass
class Counters:
    """A worker's counters; the data path adds to them, heartbeats and scrapes read them."""

    collectives_done: int = 0
    bytes_sent: int = 0  # payloads and headers, over the stream or through shared memory
    frames_sent: int = 0  # DATA frames sent to the ring successor (bytes_sent / frames_sent: a frame's mean size)
    shared_bytes_sent: int = 0  # the payload bytes of those that went through shared memory
    lane_bytes_sent: int = 0  # the payload bytes of those that went over TCP payload lanes
    lane_fallbacks: int = 0  # edges whose payload lane did not attach: their payloads took the stream
    lane_refused: int = 0  # connections to the payload port closed without a lane (garbage, silence, a bad token)
    bytes_received: int = 0
    frames_rejected: int = 0
    view_changes: int = 0
    heartbeats_missed: int = 0
    stall_warnings: int = 0
    latency: dict[str, Latency] = field(default_factory=dict)
    algorithms: dict[tuple[str, str], int] = field(default_factory=dict)  # (op, algorithm): collectives done

    def observe(self, kind: str, seconds: float, algorithm: str = "ring") -> None:
        self.collectives_done += 1
        entry = self.latency.get(kind)
        if entry is None:
            entry = self.latency[kind] = Latency()
        entry.observe(seconds)
        self.algorithms[(kind, algorithm)] = self.algorithms.get((kind, algorithm), 0) + 1


class Span:
    """One collective on the timeline: its phases and its bytes."""

    def __init__(self, timeline: Timeline | None, counters: Counters, name: str, args: dict[str, Any]) -> None:
        self._timeline = timeline
        self._counters = counters
        self._name = name
        self._args = args
        self._start = self._phase_start = time.perf_counter()
        self._phase = "negotiate"
        self._sent0 = self._phase_sent0 = counters.bytes_sent
        self._recv0 = self._phase_recv0 = counters.bytes_received

    def phase(self, name: str) -> None:
        """Ends the current phase and starts ``name``."""
        if self._timeline is None:
            return
        now = time.perf_counter()
        self._emit(self._phase, self._phase_start, now, self._phase_sent0, self._phase_recv0)
        self._phase, self._phase_start = name, now
        self._phase_sent0, self._phase_recv0 = self._counters.bytes_sent, self._counters.bytes_received

    def end(self, ok: bool) -> float:
        """Closes the span; returns its duration in seconds."""
        now = time.perf_counter()
        if self._timeline is not None:
            self._emit(self._phase, self._phase_start, now, self._phase_sent0, self._phase_recv0)
            self._emit(self._name, self._start, now, self._sent0, self._recv0, whole=True, ok=ok)
        return now - self._start

    def _emit(self, name: str, start: float, stop: float, sent0: int, recv0: int, *, whole: bool = False, ok: bool = True) -> None:
        assert self._timeline is not None
        args = dict(self._args) if whole else {}
        args.update(bytes_sent=self._counters.bytes_sent - sent0, bytes_received=self._counters.bytes_received - recv0)
        if whole and not ok:
            args["failed"] = True
        self._timeline.complete(name, str(self._args.get("op", "")), start, stop, args, lane=str(self._args.get("op_key", "")))


class Timeline:
    """Writes one rank's trace events, as a JSON array, to a file.

    The array is closed by close(); a file cut short by a crash still loads in chrome://tracing,
    and `ringserve timeline merge` reads it too.
    """

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self._lock = threading.Lock()
        # WorkerConfig checked that the directory exists or can be made; make it.
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file: IO[str] | None = open(path, "w", encoding="utf-8")  # noqa: SIM115 (held until close())
        self._file.write("[\n")
        self._first = True
        self._lanes: dict[str, int] = {}
        self._origin = time.perf_counter()
        self._wall0_us = time.time() * 1e6
        self._event({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})

    @staticmethod
    def path_for(template: str, rank: int) -> str:
        """``template`` with ``{rank}`` filled in, or ``template.<rank>.json`` when it has none."""
        return template.format(rank=rank) if "{rank}" in template else f"{template}.{rank}.json"

    def _lane(self, key: str) -> int:
        base = key.rsplit("#", 1)[0] or "unnamed"
        lane = self._lanes.get(base)
        if lane is None:
            lane = self._lanes[base] = len(self._lanes) + 1
            self._event({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": lane, "args": {"name": base}})
        return lane

    def complete(self, name: str, category: str, start: float, stop: float, args: dict[str, Any], lane: str) -> None:
        with self._lock:
            if self._file is None:
                return
            self._event({
                "name": name, "cat": category or "ringserve", "ph": "X", "pid": self.rank, "tid": self._lane(lane),
                "ts": round(self._wall0_us + (start - self._origin) * 1e6, 1),
                "dur": round((stop - start) * 1e6, 1), "args": args,
            })

    def _event(self, event: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(("" if self._first else ",\n") + json.dumps(event, separators=(",", ":")))
        self._first = False

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
                self._file = None


def load_trace(path: str) -> list[dict[str, Any]]:
    """Reads a trace file: a JSON array (closed or cut short) or an object with traceEvents."""
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if text.startswith("{"):
        return list(json.loads(text).get("traceEvents", []))
    if not text.endswith("]"):
        text = text.rstrip(",\n ") + "]"
    return list(json.loads(text))


def merge_traces(paths: list[str], out: str) -> int:
    """Writes the events of every file in ``paths`` into one trace at ``out``; returns the count."""
    events: list[dict[str, Any]] = []
    for path in paths:
        events.extend(load_trace(path))
    write_atomic(out, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode())
    return len(events)
