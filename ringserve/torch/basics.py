"""Lifecycle and topology with Horovod's names, over ringserve's default context.

The binding keeps no state of its own: the one default context lives in ``ringserve.api``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from ringserve import api
from ringserve.constants import THREAD_WAIT_SLACK_S
from ringserve.errors import CollectiveTimeoutError, InvalidArgumentError, NotInitializedError
from ringserve.worker.ops.process_sets import ProcessSet, WholeWorld
from ringserve.worker.runtime import Worker

# Horovod's hvd.global_process_set: every rank of the default context's view.
global_process_set = api.global_process_set

T = TypeVar("T")

# Slack on top of a collective's own deadline before a waiting caller gives up.


def resolve_set(process_set: object) -> ProcessSet | None:
    """The set a collective runs over: None for the global set (or None), else a registered set
    this rank is a member of, checked here, in the caller's thread, before anything starts (the
    loop checks again, against the view the collective starts in).

    Raises:
        InvalidArgumentError: (a ValueError) not a ProcessSet, not registered, or without this rank.
    """
    if process_set is None or isinstance(process_set, WholeWorld):
        return None
    if not isinstance(process_set, ProcessSet):
        raise InvalidArgumentError(f"process_set must be a ProcessSet (or None), not {process_set!r}.")
    if process_set.process_set_id is None:
        raise InvalidArgumentError(
            f"{process_set} is not registered: pass it to hvd.init(process_sets=...) or hvd.add_process_set().")
    if not process_set.included():
        raise InvalidArgumentError(
            f"Rank {api.rank()} is not in process set {process_set.process_set_id} (ranks {process_set.ranks}): "
            f"only its members may call its collectives.")
    return process_set


def optimizer_set(process_set: object) -> ProcessSet | None:
    """A DistributedOptimizer's set, checked as resolve_set checks it, except that this rank may be
    outside it (Horovod's optimizer then reduces nothing)."""
    if process_set is None or isinstance(process_set, WholeWorld):
        return None
    if not isinstance(process_set, ProcessSet) or process_set.process_set_id is None:
        return resolve_set(process_set)  # raises, naming why
    return process_set


def set_size(process_set: ProcessSet | None) -> int:
    """The number of ranks a collective over ``process_set`` (None: every rank) runs over."""
    return api.size() if process_set is None else len(process_set.ranks)


def set_rank(process_set: ProcessSet | None) -> int:
    """This rank's position in ``process_set`` (None: its global rank)."""
    return api.rank() if process_set is None else process_set.ranks.index(api.rank())


def init(comm: object = None, process_sets: object = None, *, coordinator: str | None = None,
         **overrides: Any) -> None:
    """Joins the world (Horovod's ``hvd.init()``); blocks until the first view that includes us.

    Args:
        comm: Horovod's MPI communicator; must be None (ringserve does not use MPI).
        process_sets: a list of ``ProcessSet`` to register (Horovod's static process sets; every
            rank passes the same list), or "dynamic" (sets are added and removed later with
            add_process_set and remove_process_set: always possible here). A set whose ranks are
            registered already takes that set's id, so a second init() naming the same sets is
            no error. All or none: one wrong set fails the whole list, on every rank, and
            ringserve stays initialized.
        coordinator: host:port of the coordinator; defaults to RINGSERVE_COORDINATOR.
        **overrides: any WorkerConfig field, over the RINGSERVE_* environment.

    Raises:
        InvalidArgumentError: an MPI communicator; process_sets neither a list of ProcessSet nor
            "dynamic"; a set of the list is wrong (see add_process_set), on every rank at once.
        CoordinatorUnreachableError, RendezvousTimeoutError: as ringserve.init().
    """
    if comm is not None:
        raise InvalidArgumentError("ringserve does not use MPI: init() takes no communicator.")
    static = _static_sets(process_sets)
    api.init(coordinator, **overrides)
    if static:
        api.context().call(lambda w: w.add_process_sets(static))


def _static_sets(process_sets: object) -> list[ProcessSet]:
    if process_sets is None or process_sets == "dynamic":
        return []
    if isinstance(process_sets, str) or not isinstance(process_sets, list | tuple):
        raise InvalidArgumentError(
            f"process_sets must be a list of hvd.ProcessSet or \"dynamic\", not {process_sets!r}.")
    wrong = [p for p in process_sets if not isinstance(p, ProcessSet) or isinstance(p, WholeWorld)]
    if wrong:
        raise InvalidArgumentError(f"process_sets must hold hvd.ProcessSet objects (not the global one): {wrong!r}.")
    return list(process_sets)


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Registers a process set after init (Horovod's dynamic process sets) and returns it: every
    rank calls it alike, in the same order.

    Raises:
        InvalidArgumentError: (a ValueError) on every rank at once: a duplicate of a registered set
            or of the global one, a rank repeated or outside the world, or ranks that disagree.
    """
    return api.add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes a registered process set (every rank alike, in the same order); returns True.

    As in Horovod, returns False, without a collective, for the global process set and for a set
    that is not registered (its ``process_set_id`` is None): the same on every rank that calls
    alike. The numpy API's ``ringserve.remove_process_set`` raises InvalidArgumentError instead.

    Raises:
        InvalidArgumentError: on every rank at once when the ranks removed different sets, or a set
            registered before the world changed.
    """
    if isinstance(process_set, WholeWorld) or not isinstance(process_set, ProcessSet):
        return False
    if process_set.process_set_id is None:
        return False
    api.remove_process_set(process_set)
    return True


# The lifecycle's end and the topology are the numpy API's own functions.
shutdown = api.shutdown
is_initialized = api.is_initialized
rank = api.rank
size = api.size
local_rank = api.local_rank
local_size = api.local_size
cross_rank = api.cross_rank
cross_size = api.cross_size


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
    timeout_s = ctx.config.collective_timeout_s + THREAD_WAIT_SLACK_S
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise CollectiveTimeoutError(
            f"A collective did not finish within {timeout_s:g} s of waiting."
        ) from None
    finally:
        waited(ctx)











