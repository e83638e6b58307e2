"""torch ``Work`` objects over ringserve's collectives, and the threads that complete them.

A collective runs on ringserve's event loop and finishes there. Its torch future must not be
completed on that loop: torch runs a future's ``then`` callbacks on the thread that completes it,
and DDP's comm hooks do real work in them; PowerSGD's even start another all_reduce and wait for
it inside a callback, which on the loop would wait for the loop forever. So a finished collective
is handed to a small pool of completion threads, which copy the result where torch expects it
(staged tensors, gathered lists), then complete the future. A callback that blocks holds one
thread; the next completion takes another (up to ``MAX_THREADS``, idle ones are reused).

Errors: a ringserve error becomes ``torch.distributed.DistBackendError`` (a RuntimeError) with the
ringserve error as its ``__cause__``, which is what ``work.wait()`` raises. An argument error
(``InvalidArgumentError``, a ValueError) stays as it is. The torch future must fail in C++ terms,
for C++ waiters (DDP's reducer) to see a failure: ``Future.set_exception`` only stores the
exception as the future's *value* (a Python-side unwrap raises it), and DDP's reducer, reading
that value as its tensors, crashes the process. So the future handed out is a ``then`` of an inner
one, whose callback raises the error: torch turns that into a real C++ error, a RuntimeError that
reads "...DistBackendError: ringserve: all_reduce failed: RingChangedError: ..." when waited on,
and which DDP's ``backward()`` raises.

Ops started inside a callback: a completion thread runs a finished op's callbacks under its label
(``completing()``), and an op started there takes a name made from that label (plane.py), not the
next number of the group's sequence. Two buckets' callbacks run on two threads in whatever order
their allreduces finish on each rank, so ops numbered in the order those threads start them would
pair different tensors on different ranks (PowerSGD's hook with DDP's default buckets failed with
MismatchError); named after their parent, ``<parent>.1``, ``<parent>.2``, they pair alike everywhere.

A callback registered on a future that has already finished runs at once, on the registering
thread: had the ops a hook starts depended on which came first on each rank, ranks would issue
them on different threads, in different orders. So a future taken through torch.distributed's
Python functions (a comm hook's) is handed out once finished (``get_future``), and its callbacks
always run on the hook's thread, in program order, as NCCL's do.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ringserve.errors import CollectiveTimeoutError, GroupTimedOutError, InvalidArgumentError, NotInitializedError

# Completion threads per process group at most: each callback blocked in a nested wait holds one.
MAX_THREADS = 32

_local = threading.local()


class CallbackScope:
    """The op whose completion runs the callbacks on this thread, and how many ops they started."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._started = 0

    def child(self) -> str:
        """The label of the next op started by these callbacks."""
        self._started += 1
        return f"{self.label}.{self._started}"


def completing() -> CallbackScope | None:
    """The scope of the callbacks running on this thread, if it is a completion thread running some."""
    return getattr(_local, "scope", None)


