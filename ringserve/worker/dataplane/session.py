"""A session: the ring a collective runs over, on one view's plane (plane.py).

Programs (programs/__init__.py) work in ring positions over a ``Ring(members, index)``, and the executor
(programs/executor.py) runs them on a session: it opens the collective here, sends on the link to the ring's
next member (or to the members at the positions a step names: halving-doubling's partners, a
tree's parent and children), and receives what the ring's previous member (or the named one)
sends. So the same program runs over the
whole view or over a sub-ring of some of its ranks (a process set), unchanged.

To the collectives (collectives.py) a session over ranks ``(0, 2, 3)`` of a view of five looks like
a view of three: ``place.rank`` is this rank's position in the ring and ``place.size`` the ring's
length, so that segments, blocks and roots are counted in positions.

Sessions are cheap and hold nothing the plane does not: the worker makes one per collective.

A session reaches its plane through ``ViewPlane``, the part of a plane that sessions and the
collectives use, declared here: plane.py (which makes sessions) then builds on this module, and
this module knows nothing of plane.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import numpy as np

from ringserve.errors import InvalidArgumentError
from ringserve.observe import Counters, Timeline
from ringserve.selection import LinkCosts
from ringserve.worker.dataplane import keys
from ringserve.worker.dataplane.inbox import MISMATCH, Inbox, Received
from ringserve.worker.dataplane.links.stream import STREAM_METHOD, Link
from ringserve.worker.dataplane.policy import Place
from ringserve.worker.dataplane.pool import ResultPool
from ringserve.worker.dataplane.programs import Ring

__all__ = ["MISMATCH", "STREAM_METHOD", "Inbox", "LinkFigures", "Place", "Received", "Session", "ViewPlane",
           "check_members"]


class LinkFigures(Protocol):
    """A plane's link figures (``calibration.Measures`` ships it): given, or measured once per ring."""

    async def links(self, session: Session) -> LinkCosts: ...


class ViewPlane(Protocol):
    """What sessions and the collectives use of one view's data plane (``plane.Plane`` ships it)."""

    place: Place
    ring: Ring
    counters: Counters
    pool: ResultPool | None
    hierarchical: str
    algorithm: str  # RINGSERVE_ALGORITHM (selection.py)
    scale: int  # each payload byte stands for this many when algorithms are chosen (testing/netsim.py)
    checksum: bool
    timeline: Timeline | None
    numbering: keys.Numbering
    # join.py's hook while joined: told (key, descriptor) of a whole-view collective not opened here.
    on_unopened: Callable[[str, str], None] | None

    @property
    def view_id(self) -> int: ...

    @property
    def measures(self) -> LinkFigures: ...

    def session(self, members: tuple[int, ...] | None = None) -> Session: ...

    def open(self, name: str | None, descriptor: str, ring: Ring, spec: str = "", *,
             key: str | None = None) -> tuple[str, Inbox, Link | None]: ...

    def unopened(self) -> list[tuple[str, str]]: ...

    def waiting(self, key: str) -> bool: ...

    async def arrival(self) -> None: ...

    def release(self, key: str) -> None: ...

    def land(self, key: str, frames: list[tuple[int, int, np.ndarray]], dtype: int) -> None: ...

    async def withdraw(self, key: str) -> None: ...

    async def recv(self, key: str, inbox: Inbox, slot: int, chunk: int, source: int = -1) -> Received: ...

    def link_to(self, rank: int) -> Link | None: ...

    @property
    def linked_ranks(self) -> tuple[int, ...]: ...

    def send(self, link: Link | None, key: str, inbox: Inbox, *, slot: int, chunk: int,
             payload: np.ndarray | memoryview | bytes, dtype: int, count: int, origin: int = 0,
             origin_count: int = 0, codec: int = 0, volatile: bool = False) -> None: ...


def check_members(members: tuple[int, ...], rank: int, size: int) -> tuple[int, ...]:
    """``members`` as a tuple of ints, after checking that it is a ring this rank can run.

    Raises:
        InvalidArgumentError: a rank repeats or falls outside [0, size), or ``rank`` is missing.
    """
    ranks = tuple(int(m) for m in members)
    if not ranks:
        raise InvalidArgumentError("A ring needs at least one rank.")
    if len(set(ranks)) != len(ranks):
        raise InvalidArgumentError(f"The ranks of a ring ({ranks}) must not repeat.")
    outside = [m for m in ranks if not 0 <= m < size]
    if outside:
        raise InvalidArgumentError(f"Ranks {outside} of the ring {ranks} are not in [0, {size}) (the view's ranks).")
    if rank not in ranks:
        raise InvalidArgumentError(f"Rank {rank} is not a member of the ring {ranks}, so it cannot run its collectives.")
    return ranks


@functools.lru_cache(maxsize=256)  # a hierarchical allreduce opens two sub-rings a call, the same ones
def subring(view: Place, members: tuple[int, ...]) -> tuple[Ring, str, Place]:
    """The ring of ``members`` in ``view``, its key spec, and this rank's place in it.

    Raises:
        InvalidArgumentError: as check_members.
    """
    ranks = check_members(members, view.rank, view.size)
    ring = Ring(ranks, ranks.index(view.rank))
    place = replace(
        view, rank=ring.index, size=len(ranks),
        addresses=tuple(view.addresses[m] for m in ranks),
        worker_ids=tuple(view.worker_ids[m] for m in ranks) if view.worker_ids else (),
        hosts=tuple(view.hosts[m] for m in ranks) if view.hosts else (),
    )
    return ring, keys.spec_of(ranks), place


