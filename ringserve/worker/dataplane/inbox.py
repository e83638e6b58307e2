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

    ``ring`` is the ring the collective runs over (its key names it, see plane.py), and ``source``
    the one rank whose stream may bring its frames: this rank's predecessor in that ring.
    """

    def __init__(self, ring: Ring | None = None, source: int = -1) -> None:
        self.ring = ring
        self.source = source
        self._slots: dict[tuple[int, int], asyncio.Future[Received]] = {}
        self.error: BaseException | None = None
        self._failed = asyncio.get_running_loop().create_future()
        self.descriptor: str | None = None
        self.known: dict[int, str] = {}
        self.abort_reason = MISMATCH
        self.abort_sent = False
        self._timer: asyncio.TimerHandle | None = None
        self._starved: BaseException | None = None
        self.span: Span | None = None
        self.announced = False  # its first frame was reported to a joined rank (Plane.on_unopened)

    def deliver(self, key: tuple[int, int], frame: Received) -> None:
        fut = self._slots.get(key)
        if fut is None:
            fut = self._slots[key] = asyncio.get_running_loop().create_future()
        if fut.done():
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
        return {f.header.sender_rank: f.header.descriptor for f in frames if f.header.descriptor != descriptor}

    async def take(self, key: tuple[int, int]) -> Received:
        if self.error is not None:
            raise self.error
        fut = self._slots.get(key)
        if fut is None:
            if self._starved is not None:
                raise self._starved
            fut = self._slots[key] = asyncio.get_running_loop().create_future()
        try:
            return await fut
        finally:
            self._slots.pop(key, None)

    def starve(self, exc: BaseException) -> None:
        """No more frames will come: frames already here stay takeable, waiting for others fails."""
        if self._starved is not None:
            return
        self._starved = exc
        for key, fut in list(self._slots.items()):
            if not fut.done():
                fut.set_exception(exc)
                del self._slots[key]

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
