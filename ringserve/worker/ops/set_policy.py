"""Process sets, the pure part: what every rank decides on the requests gathered from all of them.

``add_process_set`` and ``remove_process_set`` are collective (process_sets.py): each rank's
request is gathered over the whole view, and then every rank calls ``decide_add`` or
``decide_remove`` here on the same requests and the same registry, so every rank takes the same
decision (the same id), or raises the same InvalidArgumentError at once, even when only one rank's
arguments were wrong. Tested without sockets (tests/unit/test_process_sets.py).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from ringserve.errors import InvalidArgumentError

__all__ = ["AddRequest", "RemoveRequest", "decide_add", "decide_init", "decide_remove", "ranks_of", "root_position"]


def _integer(value: object) -> int | None:
    """``value`` as an int if it is an integer (a numpy one too), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def ranks_of(ranks: Iterable[int]) -> list[int]:
    """The sorted ranks of a set, after checking that each is an integer."""
    try:
        items = list(ranks)
    except TypeError:
        raise InvalidArgumentError(f"A process set is made of a list of ranks, not {ranks!r}.") from None
    ints = [_integer(r) for r in items]
    bad = [r for r, i in zip(items, ints, strict=True) if i is None]
    if bad:
        raise InvalidArgumentError(f"A process set is made of integer ranks; {bad!r} are not integers.")
    return sorted(i for i in ints if i is not None)


@dataclass(frozen=True)
class AddRequest:
    """What one rank asks ``add_process_set`` for: the ranks, or why its arguments were wrong;
    ``registered`` is the id its set object holds in this view already (None if none)."""

    ranks: tuple[int, ...] = ()
    error: str = ""
    registered: int | None = None


@dataclass(frozen=True)
class RemoveRequest:
    """What one rank asks ``remove_process_set`` for: the id and ranks of its set object, or why
    it cannot be removed (the global set, a set not registered in this view)."""

    process_set_id: int | None = None
    ranks: tuple[int, ...] = ()
    error: str = ""


def _disagree(what: str, requests: Sequence[object]) -> str:
    """"" if every rank made the same request, else a sentence naming who asked for what."""
    if all(r == requests[0] for r in requests):
        return ""
    groups: dict[str, list[int]] = {}
    for rank, request in enumerate(requests):
        groups.setdefault(_describe(request), []).append(rank)
    said = "; ".join(f"ranks {ranks} asked for {text}" for text, ranks in groups.items())
    return (f"The ranks called {what} differently ({said}); every rank must make the same calls in "
            f"the same order.")


def _describe(request: object) -> str:
    if isinstance(request, AddRequest):
        if request.error:
            return f"an invalid set ({request.error})"
        return f"ranks {list(request.ranks)}" + (
            f" (already registered as id {request.registered})" if request.registered is not None else "")
    if isinstance(request, RemoveRequest):
        return f"an invalid removal ({request.error})" if request.error else (
            f"set {request.process_set_id} (ranks {list(request.ranks)})")
    return repr(request)


def _checked(request: AddRequest, size: int) -> tuple[int, ...]:
    """The ranks of an agreed request, after checking them against a view of ``size`` ranks."""
    if request.error:
        raise InvalidArgumentError(f"Cannot add the process set: {request.error}.")
    ranks = request.ranks
    if not ranks:
        raise InvalidArgumentError("A process set needs at least one rank.")
    if len(set(ranks)) != len(ranks):
        repeated = sorted({r for r in ranks if ranks.count(r) > 1})
        raise InvalidArgumentError(
            f"The ranks of a process set must not repeat: {repeated} appear more than once in {list(ranks)}.")
    outside = [r for r in ranks if not 0 <= r < size]
    if outside:
        raise InvalidArgumentError(
            f"Ranks {outside} of the process set {list(ranks)} are not ranks of the view: they must be in [0, {size})."
        )
    if list(ranks) == list(range(size)):
        raise InvalidArgumentError(
            f"Attempted to add a duplicate process set: ranks {list(ranks)} are every rank, the global process set (id 0)."
        )
    return ranks


def _free_id(sets: dict[int, tuple[int, ...]]) -> int:
    sid = 1
    while sid in sets:
        sid += 1
    return sid


def _duplicate(ranks: tuple[int, ...], sid: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"Attempted to add a duplicate process set: ranks {list(ranks)} are registered already as id {sid}."
    )


