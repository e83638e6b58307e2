"""What other threads see of a worker, and how they reach its loop.

A worker's state lives on its event loop and is touched only there. The training thread (the
numpy API, a torch gradient hook, elastic training) needs two things of it:

- **to read** where the worker stands (rank, size, view, joiners waiting, the pinned view). The
  loop publishes a ``Standing``, an immutable snapshot, whole, after every change; a reader takes
  one reference to it, so the values it reads together come from one moment, and none of them can
  change or be half-written under it;
- **to write** (pin a view, report a commit): ``on_loop`` queues the write on the loop, in order
  with whatever the same thread submits after it (``call_soon_threadsafe`` is first in, first
  out), so a collective submitted after ``pin_view`` returns always sees the pin.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringserve.errors import NotInitializedError, RingChangedError, RingserveError, ViewInstallError, WorkerFailedError
from ringserve.worker.dataplane.policy import Place


def raise_failure(failure: RingserveError | None) -> None:
    """Raises ``failure`` (why every call fails), if any; a fresh copy where it can be made, so
    that tracebacks do not pile up on one object."""
    if failure is None:
        return
    if isinstance(failure, ViewInstallError | WorkerFailedError):
        raise type(failure)(*failure.args) from failure.__cause__
    raise failure


@dataclass(frozen=True)
class Standing:
    """What the worker's loop publishes for other threads, replaced whole at every change."""

    running: bool = False  # started, and not closed
    place: Place | None = None  # the current view's place; None outside any view
    last: Place | None = None  # the last place held, kept after its view ended
    latest_view: int = 0
    pending_workers: int = 0
    pinned: int | None = None
    failure: RingserveError | None = None  # why every call fails (excluded, failed)

    def current(self) -> Place:
        """The current place.

        Raises:
            NotInitializedError: the worker is not running.
            ExcludedError, ViewInstallError, WorkerFailedError: the worker stopped for good.
            RingChangedError: the worker is in no view now.
        """
        if not self.running:
            raise NotInitializedError("The worker is not running: call start() (or ringserve.init()) first.")
        raise_failure(self.failure)
        if self.place is None:
            raise RingChangedError(self.latest_view, self.latest_view, "this worker is not in the current view")
        return self.place

    def known(self) -> Place:
        """The current place, else the last one this worker held.

        Like Horovod's, rank() and size() keep answering after a peer shut down (a job's last
        print) and until the next view: only collectives need the worker in the current view.
        """
        if self.running and self.place is None and self.last is not None:
            return self.last
        return self.current()

    @property
    def running_view(self) -> int:
        """The view collectives run in: the pinned one, else the current one (0 if none)."""
        if self.pinned is not None:
            return self.pinned
        return self.place.view_id if self.place is not None else 0

    def tag(self, address: str) -> str:
        """"rank R view V" (or "worker ADDRESS view V" outside any view), for log lines."""
        return tag_of(self.place, address, self.latest_view)


def tag_of(place: Place | None, address: str, latest_view: int) -> str:
    """"rank R view V" for a worker at ``place``, or "worker ADDRESS view V" outside any view."""
    if place is not None:
        return f"rank {place.rank} view {place.view_id}"
    return f"worker {address} view {latest_view}"


def on_loop(loop: asyncio.AbstractEventLoop | None, call: Callable[..., None], *args: Any,
            wait_s: float | None = None) -> None:
    """Runs ``call(*args)`` on ``loop``: at once on the loop's own thread, or when the loop no
    longer runs (nothing else touches the state then); else queued, in order, and, with
    ``wait_s``, waited for up to that long (a loop that stops meanwhile ends the wait)."""
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if loop is None or here or loop.is_closed() or not loop.is_running():
        call(*args)
        return
    done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run() -> None:
        try:
            call(*args)
        finally:
            done.set_result(None)

    loop.call_soon_threadsafe(run)
    if wait_s is not None:
        with contextlib.suppress(concurrent.futures.TimeoutError):
            done.result(wait_s)
