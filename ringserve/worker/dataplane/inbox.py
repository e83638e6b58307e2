"""The frames of one collective as they arrive, and how that collective failed if it did."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NamedTuple

from ringserve import wire
from ringserve.errors import ProtocolError
from ringserve.observe import Span
from ringserve.worker.dataplane.programs import Ring

MISMATCH = "mismatch"  # the abort reason of ranks that disagree; any other reason is a corruption


class Received(NamedTuple):
    """A frame as it arrived: its header, a view of its payload, and its bytes for forwarding."""

    header: wire.FrameHeader
    payload: memoryview
    raw: bytes


class Inbox:
    """The frames of one collective, by (step, chunk), and how that collective failed if it did.

    ``ring`` is the ring the collective runs over (its key names it, see plane.py). Which of its
    members may send it frames depends on its program (routes.py): a ring's come from the
    predecessor only, a halving-doubling's from each partner. ``sinks`` are the ranks it sends
    to (set when it opens), so that a link that fails fails the collectives that use it.
    """

    def __init__(self, ring: Ring | None = None) -> None:
        self.ring = ring
        self.sinks: frozenset[int] = frozenset()
        self._slots: dict[tuple[int, int], asyncio.Future[Received]] = {}
        self._waiting: dict[tuple[int, int], int] = {}  # frames waited for: the rank each comes from
        self.error: BaseException | None = None
        self._failed = asyncio.get_running_loop().create_future()
        self.descriptor: str | None = None
        self.known: dict[int, str] = {}
        self._conflicts: dict[int, str] = {}  # senders of frames refused for a held one's key: descriptor
        self.abort_reason = MISMATCH
        self.abort_sent = False
        self._timer: asyncio.TimerHandle | None = None
        self._starved: dict[int, BaseException] = {}  # ranks whose stream in has ended
        self.span: Span | None = None
        self.announced = False  # its first frame was reported to a joined rank (Plane.on_unopened)

    @property
    def source(self) -> int:
        """The rank a ring's frames come from: the ring's predecessor (-1 in a ring of one)."""
        ring = self.ring
        if ring is None or ring.size == 1:
            return -1
        return ring.members[(ring.index - 1) % ring.size]

    def deliver(self, key: tuple[int, int], frame: Received) -> None:
        """Holds ``frame`` for take().

        A second frame for a held key is a disagreement where the two describe the collective
        differently (ranks that disagree on a broadcast's root each send the frames of their own
        tree, so one rank can get the same chunk from two parents before it opens the collective
        and learns which is foreign): it is kept as a foreign descriptor for ``foreign()``, which
        the plane turns into MismatchError. Otherwise (the same sender twice) it is a protocol error.
        """
        fut = self._slots.get(key)
        if fut is None:
            fut = self._slots[key] = asyncio.get_running_loop().create_future()
        if fut.done():
            held = None if fut.cancelled() or fut.exception() is not None else fut.result()
            if (held is not None and held.header.descriptor != frame.header.descriptor
                    and held.header.sender_rank != frame.header.sender_rank):
                self._conflicts[frame.header.sender_rank] = frame.header.descriptor
                return
            raise ProtocolError(f"Frame {key} of collective {frame.header.op_key!r} arrived twice.")
        fut.set_result(frame)

    def untaken(self) -> int:
        """How many frames arrived here and were never taken."""
        return sum(1 for f in self._slots.values() if f.done() and not f.cancelled() and f.exception() is None)

    def heard(self) -> str:
        """The descriptor of a frame already here ("" if none: only an abort came)."""
        frames = [f.result() for f in self._slots.values() if f.done() and not f.cancelled() and f.exception() is None]
        return frames[0].header.descriptor if frames else ""

    def foreign(self, descriptor: str) -> dict[int, str]:
        """The authors of frames already here whose descriptor differs from ``descriptor``."""
        frames = [f.result() for f in self._slots.values() if f.done() and not f.cancelled() and f.exception() is None]
        held = {f.header.sender_rank: f.header.descriptor for f in frames}
        return {rank: d for rank, d in (self._conflicts | held).items() if d != descriptor}

    async def take(self, key: tuple[int, int], source: int = -1) -> Received:
        """The frame ``key``, which comes from rank ``source`` (-1: the ring's predecessor)."""
        if self.error is not None:
            raise self.error
        if source < 0:
            source = self.source
        fut = self._slots.get(key)
        if fut is None:
            starved = self._starved.get(source)
            if starved is not None:
                raise starved
            fut = self._slots[key] = asyncio.get_running_loop().create_future()
        if not fut.done():
            self._waiting[key] = source
        try:
            return await fut
        finally:
            self._slots.pop(key, None)
            self._waiting.pop(key, None)

    def starve(self, exc: BaseException, source: int | None = None) -> None:
        """No more frames will come from rank ``source`` (None: from any rank): frames already
        here stay takeable, waiting for one from it fails."""
        for rank in (self.ring.members if source is None and self.ring is not None else (source,)):
            if rank is None or rank in self._starved:
                continue
            self._starved[rank] = exc
            for key, waited in list(self._waiting.items()):
                fut = self._slots.get(key)
                if waited == rank and fut is not None and not fut.done():
                    fut.set_exception(exc)
                    del self._slots[key]
                    del self._waiting[key]

    def fail(self, exc: BaseException) -> None:
        if self.error is not None:
            return
        self.error = exc
        for fut in self._slots.values():
            if not fut.done():
                fut.set_exception(exc)
        self._slots.clear()
        self._failed.set_result(exc)
        if self._timer is not None:
            self._timer.cancel()

    def fail_later(self, delay_s: float, make_error: Callable[[], BaseException]) -> None:
        """Fails the collective after delay_s unless something fails it sooner."""
        if self._timer is None and self.error is None:
            self._timer = asyncio.get_running_loop().call_later(
                delay_s, lambda: self.fail(make_error())
            )

    async def failure(self) -> BaseException:
        """Waits for fail() and returns its error."""
        return await asyncio.shield(self._failed)
