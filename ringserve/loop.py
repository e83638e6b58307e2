"""One asyncio event loop on a background thread, for synchronous callers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ringserve.constants import GRPC_DRAIN_S

T = TypeVar("T")

log = logging.getLogger("ringserve")


def new_event_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:  # uvloop is optional off Linux
            return asyncio.new_event_loop()
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def fine_clock(loop: asyncio.AbstractEventLoop) -> Callable[[], float]:
    """A clock fine enough to time a hop on loopback (tens of microseconds), in the loop's time
    where it can: asyncio's own loops read ``time.monotonic`` (a test's virtual loop, its virtual
    time: testing/vclock.py), so their ``time`` is used; uvloop's ``time`` counts whole
    milliseconds, taken once per iteration of the loop, so ``time.monotonic`` is used instead."""
    return loop.time if isinstance(loop, asyncio.BaseEventLoop) else time.monotonic


async def uncancelled(coro: Coroutine[Any, Any, T], stray: Callable[[], BaseException]) -> T:
    """Awaits ``coro``; a cancellation that nobody asked of this task becomes ``stray()``.

    A task's ``cancelling()`` counts the ``cancel()`` calls made on it (Python 3.11): a caller
    that cancels (``future.cancel()`` on the thread's future, ``asyncio.timeout``, the loop's end)
    makes it positive, and its cancellation goes through as it is. A CancelledError that reaches
    a task nobody cancelled came out of something it awaited (a future or a gRPC call that
    ringserve's own machinery cancelled): that is ringserve's fault, never the caller's, and it
    reaches the caller as the typed error ``stray()`` returns, with the cancellation chained and
    its traceback logged, so that its source can be found.
    """
    try:
        return await coro
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None or task.cancelling() > 0:
            raise
        error = stray()
        log.warning("a call was cancelled by ringserve, not by its caller; it fails with %r", error, exc_info=exc)
        raise error from exc


def _quiet_closed_loop_handoffs(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loops' exception handler: gRPC's hand-off of a late completion to a loop already closed
    (see GRPC_DRAIN_S) is logged at debug level, as what it is: an event for a call whose owner
    is gone. Everything else goes to asyncio's default handler."""
    exc = context.get("exception")
    handle = str(context.get("handle", ""))
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and "PollerCompletionQueue" in handle:
        log.debug("a gRPC completion for a closed event loop was dropped: %s", handle)
        return
    loop.default_exception_handler(context)


class LoopThread:
    """Runs an event loop on a daemon thread until stop()."""

    def __init__(self, *, use_uvloop: bool, name: str = "ringserve-loop") -> None:
        self.loop = new_event_loop(use_uvloop)
        self.loop.set_exception_handler(_quiet_closed_loop_handoffs)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.run_until_complete(asyncio.sleep(GRPC_DRAIN_S))  # the last gRPC completions: see above
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Runs coro on the loop and waits for it; cancels it if timeout_s passes first."""
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"The background loop did not finish the call within {timeout_s:g} s.") from None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
