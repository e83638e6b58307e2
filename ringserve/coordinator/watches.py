"""The caps on WatchView streams: how many the coordinator serves at once, all clients together,
and how many under one worker id. Pure counting; the servicer refuses a stream past a cap with
RESOURCE_EXHAUSTED and the message this module gives, which names the cap."""

from __future__ import annotations

from ringserve.errors import RingserveError

__all__ = ["WatchCaps", "WatchRefusedError"]


class WatchRefusedError(RingserveError):
    """A WatchView stream past one of the caps (the message names it)."""


class WatchCaps:
    """The WatchView streams open, in all and by worker id, under their caps.

    Args:
        cap: streams at once, all clients together (max_watch_streams, within half of
            max_concurrent_rpcs).
        per_worker: streams at once under one worker id (max_watches_per_worker).
    """

    def __init__(self, cap: int, per_worker: int) -> None:
        self.cap = cap
        self.per_worker = per_worker
        self.open = 0
        self._by_worker: dict[str, int] = {}

    def admit(self, worker_id: str) -> None:
        """Counts a new stream of ``worker_id``.

        Raises:
            WatchRefusedError: a cap is reached; nothing is counted then.
        """
        mine = self._by_worker.get(worker_id, 0)
        if self.open >= self.cap:
            raise WatchRefusedError(
                f"The coordinator already serves {self.open} WatchView streams, its cap (max_watch_streams, "
                f"at most half of max_concurrent_rpcs)."
            )
        if mine >= self.per_worker:
            raise WatchRefusedError(
                f"Worker id {worker_id!r} already holds {mine} WatchView streams, the cap per worker "
                f"(max_watches_per_worker)."
            )
        self._by_worker[worker_id] = mine + 1
        self.open += 1

    def release(self, worker_id: str) -> bool:
        """Uncounts a stream of ``worker_id`` that ended; returns whether it was the worker's last."""
        self.open -= 1
        left = self._by_worker[worker_id] - 1
        if left:
            self._by_worker[worker_id] = left
            return False
        del self._by_worker[worker_id]
        return True
