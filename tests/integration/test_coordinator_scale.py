"""The coordinator with a hundred (and, slow-marked, a thousand) simulated workers: a coordinator
process, swarms of workers over real gRPC (tests/swarm.py), and the harness watching the views."""

from __future__ import annotations

import asyncio
import re
import sys
import time

import pytest
from swarm import Scale

from ringserve._proto import coordinator_pb2 as pb


async def _form_fail_and_recover(scale: Scale, *, settle: float, timeout: float) -> None:
    await scale.start_swarms()
    first = await scale.wait_view(lambda v: len(v.members) == scale.n, settle + 10)
    assert first.view_id == 1 and sorted(first.members) == sorted(scale.ids)

    began = time.monotonic()
    status = await scale.stub.Status(pb.StatusRequest(), timeout=5)
    assert time.monotonic() - began < 1.0
    assert status.view_size == scale.n and len(status.members) == scale.n
    summary = await scale.stub.Status(pb.StatusRequest(summary_only=True), timeout=5)
    assert summary.view_size == scale.n and not summary.members and not summary.view.members
    page = await scale.stub.Status(pb.StatusRequest(offset=10, limit=5), timeout=5)
    assert [m.member.rank for m in page.members] == [10, 11, 12, 13, 14] and len(page.view.members) == scale.n

    silenced, began = await scale.silence(0.1)
    assert len(silenced) == scale.n // 10
    failure = await scale.wait_view(lambda v: v.view_id > 1, timeout + 5)
    assert failure.at - began < timeout + 1.0
    # All of them in one view, and nobody else.
    assert sorted(failure.failed) == sorted(silenced)
    assert sorted(failure.members) == sorted(set(scale.ids) - set(silenced))
    await asyncio.sleep(timeout / 2)
    assert [v.view_id for v in scale.views] == [1, 2]
    report = await scale.report()
    assert report["unknown"] == 0 and report["errors"] == 0 and report["missed"] == 0
    # Every live worker heartbeats on its stream (none fell back to unary calls).
    assert report["streaming"] == scale.n - len(silenced)


async def _status_table(address: str, *args: str) -> list[str]:
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ringserve.cli", "status", "--coordinator", address, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(cli.communicate(), 60)
    assert cli.returncode == 0, err.decode()
    return out.decode().splitlines()


@pytest.mark.timeout(90)
async def test_the_status_command_summarizes_a_large_world_and_lists_every_worker_on_request() -> None:
    async with Scale(100, procs=1, interval=0.5, timeout=4.0, settle=0.3) as scale:
        await scale.start_swarms()
        await scale.wait_view(lambda v: len(v.members) == 100, 10)
        rows = re.compile(r"\s+\d+\s+sim-\d+:\d+")
        table = await _status_table(scale.address)
        assert table[0].startswith("view 1, 100 workers") and table[1].startswith("heartbeats of the 20 listed")
        assert len([line for line in table if rows.match(line)]) == 20
        assert table[-1] == "... 80 more (--all lists every worker)"
        everyone = await _status_table(scale.address, "--all")
        assert len([line for line in everyone if rows.match(line)]) == 100


@pytest.mark.timeout(90)
async def test_a_hundred_workers_form_one_view_and_ten_that_fall_silent_leave_in_one_view_within_the_timeout() -> None:
    # Heartbeats 4 a second; a live worker would have to miss 7 in a row to be dropped.
    async with Scale(100, procs=1, interval=0.25, timeout=2.0, settle=0.3) as scale:
        await _form_fail_and_recover(scale, settle=0.3, timeout=2.0)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_thousand_workers_form_one_view_and_a_hundred_that_fall_silent_leave_in_one_view() -> None:
    async with Scale(1000, procs=2, interval=1.0, timeout=5.0, settle=1.0) as scale:
        await _form_fail_and_recover(scale, settle=1.0, timeout=5.0)
