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
from dataclasses import dataclass

from ringserve.errors import InvalidArgumentError

__all__ = ["AddRequest", "RemoveRequest", "decide_add", "decide_remove", "ranks_of", "root_position"]


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


def decide_add(requests: Sequence[AddRequest], sets: dict[int, tuple[int, ...]], size: int) -> int:
    """The id every rank gives the set all ``requests`` (one per rank, in rank order) ask for.

    Pure: every rank calls it on the same gathered requests and the same registry, so every rank
    returns the same id or raises the same error.

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
    if request.error:
        raise InvalidArgumentError(f"Cannot add the process set: {request.error}.")
    ranks = request.ranks
    if request.registered is not None:
        raise InvalidArgumentError(
            f"Attempted to add a duplicate process set: ranks {list(ranks)} are registered already as id "
            f"{request.registered}."
        )
    if not ranks:
        raise InvalidArgumentError("A process set needs at least one rank.")
    if len(set(ranks)) != len(ranks):
        repeated = sorted({r for r in ranks if ranks.count(r) > 1})
        raise InvalidArgumentError(f"The ranks of a process set must not repeat: {repeated} appear more than once in {list(ranks)}.")
    outside = [r for r in ranks if not 0 <= r < size]
    if outside:
        raise InvalidArgumentError(
            f"Ranks {outside} of the process set {list(ranks)} are not ranks of the view: they must be in [0, {size})."
        )
    if list(ranks) == list(range(size)):
        raise InvalidArgumentError(
            f"Attempted to add a duplicate process set: ranks {list(ranks)} are every rank, the global process set (id 0)."
        )
    for sid, existing in sets.items():
        if existing == ranks:
            raise InvalidArgumentError(
                f"Attempted to add a duplicate process set: ranks {list(ranks)} are registered already as id {sid}."
            )
    sid = 1
    while sid in sets:
        sid += 1
    return sid


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
