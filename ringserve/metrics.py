"""Prometheus endpoints for a worker and for the coordinator (prometheus-client).

Nothing is counted twice: a collector reads the live counters when Prometheus scrapes, so the data
path pays nothing for metrics. Each endpoint has its own registry, so several workers can serve
metrics from one process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ringserve.observe import LATENCY_BUCKETS, Counters


class WorkerCollector(Collector):
    """Exposes one worker's counters, with its rank and view as labels."""

    def __init__(self, counters: Counters, place: Callable[[], tuple[int, int]]) -> None:
        self._counters = counters
        self._place = place

    def collect(self) -> Iterator[Any]:
        c = self._counters
        rank, view = self._place()
        labels = ["rank"]
        values = [str(rank)]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"ringserve_{name}", doc, labels=labels)
            family.add_metric(values, value)
            return family

        ops = CounterMetricFamily("ringserve_collectives", "Collectives completed, by op.", labels=[*labels, "op"])
        latency = HistogramMetricFamily("ringserve_collective_seconds", "Collective latency, by op.", labels=[*labels, "op"])
        for op, entry in sorted(c.latency.items()):
            ops.add_metric([*values, op], entry.count)
            cumulative, running = [], 0
            for bound, n in zip([*map(str, LATENCY_BUCKETS), "+Inf"], entry.buckets, strict=True):
                running += n
                cumulative.append((bound, running))
            latency.add_metric([*values, op], cumulative, entry.total_s)
        yield ops
        yield latency
        chosen = CounterMetricFamily("ringserve_collectives_by_algorithm",
                                     "Collectives completed, by op and by the algorithm they ran.",
                                     labels=[*labels, "op", "algorithm"])
        for (op, algorithm), count in sorted(c.algorithms.items()):
            chosen.add_metric([*values, op, algorithm], count)
        yield chosen
        yield counter("sent_bytes", "Bytes sent to the ring successor.", c.bytes_sent)
        yield counter("sent_frames", "DATA frames sent to the ring successor.", c.frames_sent)
        yield counter("shared_sent_bytes", "Of those, payload bytes sent through same-host shared memory.",
                      c.shared_bytes_sent)
        yield counter("lane_sent_bytes", "Of those, payload bytes sent over TCP payload lanes (between hosts).",
                      c.lane_bytes_sent)
        yield counter("lane_fallbacks", "Edges whose TCP payload lane did not attach: their payloads took the stream.",
                      c.lane_fallbacks)
        yield counter("lane_refused", "Connections to the payload port closed without a lane (garbage, silence, "
                      "a bad token).", c.lane_refused)
        yield counter("received_bytes", "Bytes received from the ring predecessor.", c.bytes_received)
        yield counter("frames_rejected", "Frames of another view, dropped and never summed.", c.frames_rejected)
        yield counter("view_changes", "New views installed after the first.", c.view_changes)
        yield counter("heartbeats_missed", "Heartbeats that did not reach the coordinator.", c.heartbeats_missed)
        yield counter("stall_warnings", "Stall warnings about collectives this worker waited on.", c.stall_warnings)
        gauge = GaugeMetricFamily("ringserve_view", "The view this worker runs in.", labels=labels)
        gauge.add_metric(values, view)
        yield gauge


class CoordinatorCollector(Collector):
    """Exposes the coordinator's view, membership and failure counts."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Any]:
        values = self._read()
        docs = {
            "views_formed": ("counter", "Views published so far."),
            "workers_removed_silent": ("counter", "Workers removed after missing heartbeats."),
            "workers_left": ("counter", "Workers that left gracefully."),
            "heartbeats": ("counter", "Heartbeats received."),
            "stall_warnings": ("counter", "Collectives found stalled: some ranks waited, others had not submitted."),
            "view": ("gauge", "The current view id."),
            "view_size": ("gauge", "Workers in the current view."),
            "workers_waiting": ("gauge", "Workers joined but not yet in a view."),
            "watch_streams": ("gauge", "WatchView streams open (capped by max_watch_streams)."),
            "heartbeat_streams": ("gauge", "Heartbeats streams open (capped by max_heartbeat_streams)."),
            "param_bytes": ("gauge", "Parameter bytes held, stored and streaming (capped by max_param_bytes)."),
            "committed_step": ("gauge", "The job's last commit reported by a synced worker (-1: none yet)."),
            "committed_lineage": ("gauge", "Resumes from a durable copy after every holder of the last commit died."),
        }
        for name, (kind, doc) in docs.items():
            family: Any = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                f"ringserve_coordinator_{name}", doc
            )
            family.add_metric([], values.get(name, 0))
            yield family


class MetricsServer:
    """An HTTP /metrics endpoint on its own thread; port 0 picks a free port."""

    def __init__(self, collector: Collector, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.host = host
        self.port = int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if isinstance(self._thread, threading.Thread):
            self._thread.join(5.0)
