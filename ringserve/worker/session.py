"""A session: the ring a collective runs over, on one view's plane (plane.py).

Programs (programs.py) work in ring positions over a ``Ring(members, index)``, and the executor
(executor.py) runs them on a session: it opens the collective here, sends on the link to the ring's
next member, and receives what the ring's previous member sends. Today every session spans the
whole view.

Sessions are cheap and hold nothing the plane does not: the worker makes one per collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ringserve.observe import Counters, Timeline
from ringserve.worker.inbox import MISMATCH, Inbox, Received
from ringserve.worker.link import STREAM_METHOD, Link
from ringserve.worker.policy import Place
from ringserve.worker.programs import Ring

if TYPE_CHECKING:
    from ringserve.worker.plane import Plane

__all__ = ["MISMATCH", "STREAM_METHOD", "Inbox", "Place", "Received", "Session"]


class Session:
    """A ring over the ranks of one view's plane."""

    def __init__(self, plane: Plane) -> None:
        self.plane = plane
        self.ring: Ring = plane.ring
        self.spec = ""
        self.place = plane.place
        self._next: Link | None = None

    @property
    def view_id(self) -> int:
        return self.plane.view_id

    @property
    def counters(self) -> Counters:
        return self.plane.counters

    @property
    def checksum(self) -> bool:
        return self.plane.checksum

    @property
    def timeline(self) -> Timeline | None:
        return self.plane.timeline

    def open(self, name: str | None, descriptor: str) -> tuple[str, Inbox]:
        """Registers a collective; its key is equal on every rank of the ring that calls it in the
        same order. The link to the ring's next member opens here if this is its first use."""
        key, inbox, self._next = self.plane.open(name, descriptor, self.ring, self.spec)
        return key, inbox

    def release(self, key: str) -> None:
        self.plane.release(key)

    async def recv(self, key: str, inbox: Inbox, slot: int, chunk: int) -> Received:
        """The frame (slot, chunk) of a collective, from the ring's previous member."""
        return await self.plane.recv(key, inbox, slot, chunk)

    def has_room(self) -> bool:
        """Whether the link to the ring's next member takes another DATA frame now (see link.py)."""
        link = self._next
        return link is None or link.has_room

    async def room(self) -> None:
        """Waits until the link may have room; check has_room again."""
        if self._next is not None:
            await self._next.room()

    def forward(self, frame: Received) -> None:
        """Sends a received frame on to the ring's next member as it is: same header, same payload."""
        if self._next is not None:
            self._next.forward(frame.header, frame.payload, frame.raw)

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
    ) -> None:
        """Sends one DATA frame to the ring's next member."""
        self.plane.send(self._next, key, inbox, slot=slot, chunk=chunk, payload=payload, dtype=dtype, count=count,
                        origin=origin, origin_count=origin_count, codec=codec)
