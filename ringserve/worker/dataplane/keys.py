"""A collective's key: its identity on the wire, equal on every rank of its ring, pure.

``name#n`` is the n-th collective called ``name`` over the whole view; ``name#n/0.2.3`` the n-th
over the sub-ring of ranks 0, 2 and 3, in that ring order. Everything after the last ``#`` is
ours, so a key names its ring whatever the name holds (a name may contain ``#`` or ``/``), and a
frame finds its way around its ring from its key alone. Occurrences are counted per (name, ring
spec), so a rank outside a sub-ring never counts its collectives, and a sub-ring of every rank
(spec ``0.1.2``) is counted apart from the whole view (spec ``""``): calls on the two can never
be confused, whatever order the ranks make them in.
"""

from __future__ import annotations

from collections import defaultdict

from ringserve.errors import ProtocolError
from ringserve.worker.dataplane.programs import Ring


def spec_of(members: tuple[int, ...]) -> str:
    """The part of a key that names a sub-ring of ``members``."""
    return ".".join(map(str, members))


def make(base: str, number: int, spec: str) -> str:
    """The key of the ``number``-th collective named ``base`` over the ring ``spec``."""
    return f"{base}#{number}/{spec}" if spec else f"{base}#{number}"


def split(key: str) -> tuple[str, str, str]:
    """(base, number, spec) of a key; number is "" (or not digits) for a key not made by ``make``."""
    base, _, tail = key.rpartition("#")
    number, _, spec = tail.partition("/")
    return base, number, spec


def ring_of(key: str, whole: Ring, view_id: int) -> Ring:
    """The ring a key names, for the rank at ``whole.index`` of a view of ``whole.size`` ranks.

    Raises:
        ProtocolError: the key names ranks outside the view, a rank twice, or not this rank.
    """
    spec = split(key)[2]
    if not spec:
        return whole
    try:
        members = tuple(int(m) for m in spec.split("."))
    except ValueError:
        members = ()
    me, size = whole.index, whole.size
    if (not members or len(set(members)) != len(members) or me not in members
            or not all(0 <= m < size for m in members)):
        raise ProtocolError(
            f"Collective {key!r} names a ring ({spec}) that is not made of distinct ranks of view "
            f"{view_id} including rank {me}."
        )
    return Ring(members, members.index(me))


def source(ring: Ring) -> int:
    """The rank a ring's frames reach this rank from: its predecessor (-1 in a ring of one)."""
    if ring.size == 1:
        return -1
    return ring.members[(ring.index - 1) % ring.size]


# A joined rank opens the others' keys as their frames come (join.py); they come nearly in order,
# so a key far past the last of its name is a broken peer, not a gap to remember.
MAX_SKIPPED = 1 << 12


class Numbering:
    """The keys one rank has handed out in one view: how many collectives of each (name, ring) it
    opened, and the whole view's keys a joined rank passed over by opening a later one (join.py).

    Only the whole view's collectives are stood in for (join is over the whole view, as Horovod's
    is over the global process set), so ``claim``, ``counts``, ``behind`` and ``opened`` concern
    keys of spec "" only; a sub-ring's collectives are numbered apart and never claimed.
    """

    def __init__(self) -> None:
        self._counts: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._skipped: set[str] = set()
        self.opened = 0  # whole-view collectives opened of this rank's own accord since its last join

    def next(self, base: str, spec: str) -> str:
        """The key of the next collective named ``base`` over the ring ``spec``."""
        self._counts[(base, spec)] += 1
        if not spec:
            self.opened += 1
        return make(base, self._counts[(base, spec)], spec)

    def peek(self, base: str, spec: str) -> str:
        """The key that ``next(base, spec)`` would hand out, without handing it out."""
        return make(base, self._counts.get((base, spec), 0) + 1, spec)

    def claim(self, key: str) -> None:
        """Takes ``key``, a whole-view key the others opened (a joined rank stands in for it); the
        keys of its name it passes over stay open to their frames until claimed.

        Raises:
            ProtocolError: the key is not a whole view's, or is far past the last of its name.
        """
        base, number, spec = split(key)
        if spec or not number.isdigit():
            raise ProtocolError(f"Collective {key!r} is not one of the whole view's, so no joined rank stands in for it.")
        seen, n = self._counts[(base, "")], int(number)
        if n - seen > MAX_SKIPPED:
            raise ProtocolError(f"Collective {key!r} is {n - seen} past the last of its name on this rank.")
        self._skipped.update(make(base, m, "") for m in range(seen + 1, n))
        self._skipped.discard(key)
        self._counts[(base, "")] = max(seen, n)

    def handed_out(self, key: str) -> bool:
        """Whether ``key`` was opened here already (by ``next`` or ``claim``)."""
        base, number, spec = split(key)
        return number.isdigit() and int(number) <= self._counts.get((base, spec), 0) and key not in self._skipped

    def counts(self) -> dict[str, int]:
        """How many of the whole view's collectives of each name this rank has opened (the last
        key's number)."""
        return {base: n for (base, spec), n in self._counts.items() if not spec}

    def behind(self, counts: dict[str, int]) -> bool:
        """Whether some whole-view collective of ``counts`` (another rank's) is one this rank has
        not opened."""
        return bool(self._skipped) or any(self._counts.get((b, ""), 0) < n for b, n in counts.items())
