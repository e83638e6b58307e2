"""The log of one loop's outage: its first failure at once, then at most a line every few seconds.

While the coordinator is away (a restart, a partition), the lifeline's heartbeat fails at every
interval and at every commit, and its view watch at every retry: tens of lines a second in a busy
job, the same line each time. ``Outage`` logs the first failure as it comes, then one line per
``every_s`` with how many failed since, and one line when the loop works again (how long the outage
lasted, how many failures it took). What is counted is not lost: the heartbeats missed are in the
worker's counters too.

Example:
    ```python
    outage = Outage("heartbeat", every_s=5.0)
    try:
        answer = await beat()
    except RingserveError as exc:
        outage.failed(tag, exc)
    else:
        outage.ended(tag)
    ```
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("ringserve.worker")


class Outage:
    """One loop's failures in a row, logged sparsely (see the module docstring)."""

    def __init__(self, what: str, *, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.every_s = every_s
        self._clock = clock
        self.since: float | None = None  # when the outage began; None while the loop works
        self.failures = 0  # in the outage so far
        self._logged_at = 0.0
        self._unlogged = 0  # failures since the last line

    def failed(self, tag: str, exc: BaseException) -> None:
        now = self._clock()
        self.failures += 1
        if self.since is None:
            self.since = self._logged_at = now
            log.warning("%s: %s failed: %s", tag, self.what, exc)
            return
        self._unlogged += 1
        if now - self._logged_at >= self.every_s:
            log.warning("%s: %s failed %d more times in %.1f s (%.1f s since the first): %s", tag, self.what,
                        self._unlogged, now - self._logged_at, now - self.since, exc)
            self._logged_at, self._unlogged = now, 0

    def ended(self, tag: str) -> None:
        """The loop worked again: one line, if it had failed."""
        if self.since is None:
            return
        log.warning("%s: %s works again, after %.1f s and %d failures", tag, self.what,
                    self._clock() - self.since, self.failures)
        self.since, self.failures, self._unlogged = None, 0, 0
