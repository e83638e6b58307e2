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

from ringserve.errors import ProtocolError
from ringserve.worker.programs import Ring


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
