"""Metrics scraped over HTTP, the timeline of a 2-worker run, and reflection on the coordinator."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ringserve import Coordinator, CoordinatorConfig, Worker, WorkerConfig
from ringserve.commits import Commit
from ringserve.metrics import WorkerCollector
from ringserve.observe import Counters, load_trace

pytestmark = pytest.mark.timeout(60)


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


async def start_world(n: int, **worker_options: object) -> tuple[Coordinator, list[Worker]]:
    coord = await Coordinator(CoordinatorConfig(min_workers=n, settle_s=0.1, metrics_port=0)).start()
    workers = [Worker(config=WorkerConfig(coordinator=coord.address, **worker_options)) for _ in range(n)]  # type: ignore[arg-type]
    await asyncio.gather(*(w.start() for w in workers))
    return coord, sorted(workers, key=lambda w: w.rank)


async def test_metrics_count_collectives_bytes_and_latency_by_op() -> None:
    coord, workers = await start_world(2, metrics_port=0)
    try:
        a = np.ones(1000, np.float32)
        for _ in range(3):
            await asyncio.gather(*(w.allreduce(a, op="sum", name="g") for w in workers))
        await asyncio.gather(*(w.broadcast(a, root=0) for w in workers))
        for w in workers:
            assert w.metrics_url is not None
            values = await asyncio.to_thread(scrape, w.metrics_url)
            rank = w.rank
            assert values[f'ringserve_collectives_total{{op="allreduce",rank="{rank}"}}'] == 3
            assert values[f'ringserve_collectives_total{{op="broadcast",rank="{rank}"}}'] == 1
            assert values[f'ringserve_collective_seconds_count{{op="allreduce",rank="{rank}"}}'] == 3
            assert values[f'ringserve_collective_seconds_bucket{{le="+Inf",op="allreduce",rank="{rank}"}}'] == 3
            # Each allreduce of 4000 bytes sends 2(N-1)/N of it, plus small headers.
            sent = values[f'ringserve_sent_bytes_total{{rank="{rank}"}}']
            assert sent == w.counters.bytes_sent and sent >= 3 * 4000
            assert values[f'ringserve_received_bytes_total{{rank="{rank}"}}'] == w.counters.bytes_received
            assert values[f'ringserve_view{{rank="{rank}"}}'] == w.view_id
        assert coord.metrics is not None
        coordinator = await asyncio.to_thread(scrape, coord.metrics.url)
        assert coordinator["ringserve_coordinator_views_formed_total"] == 1
        assert coordinator["ringserve_coordinator_view_size"] == 2
        assert coordinator["ringserve_coordinator_committed_step"] == -1  # no elastic state has synced
        workers[0].report_committed(Commit(1, 41), now=True)
        await asyncio.sleep(0.5)
        coordinator = await asyncio.to_thread(scrape, coord.metrics.url)
        assert coordinator["ringserve_coordinator_committed_step"] == 41
        assert coordinator["ringserve_coordinator_committed_lineage"] == 1
    finally:
        await asyncio.gather(*(w.close() for w in workers))
        await coord.stop()


async def test_a_two_worker_timeline_holds_each_ranks_collectives_and_phases(tmp_path: Path) -> None:
    template = str(tmp_path / "trace")
    # The ring's phases (tests/integration/test_algorithms.py names the others' on the timeline).
    coord, workers = await start_world(2, timeline=template, chunk_bytes=1024, algorithm="ring")
    try:
        a = np.arange(4096, dtype=np.float32)
        await asyncio.gather(*(w.allreduce(a, op="sum", name="grad") for w in workers))
        await asyncio.gather(*(w.allgather(a[:10]) for w in workers))
    finally:
        await asyncio.gather(*(w.close() for w in workers))
        await coord.stop()
    files = sorted(tmp_path.glob("trace.*.json"))
    assert [f.name for f in files] == ["trace.0.json", "trace.1.json"]
    for rank, f in enumerate(files):
        events = json.loads(f.read_text())  # a closed, valid JSON array
        complete = [e for e in events if e["ph"] == "X"]
        names = {e["name"] for e in complete}
        assert {"allreduce grad#1", "negotiate", "reduce_scatter", "allgather", "allgather #1"} <= names
        whole = next(e for e in complete if e["name"] == "allreduce grad#1")
        assert whole["pid"] == rank and whole["dur"] > 0
        assert whole["args"]["bytes_sent"] > 4096 * 4 // 2
        phases = [e for e in complete if e["name"] in ("reduce_scatter", "allgather") and e["tid"] == whole["tid"]]
        assert all(whole["ts"] <= p["ts"] and p["ts"] + p["dur"] <= whole["ts"] + whole["dur"] + 1 for p in phases)
    merged = tmp_path / "merged.json"
    result = subprocess.run([sys.executable, "-m", "ringserve.cli", "timeline", "merge", str(merged), *map(str, files)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    events = load_trace(str(merged))
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}


def test_a_timeline_cut_short_by_a_crash_still_loads(tmp_path: Path) -> None:
    f = tmp_path / "cut.json"
    f.write_text('[\n{"name":"a","ph":"X","pid":0,"tid":1,"ts":1,"dur":2},\n{"name":"b","ph":"X","pid":0,"tid":1,"ts":3,"dur":1}')
    assert [e["name"] for e in load_trace(str(f))] == ["a", "b"]


async def test_coordinator_serves_reflection_for_grpcurl() -> None:
    async with Coordinator(CoordinatorConfig()) as coord, grpc.aio.insecure_channel(coord.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def requests():  # type: ignore[no-untyped-def]
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for response in stub.ServerReflectionInfo(requests(), timeout=5):
            services = {s.name for s in response.list_services_response.service}
            break
    assert "ringserve.v1.Coordinator" in services
    assert "grpc.health.v1.Health" in services


def test_metric_names_follow_prometheus_conventions() -> None:
    from ringserve.metrics import WorkerCollector
    from ringserve.observe import Counters

    names = {family.name for family in WorkerCollector(Counters(), lambda: (0, 1)).collect()}
    assert all(re.fullmatch(r"ringserve_[a-z_]+", n) for n in names)


def test_the_metrics_count_collectives_by_the_algorithm_they_ran() -> None:
    counters = Counters()
    counters.observe("allreduce", 0.01, "tree")
    counters.observe("allreduce", 0.02, "tree")
    counters.observe("allreduce", 0.03)
    counters.observe("broadcast", 0.01, "tree/2")
    families = {f.name: f for f in WorkerCollector(counters, lambda: (3, 7)).collect()}
    samples = {(s.labels["op"], s.labels["algorithm"]): s.value
               for s in families["ringserve_collectives_by_algorithm"].samples if s.name.endswith("_total")}
    assert samples == {("allreduce", "tree"): 2, ("allreduce", "ring"): 1, ("broadcast", "tree/2"): 1}
