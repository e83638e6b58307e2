"""When the coordinator has recorded this worker's commit (ringserve/worker/control/reports.py): rank 0
waits for the previous commit before it reports the next, so that a world is never more than one
commit ahead of the job's mark; it never waits on a coordinator that does not answer."""

from __future__ import annotations

import asyncio
import time

from ringserve.commits import Commit
from ringserve.worker.control.reports import CommitReports


async def test_a_wait_ends_when_a_heartbeat_carrying_the_commit_or_a_later_one_is_answered() -> None:
    reports = CommitReports()
    reports.hold(Commit(0, 5), view=3)
    assert (reports.committed, reports.view) == (Commit(0, 5), 3)
    waiter = asyncio.ensure_future(reports.wait(Commit(0, 5), timeout_s=5.0))
    await asyncio.sleep(0.01)
    reports.answered(Commit(0, 4), known=True)  # an older heartbeat, still in flight when 5 was made
    await asyncio.sleep(0.01)
    assert not waiter.done()
    reports.answered(Commit(0, 6), known=True)
    assert await waiter is True
    assert await reports.wait(Commit(0, 5), timeout_s=0.0) is True  # recorded already: no wait


async def test_a_wait_ends_at_once_while_the_coordinator_does_not_answer_or_does_not_know_this_worker() -> None:
    reports = CommitReports()
    waiter = asyncio.ensure_future(reports.wait(Commit(0, 1), timeout_s=5.0))
    await asyncio.sleep(0.01)
    reports.failed()
    assert await waiter is False
    started = time.monotonic()
    assert await reports.wait(Commit(0, 1), timeout_s=5.0) is False  # still failing: no wait at all
    assert time.monotonic() - started < 0.1
    reports.answered(Commit(0, 1), known=False)  # dropped: the coordinator recorded nothing
    assert await reports.wait(Commit(0, 1), timeout_s=5.0) is False


async def test_a_wait_is_bounded_by_its_timeout() -> None:
    reports = CommitReports()
    reports.answered(None, known=True)
    started = time.monotonic()
    assert await reports.wait(Commit(0, 1), timeout_s=0.2) is False
    assert 0.15 < time.monotonic() - started < 1.0
