"""Process sets: named sub-rings of a view that run their own collectives, as Horovod's do.

A process set is a sorted list of the view's ranks. Its collectives run on a session over those
ranks (session.py), so they proceed at the same time as the whole view's and other sets', on the
same links and streams, told apart by key (keys.py: ``name#n/0.2.3``).

**Registration is collective.** ``add_process_set`` and ``remove_process_set`` are called by every
rank of the view, in the same order (Horovod's rule for its dynamic process sets). Each call
gathers every rank's request over the whole view first, and only then decides, with set_policy.py's
pure ``decide_add``/``decide_remove``, on the agreed requests and the agreed registry: so every
rank takes the same decision, the same id, or raises the same InvalidArgumentError at once, even
when only one rank's arguments were wrong (a rank that raised on its own would leave the others
waiting out the collective deadline). Ids are the smallest free positive integers (0 is the
global set), so ids agree everywhere and are reused after a removal, as Horovod's are.

**A registry belongs to one view.** Ranks are numbers in a view, and a new view renumbers them
and admits joiners that never saw the old registrations; so a set registered in view V is
stale in any later view. A collective on a stale set raises RingChangedError (the set's world
changed: a recoverable error, which elastic training answers with a reset), or, once elastic
training has reset and synced in the new view (the view is pinned to it), InvalidArgumentError:
the set was not registered again. Sets are registered again in the new world by the same code
that registered them at the start, called as a reset callback; ids restart at 1 in every view, so
survivors and joiners that register in the same order agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ringserve.errors import InvalidArgumentError, NotInitializedError, RingChangedError
from ringserve.worker.dataplane.session import Session
from ringserve.worker.ops import collectives
from ringserve.worker.ops.set_policy import AddRequest, RemoveRequest, decide_add, decide_init, decide_remove, ranks_of

__all__ = ["ProcessSet", "Registry", "WholeWorld", "register", "register_init", "unregister"]


class ProcessSet:
    """Some ranks of the view that run collectives among themselves (Horovod's ``ProcessSet``).

    ``ranks`` is kept sorted; ``process_set_id`` is None until the set is registered (by
    ``add_process_set``, or by ``init(process_sets=...)`` in the torch API), and again after it
    is removed. ``mpi_comm`` is always None (ringserve does not use MPI).

    Example:
        ```python
        evens = await worker.add_process_set(range(0, worker.size, 2))
        total = await worker.allreduce(x, op="sum", process_set=evens)   # on the even ranks
        ```
    """

    is_global = False
    mpi_comm = None

    def __init__(self, ranks: Iterable[int]) -> None:
        self.ranks: list[int] = ranks_of(ranks)
        self.process_set_id: int | None = None
        self._view: int | None = None  # the view it is registered in
        self._rank: int = -1  # the registering worker's rank in that view
        self._registry: Registry | None = None  # whose registration it is

    def size(self) -> int | None:
        """The number of ranks in the set, or None if it is not registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set (its position in ``ranks``), or None if the set is not
        registered. As in Horovod, collectives still take global ranks (a broadcast's root).

        Raises:
            InvalidArgumentError: (a ValueError) this process is not in the set.
        """
        if self.process_set_id is None:
            return None
        if self._rank not in self.ranks:
            raise InvalidArgumentError(
                f"Process is not part of provided process set: rank {self._rank} is not in {self}."
            )
        return self.ranks.index(self._rank)

    def included(self) -> bool | None:
        """Whether this process is in the set, or None if the set is not registered."""
        return None if self.process_set_id is None else self._rank in self.ranks

    def _bind(self, registry: Registry, process_set_id: int | None) -> None:
        self.process_set_id = process_set_id
        if process_set_id is None:
            self._view, self._rank, self._registry = None, -1, None
        else:
            self._view, self._rank, self._registry = registry.view, registry.rank, registry

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"

    __repr__ = __str__


class WholeWorld(ProcessSet):
    """The global process set (id 0, every rank): its collectives run over the whole view.

    ``where`` tells (rank, size) of the worker it belongs to now: a Worker has one
    (``worker.global_process_set``), and the numpy and torch APIs one over the default context
    (``ringserve.global_process_set``). It is never registered nor removed.
    """

    is_global = True

    def __init__(self, where: Callable[[], tuple[int, int]]) -> None:
        self._where = where
        self.process_set_id = 0
        self._view, self._rank, self._registry = None, -1, None

    @property
    def ranks(self) -> list[int]:
        """Every rank of the current view ([] before init, as Horovod's before hvd.init())."""
        try:
            return list(range(self._where()[1]))
        except NotInitializedError:
            return []

    @ranks.setter
    def ranks(self, value: list[int]) -> None:
        raise InvalidArgumentError("The global process set's ranks are every rank of the view; they cannot be set.")

    def size(self) -> int:
        return self._where()[1]

    def rank(self) -> int:
        return self._where()[0]

    def included(self) -> bool:
        return True

    def _bind(self, registry: Registry, process_set_id: int | None) -> None:
        raise InvalidArgumentError("The global process set is registered always (id 0).")


@dataclass
class Registry:
    """One worker's process sets in one view: id -> ranks. Lives on the loop."""

    view: int = 0
    rank: int = -1
    size: int = 0
    sets: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def enter(self, view: int, rank: int, size: int) -> None:
        """Moves to ``view`` (where this worker has ``rank`` of ``size``): a new view starts with no
        sets, as its ranks are new (see the module docstring)."""
        if view != self.view:
            self.view, self.rank, self.size = view, rank, size
            self.sets = {}

    def lookup(self, ps: ProcessSet, *, synced_here: bool) -> tuple[int, ...]:
        """The ranks of a set this worker registered in its current view, checked for a collective.

        Args:
            synced_here: elastic training has synced in this view (it is pinned): a stale set here
                was not registered again, a usage error rather than a change of the world.

        Raises:
            RingChangedError: the set was registered in an earlier view.
            InvalidArgumentError: it was never registered, was removed, belongs to another worker,
                or this rank is not in it.
        """
        if ps.process_set_id is None:
            raise InvalidArgumentError(
                f"{ps} is not registered (never added, or removed): call add_process_set on every rank first."
            )
        if ps._registry is not self:
            raise InvalidArgumentError(
                f"{ps} was registered by another worker (or before a shutdown): register it on this one."
            )
        if ps._view != self.view:
            old = ps._view or 0
            why = (f"process set {ps.process_set_id} (ranks {ps.ranks}) was registered in view {old}; "
                   f"the world is now view {self.view}, where sets must be registered again")
            if synced_here:
                raise InvalidArgumentError(
                    f"The {why} (under elastic training: in a reset callback, on every rank)."
                )
            raise RingChangedError(old, self.view, why)
        ranks = self.sets.get(ps.process_set_id)
        if ranks is None or list(ranks) != ps.ranks:  # cannot happen while sets are made through add
            raise InvalidArgumentError(f"{ps} is not registered in view {self.view}.")
        if self.rank not in ranks:
            raise InvalidArgumentError(
                f"Rank {self.rank} is not in process set {ps.process_set_id} (ranks {list(ranks)}): only its "
                f"members may call its collectives."
            )
        return ranks

    def add_request(self, ps: ProcessSet | Iterable[int]) -> tuple[ProcessSet | None, AddRequest]:
        """This rank's request to register ``ps`` (a ProcessSet, or ranks), and the object it binds."""
        if isinstance(ps, WholeWorld):
            return None, AddRequest(error="the global process set is registered always (id 0)")
        if not isinstance(ps, ProcessSet):
            try:
                ps = ProcessSet(ps)
            except InvalidArgumentError as exc:
                return None, AddRequest(error=str(exc))
        here = ps.process_set_id if ps._registry is self and ps._view == self.view else None
        return ps, AddRequest(ranks=tuple(ps.ranks), registered=here)

    def remove_request(self, ps: object) -> RemoveRequest:
        if isinstance(ps, WholeWorld):
            return RemoveRequest(error="the global process set cannot be removed")
        if not isinstance(ps, ProcessSet):
            return RemoveRequest(error=f"{ps!r} is not a ProcessSet")
        if ps.process_set_id is None or ps._registry is not self or ps._view != self.view:
            return RemoveRequest(error=f"{ps} is not registered in view {self.view} on this worker")
        return RemoveRequest(process_set_id=ps.process_set_id, ranks=tuple(ps.ranks))


async def register(session: Session, registry: Registry, process_set: ProcessSet | Iterable[int], *,
                   chunk_bytes: int, timeout_s: float) -> ProcessSet:
    """Registers ``process_set`` on every rank of ``session`` (the whole view): each rank's request
    is gathered, then every rank decides alike (set_policy.decide_add). Returns the bound set."""
    ps, request = registry.add_request(process_set)
    requests = await collectives.allgather_object(session, request, name="ringserve.add_process_set",
                                                  chunk_bytes=chunk_bytes, timeout_s=timeout_s)
    sid = decide_add([_request(r, AddRequest) for r in requests], registry.sets, registry.size)
    assert ps is not None  # a request that carried an error is never decided into an id
    registry.sets[sid] = tuple(ps.ranks)
    ps._bind(registry, sid)
    return ps


async def unregister(session: Session, registry: Registry, process_set: ProcessSet, *,
                     chunk_bytes: int, timeout_s: float) -> None:
    """Removes ``process_set`` on every rank of ``session`` (the whole view), as register adds it."""
    request = registry.remove_request(process_set)
    requests = await collectives.allgather_object(session, request, name="ringserve.remove_process_set",
                                                  chunk_bytes=chunk_bytes, timeout_s=timeout_s)
    sid = decide_remove([_request(r, RemoveRequest) for r in requests], registry.sets)
    del registry.sets[sid]
    process_set._bind(registry, None)


async def register_init(session: Session, registry: Registry, process_sets: Iterable[ProcessSet | Iterable[int]], *,
                        chunk_bytes: int, timeout_s: float) -> list[ProcessSet]:
    """Registers a list of sets at once, all or none (Horovod's ``init(process_sets=[...])``, see
    set_policy.decide_init); returns them bound, in order."""
    made = [registry.add_request(ps) for ps in process_sets]
    gathered = await collectives.allgather_object(session, [request for _, request in made],
                                                  name="ringserve.init_process_sets",
                                                  chunk_bytes=chunk_bytes, timeout_s=timeout_s)
    lists = [[_request(r, AddRequest) for r in _request(requests, list)] for requests in gathered]
    ids = decide_init(lists, registry.sets, registry.size)
    bound = []
    for (ps, _), sid in zip(made, ids, strict=True):
        assert ps is not None  # a request that carried an error is never decided into an id
        registry.sets[sid] = tuple(ps.ranks)
        ps._bind(registry, sid)
        bound.append(ps)
    return bound


def _request(value: object, kind: type[Any]) -> Any:
    """A peer's gathered request, checked to be of the expected kind (a peer of another version
    or a broken one must not be decided on)."""
    if not isinstance(value, kind):
        raise InvalidArgumentError(f"A rank sent {value!r} where a {kind.__name__} was expected.")
    return value
