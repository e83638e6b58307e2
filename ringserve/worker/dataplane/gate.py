"""The peer server's gate: how many peer streams may be unproven at once, and for how long.

A peer stream is *unverified* from its start until its HELLO has been checked against a view
this worker holds (the sender is another rank of that view; see peers.py and ``Plane.accept``). Anyone who can reach the port can
open streams, and one that never sends a HELLO (or names a view that never comes) would hold a
server slot for ever: 63 of them once filled a worker's 64 RPC slots, and after the next view
change the real predecessor's stream was refused and the ring could not form again.

So the gate, not gRPC's RPC cap, bounds the streams that have proved nothing:

- at most ``cap`` are unverified at once. A new stream beyond it is let in and the *oldest*
  unverified one is ended (RESOURCE_EXHAUSTED): refusing the newcomer instead would let streams
  that squat on the slots keep out the real predecessor, whose stream is unverified too until
  its HELLO (its first frame, sent at once) is read. To keep the ring out, a flood must now open
  ``cap`` streams in less time than the predecessor's HELLO takes to arrive, without pause;
- each must be verified within ``deadline_s`` of its start, or it is ended (DEADLINE_EXCEEDED);
- a verified stream leaves the gate: it never counts against the cap, so the real ring always
  gets in (gRPC's own cap is set above this one, see ``WorkerConfig.server_rpc_cap``).

A HELLO for a view this worker has not installed yet (its sender heard of the view first) stays
unverified until the view is installed: its stream reads nothing more until then, and is verified
when the view comes, within its deadline.

Without a job token or mTLS a stranger who knows the view and a member's rank can still pass as
that member; the gate bounds the ones that cannot.
"""

from __future__ import annotations

import asyncio
import contextlib

from ringserve import wire


class Pass:
    """One admitted stream's standing: its HELLO once read, and whether it was verified."""

    __slots__ = ("deadline", "evicted", "hello", "verified")

    def __init__(self) -> None:
        self.hello: wire.FrameHeader | None = None
        self.verified = False
        self.evicted = False  # ended to make room for a newer stream (its deadline brought forward)
        self.deadline: asyncio.Timeout | None = None


class StreamGate:
    """Counts the unverified peer streams of one server and verifies them.

    Example:
        ```python
        gate = StreamGate(cap=16, deadline_s=10.0)
        admitted = gate.enter()          # the oldest unverified stream may be evicted for it
        async with asyncio.timeout(gate.deadline_s) as admitted.deadline:
            ...                          # TimeoutError: too slow, or admitted.evicted
        gate.verify(admitted)            # its HELLO checked out: the deadline is lifted
        gate.leave(admitted)             # the stream ended, verified or not
        ```
    """

    def __init__(self, *, cap: int, deadline_s: float) -> None:
        self.cap = cap
        self.deadline_s = deadline_s
        self._waiting: dict[Pass, None] = {}  # an ordered set: the oldest first

    @property
    def unverified(self) -> int:
        return len(self._waiting)

    def enter(self) -> Pass:
        """Admits a new stream; with ``cap`` streams unverified already, the oldest is evicted.

        The caller sets the new pass's ``deadline`` before its next await, so that a later
        eviction can bring it forward.
        """
        while len(self._waiting) >= self.cap:
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.evicted = True
            if oldest.deadline is not None and not oldest.deadline.expired():
                with contextlib.suppress(RuntimeError):  # already ending
                    oldest.deadline.reschedule(asyncio.get_running_loop().time())
        admitted = Pass()
        self._waiting[admitted] = None
        return admitted

    def verify(self, admitted: Pass) -> None:
        """The stream's HELLO checked out: it leaves the count, and its deadline is lifted."""
        if admitted.verified:
            return
        admitted.verified = True
        self._waiting.pop(admitted, None)
        deadline = admitted.deadline
        # A deadline already past, or a stream already ending, keeps its course.
        if deadline is not None and not deadline.expired():
            with contextlib.suppress(RuntimeError):
                deadline.reschedule(None)

    def leave(self, admitted: Pass) -> None:
        self._waiting.pop(admitted, None)