def backend_error(exc: BaseException, what: str) -> BaseException:
    """What a failed collective raises in torch: ``DistBackendError`` caused by ringserve's error."""
    if isinstance(exc, InvalidArgumentError | NotInitializedError | NotImplementedError):
        return exc
    if isinstance(exc, concurrent.futures.CancelledError):
        error = dist.DistBackendError(f"ringserve: {what} was cancelled (the process group was shut down).")
    elif isinstance(exc, GroupTimedOutError):
        error = dist.DistBackendError(f"ringserve: {what} on a process group that a timeout broke: {exc}")
    elif isinstance(exc, CollectiveTimeoutError):
        # Worded as gloo's timeouts are ("Timed out waiting 1000ms for ..."), which torch's tests match.
        error = dist.DistBackendError(
            f"ringserve: {what} failed: Timed out waiting for the other ranks, past the process group's timeout "
            f"(init_process_group's or new_group's timeout=): {type(exc).__name__}: {exc}"
        )
    else:
        error = dist.DistBackendError(f"ringserve: {what} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class RingserveWork(dist._Work):
    """An op in flight: ``wait()``, ``get_future()``, ``is_completed()``, as torch's Work has.

    ``get_future()`` resolves to what gloo's does (the op's output tensors) once the op has
    finished and its outputs are in place.
    """

    def __init__(self, what: str, wait_limit_s: float) -> None:
        super().__init__()
        self.what = what
        self._inner: torch.futures.Future[Any] = torch.futures.Future()
        self.future: torch.futures.Future[Any] = self._inner.then(_unwrap)
        self.done = threading.Event()
        self._wait_limit_s = wait_limit_s
        self._error: BaseException | None = None
        # A recv's call on the ring, whose result is the sender's group rank (None: not a recv).
        self.sender_of: concurrent.futures.Future[Any] | None = None
        # Set once the future too has its outcome (after ``done``: see get_future).
        self._settled = threading.Event()
        self._program_order = from_python_api()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits for the op (at most ``timeout``; a zero or no timeout: the op's own deadline).

        Raises:
            DistBackendError: the op failed (ringserve's error is the cause), or ``timeout`` passed.
        """
        limit = timeout.total_seconds() if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 else None
        if not self.done.wait(self._wait_limit_s if limit is None else limit):
            raise dist.DistBackendError(
                f"ringserve: {self.what} Timed out: it did not complete within "
                f"{limit if limit is not None else self._wait_limit_s:g} s of wait()."
            )
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """The op's future. Taken through torch.distributed's Python functions (a DDP comm hook's
        ``dist.all_reduce(..., async_op=True).get_future()``), it is returned once it has its
        outcome (at most the op's deadline later), so that ``then`` callbacks run at once on the
        caller's thread, in program order on every rank, as NCCL's run: ops they start are then
        issued in the same order everywhere. (Had the op finished before ``then`` on one rank
        and after it on another, the callbacks' ops would be issued on different threads, in
        different orders.) DDP's own reducer takes the future from C++ and gets it at once."""
        if self._program_order:
            self._settled.wait(self._wait_limit_s)
        return self.future

    def _source_rank(self) -> int:
        """The group rank a recv's message came from (torch's ``Work._source_rank``), once the
        recv is done; -1 before, or for another op."""
        part = self.sender_of
        if part is None or not part.done() or part.cancelled() or part.exception() is not None:
            return -1
        return int(part.result())

    def is_completed(self) -> bool:
        return self.done.is_set()

    def is_success(self) -> bool:
        return self.done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self.future.value()

    def _complete(self, value: Any = None, error: BaseException | None = None) -> None:
        self._error = error
        # The event first: a callback of the future that waits on this work must not wait long.
        self.done.set()
        try:
            self._inner.set_result(value if error is None else _Failed(error))
        finally:
            self._settled.set()


_C10D = "torch.distributed.distributed_c10d"


def from_python_api() -> bool:
    """Whether the op being made was called through torch.distributed's Python functions
    (``dist.all_reduce``), not from C++ (DDP's reducer): the first caller outside ringserve says."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("ringserve."):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__") == _C10D


class _Failed:
    """An op's error, carried to ``_unwrap`` as the inner future's value."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(inner: torch.futures.Future[Any]) -> Any:
    value = inner.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


def finished(what: str, value: Any) -> RingserveWork:
    """A Work that is already complete (an op with nothing to send, a world of one)."""
    work = RingserveWork(what, 0.0)
    work._complete(value)
    return work


class Completer:
    """The completion threads of one process group (see the module's docstring)."""

    def __init__(self, wait_limit_s: float) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="ringserve-dist")
        self._wait_limit_s = wait_limit_s
        self._closed = False

    def track(self, what: str, parts: list[concurrent.futures.Future[Any]],
              finish: Callable[[list[Any]], Any], wait_limit_s: float | None = None) -> RingserveWork:
        """A Work that completes once every one of ``parts`` has: with ``finish(results)`` (run on
        a completion thread; it puts the outputs in place and returns the future's value), or with
        the first part's error. ``wait_limit_s``: how long its ``wait()`` waits (None: the group's)."""
        work = RingserveWork(what, self._wait_limit_s if wait_limit_s is None else wait_limit_s)
        remaining = [len(parts)]
        lock = threading.Lock()
        label = getattr(parts[0], "ringserve_label", None) if parts else None  # set by plane.py

        def complete() -> None:
            errors = [f.exception() if not f.cancelled() else concurrent.futures.CancelledError() for f in parts]
            failed = next((e for e in errors if e is not None), None)
            if failed is not None:
                work._complete(error=backend_error(failed, what))
                return
            try:
                value = finish([f.result() for f in parts])
            except BaseException as exc:
                work._complete(error=backend_error(exc, what))
                return
            _local.scope = None if label is None else CallbackScope(label)
            try:
                work._complete(value)  # runs the future's callbacks, here
            finally:
                _local.scope = None

        def on_done(_: concurrent.futures.Future[Any]) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if not last:
                return
            try:
                self._pool.submit(complete)
            except RuntimeError:  # the pool is shut down: complete here, after the group is gone
                complete()

        if not parts:
            self._pool.submit(complete)
        for part in parts:
            part.add_done_callback(on_done)
        return work

    def close(self) -> None:
        """Lets the threads end once the completions queued so far have run."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=False)