class Session:
    """A ring over the ranks of one view's plane: the whole view (``members`` None) or a sub-ring."""

    def __init__(self, plane: ViewPlane, members: tuple[int, ...] | None = None) -> None:
        self.plane = plane
        view = plane.place
        if members is None:
            self.ring, self.spec, self.place = plane.ring, "", view
        else:
            self.ring, self.spec, self.place = subring(view, tuple(members))
        self._next: Link | None = None

    @property
    def view_id(self) -> int:
        return self.plane.view_id

    @property
    def counters(self) -> Counters:
        return self.plane.counters

    @property
    def pool(self) -> ResultPool | None:
        return self.plane.pool

    @property
    def apart(self) -> bool:
        """Whether every rank of the ring is on a host of its own (RINGSERVE_HOSTNAME), as the view
        says: alike on every rank of it."""
        hosts = self.place.hosts
        return len(hosts) == self.place.size > 1 and len(set(hosts)) == len(hosts)

    @property
    def hierarchical(self) -> str:
        """The hierarchical allreduce setting (hierarchy.py); "0" on a sub-ring, which is its own ring."""
        return self.plane.hierarchical if not self.spec else "0"

    @property
    def algorithm(self) -> str:
        """RINGSERVE_ALGORITHM (selection.py): it applies to sub-rings too."""
        return self.plane.algorithm

    @property
    def checksum(self) -> bool:
        return self.plane.checksum

    @property
    def timeline(self) -> Timeline | None:
        return self.plane.timeline

    def open(self, name: str | None, descriptor: str, *, key: str | None = None) -> tuple[str, Inbox]:
        """Registers a collective; its key is equal on every rank of the ring that calls it in the
        same order. The link to the ring's next member opens here if this is its first use.

        ``key``: open that very key (a rank that has joined stands in for the others' collectives
        of the whole view, see join.py); the keys of its name it passes over stay open to their
        frames until opened.
        """
        key, inbox, self._next = self.plane.open(name, descriptor, self.ring, self.spec, key=key)
        return key, inbox

    def release(self, key: str) -> None:
        self.plane.release(key)

    def land(self, key: str, frames: list[tuple[int, int, np.ndarray]], dtype: int) -> None:
        """Frames (slot, chunk) of collective ``key`` may be read straight into their regions
        (programs/__init__.py's ``Land``; lanes/tcp/frames.py's ``Landings``)."""
        self.plane.land(key, frames, dtype)

    async def withdraw(self, key: str) -> None:
        """Forgets the regions of ``key`` that no frame was read into, once no lane's thread
        reads into one of them."""
        await self.plane.withdraw(key)

    async def recv(self, key: str, inbox: Inbox, slot: int, chunk: int, frm: int = -1) -> Received:
        """The frame (slot, chunk) of a collective, from the ring's previous member (or from the
        member at position ``frm``)."""
        ring = self.ring
        source = ring.members[frm] if frm >= 0 else ring.members[(ring.index - 1) % ring.size]
        return await self.plane.recv(key, inbox, slot, chunk, source)

    def _links(self, to: tuple[int, ...]) -> list[Link | None]:
        """The links to the members at positions ``to`` (opened now on first use)."""
        members = self.ring.members
        return [self.plane.link_to(members[p]) for p in to]

    def has_room(self, to: tuple[int, ...] = ()) -> bool:
        """Whether the link to the ring's next member (or the links to the members at positions
        ``to``) take another DATA frame now (see links/stream.py)."""
        if not to:
            link = self._next
            return link is None or link.has_room
        return all(link is None or link.has_room for link in self._links(to))

    async def flushed(self) -> None:
        """Waits until the payloads sent so far, on the links to any of the ring's members, no
        longer read the collective's buffers (see lanes/tcp/outbound.py): a program's buffers are the
        caller's again after this."""
        opened = set(self.plane.linked_ranks)
        for rank in self.ring.members:
            if rank in opened:
                link = self.plane.link_to(rank)
                if link is not None:
                    await link.flushed()

    async def room(self, to: tuple[int, ...] = ()) -> None:
        """Waits until the links may have room; check has_room again."""
        links = [self._next] if not to else self._links(to)
        for link in links:
            if link is not None and not link.has_room:
                await link.room()
                return

    def forward(self, frame: Received, to: tuple[int, ...] = ()) -> None:
        """Sends a received frame on to the ring's next member (or to the members at positions
        ``to``) as it is: same header, same payload."""
        for link in [self._next] if not to else self._links(to):
            if link is not None:
                link.forward(frame.header, frame.payload, frame.raw)

    def send(
        self,
        key: str,
        inbox: Inbox,
        *,
        slot: int,
        chunk: int,
        payload: np.ndarray | memoryview | bytes,
        dtype: int,
        count: int,
        origin: int = 0,
        origin_count: int = 0,
        codec: int = 0,
        to: tuple[int, ...] = (),
    ) -> None:
        """Sends one DATA frame to the ring's next member (or to each member at positions ``to``).

        A frame to a partner (``to``) is sent as volatile: a TCP payload lane sends from the
        caller's memory after this returns (lanes/tcp/outbound.py), and a partner's exchange may write that
        very region as soon as the partner's frame of it arrives (recursive doubling reduces in
        place what it has just sent), so the lane sends a copy of it (links/stream.py). The ring's frames
        need none: a region sent on is written again only with data that came back round the ring."""
        for link in [self._next] if not to else self._links(to):
            self.plane.send(link, key, inbox, slot=slot, chunk=chunk, payload=payload, dtype=dtype, count=count,
                            volatile=bool(to),
                            origin=origin, origin_count=origin_count, codec=codec)
