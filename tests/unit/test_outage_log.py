"""The lifeline's outage log: the first failure at once, then a line per interval, and one at the end."""

from __future__ import annotations

import logging

import pytest

from ringserve.worker.control.outage import Outage


def test_an_outage_logs_its_first_failure_then_a_count_per_interval_then_its_end(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    outage = Outage("heartbeat", every_s=5.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="ringserve.worker")
    for _ in range(260):  # a failure every 40 ms for 10.4 s: a heartbeat at every commit
        outage.failed("rank 0 view 1", ConnectionError("refused"))
        now[0] += 0.04
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "rank 0 view 1: heartbeat failed: refused"
    assert len(lines) == 3, lines  # the first, then one at 5 s and one at 10 s
    assert lines[1].startswith("rank 0 view 1: heartbeat failed 125 more times in 5.0 s"), lines[1]
    caplog.clear()
    outage.ended("rank 0 view 1")
    assert [r.getMessage() for r in caplog.records] == ["rank 0 view 1: heartbeat works again, after 10.4 s and 260 failures"]
    assert outage.since is None and outage.failures == 0


def test_a_loop_that_never_failed_logs_nothing_when_it_works(caplog: pytest.LogCaptureFixture) -> None:
    outage = Outage("view watch", every_s=5.0)
    caplog.set_level(logging.WARNING, logger="ringserve.worker")
    outage.ended("rank 1 view 2")
    assert caplog.records == []


def test_a_second_outage_starts_with_a_line_of_its_own(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    outage = Outage("view watch", every_s=5.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="ringserve.worker")
    outage.failed("t", RuntimeError("a"))
    now[0] += 1
    outage.ended("t")
    now[0] += 1
    outage.failed("t", RuntimeError("b"))
    assert [r.getMessage() for r in caplog.records] == [
        "t: view watch failed: a", "t: view watch works again, after 1.0 s and 1 failures", "t: view watch failed: b"]
