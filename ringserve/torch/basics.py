"""Lifecycle and topology with Horovod's names, over ringserve's default context.

The binding keeps no state of its own: the one default context lives in ``ringserve.api``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ringserve import api
from ringserve.errors import CollectiveTimeoutError, InvalidArgumentError, NotInitializedError
from ringserve.worker.runtime import Worker

T = TypeVar("T")

# Slack on top of a collective's own deadline before a waiting caller gives up.
_WAIT_SLACK_S = 10.0


class ProcessSet:
    """Horovod's process sets; ringserve supports only the global one (every rank)."""

    def __repr__(self) -> str:
        return "ringserve.torch.global_process_set"


global_process_set = ProcessSet()


def check_process_set(process_set: object) -> None:
    """Raises InvalidArgumentError unless ``process_set`` is None or the global process set."""
    if process_set is not None and process_set is not global_process_set:
        raise InvalidArgumentError("process sets other than the global one are not supported yet")


def init(comm: object = None, process_sets: object = None, *, coordinator: str | None = None,
         **overrides: Any) -> None:
    """Joins the world (Horovod's ``hvd.init()``); blocks until the first view that includes us.

    Args:
        comm: Horovod's MPI communicator; must be None (ringserve does not use MPI).
        process_sets: Horovod's process sets; must be None or empty.
        coordinator: host:port of the coordinator; defaults to RINGSERVE_COORDINATOR.
        **overrides: any WorkerConfig field, over the RINGSERVE_* environment.

    Raises:
        InvalidArgumentError: an MPI communicator or process sets were given.
        CoordinatorUnreachableError, RendezvousTimeoutError: as ringserve.init().
    """
    if comm is not None:
        raise InvalidArgumentError("ringserve does not use MPI: init() takes no communicator.")
    if process_sets:
        raise InvalidArgumentError("ringserve supports only the global process set: pass no process_sets.")
    api.init(coordinator, **overrides)


def shutdown() -> None:
    """Leaves the world and stops the background thread; init() works again afterwards."""
    api.shutdown()


def is_initialized() -> bool:
    return api.is_initialized()


def rank() -> int:
    """This process's rank in the current view."""
    return api.rank()


def size() -> int:
    """The number of ranks in the current view."""
    return api.size()


def local_rank() -> int:
    """This process's rank among the ranks on its host."""
    return api.local_rank()


def local_size() -> int:
    """The number of ranks on this process's host."""
    return api.local_size()


def cross_rank() -> int:
    """The index of this process's host among the hosts."""
    return api.cross_rank()


def cross_size() -> int:
    """The number of hosts."""
    return api.cross_size()


