"""What this worker tells the coordinator of the commit its elastic state holds, and when the
coordinator has recorded it.

The job's mark (ringserve.commits) is only as good as these reports. A worker reports with its
heartbeats the commit it holds and, for a commit made at a commit-time allreduce, the view in
which it was made: every member of that view holds it, so the coordinator counts them all as its
holders at once, without waiting for each member's own heartbeat (a member stopped or starved
before its next heartbeat would otherwise be missing from the list, and not waited for).

Rank 0 reports each commit at once and, before it reports the next, waits until the coordinator
has recorded the previous one (``wait``): a world is then never more than one commit ahead of
the mark, so a world that loses every holder is always told that it did. Found without it: a
world of two committed 24 steps in 0.7 s, between heartbeats, and was stopped; the next world
synced from an older commit that the mark still named as the newest, and redid those 24 steps
with no error. The wait is skipped while the coordinator does not answer (it is restarting:
training goes on, and the mark trails, as docs/guide/elastic.md says).

Everything runs on the worker's event loop, except ``hold`` (any thread, via the loop).
"""

from __future__ import annotations

import asyncio
import contextlib

from ringserve.commits import Commit


class CommitReports:
    def __init__(self) -> None:
        self.committed: Commit | None = None  # what the state holds; None before its first sync
        self.view = 0  # the view every member of which holds it (0: only this worker is known to)
        self._recorded: Commit | None = None  # the newest commit the coordinator answered for
        self._answering = True  # the last heartbeat was answered by a coordinator that knows us
        self._answered = asyncio.Event()

    def hold(self, commit: Commit, view: int = 0) -> None:
        self.committed, self.view = commit, view

    def answered(self, sent: Commit | None, known: bool) -> None:
        """A heartbeat that carried ``sent`` was answered; ``known``: the coordinator knows this
        worker (and so recorded it)."""
        self._answering = known
        if known and sent is not None and (self._recorded is None or sent > self._recorded):
            self._recorded = sent
        self._wake()

    def failed(self) -> None:
        """A heartbeat got no answer."""
        self._answering = False
        self._wake()

    def _wake(self) -> None:
        self._answered.set()
        self._answered = asyncio.Event()

    async def wait(self, commit: Commit, timeout_s: float) -> bool:
        """Waits until the coordinator has recorded ``commit`` (or a later one). False at once while
        heartbeats go unanswered or are answered "unknown", or once timeout_s has passed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self._answering and (self._recorded is None or self._recorded < commit):
                    await self._answered.wait()
        return self._recorded is not None and self._recorded >= commit
