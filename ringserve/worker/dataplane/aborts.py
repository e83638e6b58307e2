"""The abort protocol: how every rank of a collective's ring learns that it failed, and why.

A rank starts an abort when it finds that a peer ran the collective with other arguments (the
descriptors differ: a mismatch), or that a frame of it was damaged (a checksum failed). The abort
goes round the collective's ring twice, by the links its frames take: lap 1 collects every rank's
descriptor on its way, lap 2 (``final``) hands the full list to everyone. A rank fails its
collective on the final lap, or ``grace_s`` after it first heard of the abort, whichever comes
first, with MismatchError (every rank's arguments named) or CorruptFrameError. So no rank returns
a result the others do not, and none waits for frames that will not come.

Abort frames are sent from the receive path and never wait for room on a link (see links/stream.py).
``Aborts`` sends nothing itself: each call returns the encoded ABORT frame to pass on to the next
rank of the collective's ring (or None), and the plane sends it, so this holds no link and no
reference back to the plane.
"""

from __future__ import annotations

import logging

from ringserve import wire
from ringserve.errors import CorruptFrameError, MismatchError, RingserveError
from ringserve.worker.dataplane.inbox import MISMATCH, Inbox, Received

log = logging.getLogger("ringserve.worker")


def damage(frame: Received, rank: int, view_id: int, checksum: bool) -> str:
    """Why a DATA frame that reached ``rank`` must not be used ("" if it may): a failed checksum,
    or a missing one where this worker requires ``checksum``. Pure: it reads the frame only."""
    header = frame.header
    where = (f"frame {header.step}/{header.chunk} from rank {header.sender_rank} reached rank "
             f"{rank} in view {view_id}")
    if header.HasField("crc32"):
        if wire.frame_crc(header, frame.payload) != header.crc32:
            return f"{where} corrupted (crc32 mismatch); it was not used"
    elif checksum:
        return (f"{where} without a checksum, but this worker requires checksums "
                f"(set RINGSERVE_CHECKSUM on every worker)")
    return ""


class Aborts:
    """The abort protocol of one plane: this rank of one view."""

    def __init__(self, rank: int, view_id: int, grace_s: float) -> None:
        self.rank = rank
        self.view_id = view_id
        self.grace_s = grace_s

    def error(self, key: str, inbox: Inbox) -> RingserveError:
        """What a collective aborted for fails with."""
        if inbox.abort_reason == MISMATCH:
            return MismatchError(key, inbox.known)
        return CorruptFrameError(key, inbox.abort_reason)

    def start(self, key: str, inbox: Inbox, descriptors: dict[int, str], reason: str = MISMATCH) -> bytes | None:
        """Starts an abort of ``key`` here: ``descriptors`` are the arguments found to differ, or
        ``reason`` says what was damaged. Returns the frame to pass on, if any."""
        inbox.known.update(descriptors)
        if reason != MISMATCH:
            inbox.abort_reason = reason
        if inbox.abort_sent:
            return None
        inbox.abort_sent = True
        inbox.fail_later(self.grace_s, lambda: self.error(key, inbox))
        if reason == MISMATCH:
            log.warning("rank %d view %d: collective %r disagrees with its predecessor: %s",
                        self.rank, self.view_id, key, inbox.known)
        else:
            log.error("rank %d view %d: collective %r aborted: %s", self.rank, self.view_id, key, reason)
        return self._frame(key, inbox, origin=self.rank, final=False)

    def received(self, key: str, inbox: Inbox, header: wire.FrameHeader) -> bytes | None:
        """An ABORT frame of ``key`` arrived: fails the collective when due; returns the frame to
        pass on, if any."""
        inbox.known.update(header.rank_descriptors)
        if header.reason and header.reason != MISMATCH:
            inbox.abort_reason = header.reason
        me = self.rank
        frame = None
        if header.abort_origin != me:
            frame = self._frame(key, inbox, origin=header.abort_origin, final=header.abort_final)
        elif not header.abort_final:
            frame = self._frame(key, inbox, origin=me, final=True)
        if header.abort_final or header.abort_origin == me:
            inbox.fail(self.error(key, inbox))
        else:
            inbox.abort_sent = True
            inbox.fail_later(self.grace_s, lambda: self.error(key, inbox))
        return frame

    def _frame(self, key: str, inbox: Inbox, *, origin: int, final: bool) -> bytes | None:
        ring = inbox.ring
        if ring is None or ring.size == 1:
            return None
        header = wire.FrameHeader(
            kind=wire.ABORT,
            view_id=self.view_id,
            sender_rank=self.rank,
            op_key=key,
            reason=inbox.abort_reason,
            abort_origin=origin,
            abort_final=final,
        )
        header.rank_descriptors.update(inbox.known)
        return wire.encode(header)