def decide_add(requests: Sequence[AddRequest], sets: dict[int, tuple[int, ...]], size: int) -> int:
    """The id every rank gives the set all ``requests`` (one per rank, in rank order) ask for.

    Pure: every rank calls it on the same gathered requests and the same registry, so every rank
    returns the same id or raises the same error. Ids are the smallest free ones, from 1.

    Raises:
        InvalidArgumentError: the ranks asked for different sets; a rank repeats or is outside
            [0, size); the set is empty; a set of those ranks (or the global set: every rank) is
            registered already.
    """
    if not requests:
        raise InvalidArgumentError("add_process_set needs the requests of every rank.")
    disagreement = _disagree("add_process_set", requests)
    if disagreement:
        raise InvalidArgumentError(disagreement)
    request = requests[0]
    if request.registered is not None:
        raise _duplicate(request.ranks, request.registered)
    ranks = _checked(request, size)
    for sid, existing in sets.items():
        if existing == ranks:
            raise _duplicate(ranks, sid)
    return _free_id(sets)


def decide_init(requests: Sequence[Sequence[AddRequest]], sets: dict[int, tuple[int, ...]], size: int) -> list[int]:
    """The ids of the sets of Horovod's ``init(process_sets=[...])``: ``requests`` holds each rank's
    list of requests, in rank order. All or none: one error fails the whole list, on every rank.

    Unlike ``decide_add``, a set whose ranks are registered already takes that set's id (an init
    that names the sets it named before is no error); a list that names the same ranks twice is.

    Raises:
        InvalidArgumentError: the ranks' lists differ; a set is wrong as in ``decide_add``; two sets
            of the list have the same ranks.
    """
    if not requests:
        raise InvalidArgumentError("init(process_sets=...) needs the requests of every rank.")
    lists = [tuple(replace(q, registered=None) for q in r) for r in requests]
    if any(len(x) != len(lists[0]) for x in lists):
        counts = sorted({len(x) for x in lists})
        raise InvalidArgumentError(
            f"The ranks passed init() lists of different lengths of process sets ({counts}); every rank "
            f"must pass the same sets.")
    taken = dict(sets)
    by_ranks = {ranks: sid for sid, ranks in sets.items()}
    ids: list[int] = []
    for i, column in enumerate(zip(*lists, strict=True)):
        disagreement = _disagree(f"init(process_sets=...) at position {i}", column)
        if disagreement:
            raise InvalidArgumentError(disagreement)
        ranks = _checked(column[0], size)
        sid = by_ranks.get(ranks)
        if sid is None:
            sid = by_ranks[ranks] = _free_id(taken)
            taken[sid] = ranks
        elif sid in ids:
            raise InvalidArgumentError(
                f"init(process_sets=...) names the process set of ranks {list(ranks)} twice (positions "
                f"{ids.index(sid)} and {i}).")
        ids.append(sid)
    return ids


def decide_remove(requests: Sequence[RemoveRequest], sets: dict[int, tuple[int, ...]]) -> int:
    """The id every rank removes (pure, as decide_add).

    Raises:
        InvalidArgumentError: the ranks asked to remove different sets; the global set; a set not
            registered in this view.
    """
    if not requests:
        raise InvalidArgumentError("remove_process_set needs the requests of every rank.")
    disagreement = _disagree("remove_process_set", requests)
    if disagreement:
        raise InvalidArgumentError(disagreement)
    request = requests[0]
    if request.error:
        raise InvalidArgumentError(f"Cannot remove the process set: {request.error}.")
    assert request.process_set_id is not None
    if sets.get(request.process_set_id) != request.ranks:
        raise InvalidArgumentError(f"Process set {request.process_set_id} is not registered.")
    return request.process_set_id


def root_position(ranks: Sequence[int], root: int, process_set_id: int | None) -> int:
    """The position in a set's ring of its global rank ``root`` (a broadcast's root: Horovod's
    process-set collectives take global ranks).

    Raises:
        InvalidArgumentError: root is not in the set.
    """
    position = _integer(root)
    if position is None or position not in ranks:
        raise InvalidArgumentError(
            f"The root rank ({root!r}) is not in process set {process_set_id} (ranks {list(ranks)}): roots "
            f"are global ranks of the set's members."
        )
    return list(ranks).index(position)