class _InFlight:
    """The names of one context's collectives in use, as Horovod tracks its tensor names."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # claimed by the caller's thread, released on the loop's
        self._claims: dict[str, Claim] = {}
        self.waits = 0  # how many times a caller has waited on a collective (see Claim)

    def claim(self, name: str) -> Claim:
        with self._lock:
            held = self._claims.get(name)
            if held is not None and not held.releasable(self.waits):
                raise InvalidArgumentError(
                    f"A collective named {name!r} is still in flight on this rank: names of concurrent "
                    "collectives must differ (synchronize the first one, or name the second otherwise)."
                )
            claim = Claim(self, name, self.waits)
            self._claims[name] = claim
            return claim

    def release(self, claim: Claim) -> None:
        with self._lock:
            if self._claims.get(claim.name) is claim:
                del self._claims[claim.name]

    def waited(self) -> None:
        """A caller has waited on a collective: dropped handles that had finished let go."""
        with self._lock:
            self.waits += 1
            for name in [n for n, c in self._claims.items() if c.releasable(self.waits)]:
                del self._claims[name]


class Claim:
    """One collective's hold on its name.

    A handle that is waited on (synchronize(), or poll() saying True) lets go of its name once the
    collective has finished. A handle dropped unwaited lets go once the collective has finished
    and its caller has waited on a collective since starting it (synchronize(), a blocking
    collective, barrier(), join()). Finishing alone is not enough: a collective the other ranks
    already wait for can finish within the microseconds before the caller's next line, so a second
    call of the same name right after the first would be let through or not by chance. Horovod's
    own window is its background thread's negotiation cycle; here no window is left: the line
    after a dropped call always finds its name in use, and the name is free again after the next
    wait once the collective is done, so it is never held for good.
    """

    def __init__(self, names: _InFlight, name: str, since: int) -> None:
        self._names = names
        self.name = name
        self._since = since  # names.waits when the collective started
        self._lock = threading.Lock()
        self._finished = False
        self._taken = False
        self._dropped = False

    def finished(self, _: object = None) -> None:
        self._mark(finished=True)

    def taken(self) -> None:
        """The caller has seen the result (or the collective never started)."""
        self._mark(taken=True)

    def dropped(self) -> None:
        """The handle went unwaited; the name goes as releasable() says."""
        with self._lock:
            self._dropped = True

    def releasable(self, waits: int) -> bool:
        with self._lock:
            return self._finished and (self._taken or (self._dropped and waits > self._since))

    def _mark(self, *, finished: bool = False, taken: bool = False) -> None:
        with self._lock:
            already = self._finished and self._taken
            self._finished |= finished
            self._taken |= taken
            release = self._finished and self._taken and not already
        if release:
            self._names.release(self)


# One registry per context, so that a shutdown and a new init() start with no name in use. The
# contexts are ringserve.api's; this map only hangs each one's names on it.
_in_flight: weakref.WeakKeyDictionary[api.Context, _InFlight] = weakref.WeakKeyDictionary()
_in_flight_lock = threading.Lock()


def submit(call: Callable[[Worker], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
    """Starts a worker call on the default context's loop; raises NotInitializedError before init()."""
    return api.context().submit(call)


class NamedCall:
    """A collective being started under a name: the name is taken first, before the arguments are
    prepared, so that a second call of the same name is checked as soon after the first as can be;
    it is let go at once if the collective never starts."""

    def __init__(self, name: str | None) -> None:
        self.claim: Claim | None = None
        if name is not None:
            ctx = api.context()
            with _in_flight_lock:
                names = _in_flight.setdefault(ctx, _InFlight())
            self.claim = names.claim(name)
        self._started = False

    def submit(self, call: Callable[[Worker], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        future = submit(call)
        self._started = True
        if self.claim is not None:
            future.add_done_callback(self.claim.finished)
        return future

    def __enter__(self) -> NamedCall:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._started and self.claim is not None:
            self.claim.finished()
            self.claim.taken()


def named_call(name: str | None) -> NamedCall:
    """Takes ``name`` (Horovod's spelling: "allreduce.grad"; None for an unnamed call) for a
    collective about to start: ``with named_call(n) as call: ...; future = call.submit(...)``.
    The handle that wraps the future calls ``call.claim.taken()`` when its result is taken or it
    is dropped.

    Raises:
        InvalidArgumentError: (a ValueError) a collective of that name is still in use on this rank.
        NotInitializedError: before init().
    """
    return NamedCall(name)


def waited(ctx: api.Context | None = None) -> None:
    """Notes that this rank's caller has waited on a collective (see Claim); after a shutdown,
    there is nothing to note."""
    if ctx is None:
        try:
            ctx = api.context()
        except NotInitializedError:
            return
    with _in_flight_lock:
        names = _in_flight.get(ctx)
    if names is not None:
        names.waited()


def wait(future: concurrent.futures.Future[T]) -> T:
    """The result of a submitted call, waiting at most the collective deadline plus a slack.

    Raises:
        CollectiveTimeoutError: the call did not finish in time (it is cancelled).
        Whatever the call raised.
    """
    ctx = api.context()
    timeout_s = ctx.config.collective_timeout_s + _WAIT_SLACK_S
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise CollectiveTimeoutError(
            f"A collective did not finish within {timeout_s:g} s of waiting."
        ) from None
    finally:
        waited(ctx)


def ringserve_built() -> bool:
    return True


def mpi_built() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False
