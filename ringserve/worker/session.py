"""One view's ring, as seen by one worker: the link to the successor, the frames received from
the predecessor sorted by collective, and the abort protocol for ranks that disagree.

A session lives exactly as long as its view. Closing it fails every collective still waiting on it,
and frames of any other view never reach it. How frames travel is the link's (see link.py): the
session builds DATA and ABORT frames, and routes the frames that arrive.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from ringserve import wire
from ringserve.errors import CorruptFrameError, MismatchError, ProtocolError, RingserveError
from ringserve.observe import Counters, Timeline
from ringserve.ring import predecessor, successor
from ringserve.worker.inbox import MISMATCH, Inbox, Received
from ringserve.worker.link import STREAM_METHOD, Link, StreamLink
from ringserve.worker.shared import OutboundRing

log = logging.getLogger("ringserve.worker")

# A joined rank opens the others' keys as their frames come (join.py); they come nearly in order,
# so a key far past the last of its name is a broken peer, not a gap to remember.
MAX_SKIPPED = 1 << 12

__all__ = ["MISMATCH", "STREAM_METHOD", "Inbox", "Place", "Received", "Session"]


@dataclass(frozen=True)
class Place:
    """Where this worker sits in a view."""

    view_id: int
    rank: int
    size: int
    addresses: tuple[str, ...]
    worker_ids: tuple[str, ...] = ()
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1


class Session:
    """The ring of one view, for one worker."""

    def __init__(
        self,
        place: Place,
        channel: grpc.aio.Channel | None,
        counters: Counters,
        abort_grace_s: float,
        drain_timeout_s: float = 10.0,
        timeline: Timeline | None = None,
        on_peer_failure: Callable[[int, int, str], None] | None = None,
        checksum: bool = False,
        ring: OutboundRing | None = None,
        link: Link | None = None,
    ) -> None:
        """``link`` moves this session's frames to the successor; without one, a ``channel`` to the
        successor makes a StreamLink, with ``ring`` as its shared-memory lane."""
        self.place = place
        self.checksum = checksum
        self._damaged = ""  # a damaged frame named no open collective: the next one is aborted
        self.counters = counters
        self.abort_grace_s = abort_grace_s
        self.drain_timeout_s = drain_timeout_s
        self.timeline = timeline
        self._on_peer_failure = on_peer_failure
        self._inboxes: dict[str, Inbox] = {}
        self._occurrences: defaultdict[str, int] = defaultdict(int)
        self._skipped: set[str] = set()  # keys passed over by an open with an explicit key (join.py)
        self.opened = 0  # collectives this rank opened of its own accord (not stand-ins) since its last join
        # join.py's hook while this rank has joined: called with the key and the descriptor of a
        # collective whose frames reach this rank before (or without) this rank opening it.
        self.on_unopened: Callable[[str, str], None] | None = None
        self.error: BaseException | None = None
        self.retired: BaseException | None = None
        self._starved: BaseException | None = None
        self._active = 0
        self._opened: dict[str, float] = {}
        # Frames that reached a collective which then finished without taking them: always 0
        # for programs whose ranks agree (the simulator checks it).
        self.unused = 0
        if link is None and channel is not None and place.size > 1:
            link = StreamLink(channel, self.successor_address, counters, drain_timeout_s=drain_timeout_s, lane=ring)
        elif ring is not None and (link is None or link.lane is not ring):
            ring.close()  # nobody to offer it to
        self._link = link
        if link is not None:
            hello = wire.FrameHeader(kind=wire.HELLO, view_id=place.view_id, sender_rank=place.rank)
            link.open(hello, self._link_failed)

    @property
    def view_id(self) -> int:
        return self.place.view_id

    @property
    def successor_address(self) -> str:
        return self.place.addresses[successor(self.place.rank, self.place.size)]

    # -- collectives' side -----------------------------------------------------------------

    def open(self, name: str | None, descriptor: str, *, key: str | None = None) -> tuple[str, Inbox]:
        """Registers a collective; its key is equal on every rank that calls it in the same order.

        ``key``: open that very key (a rank that has joined stands in for the others' collectives,
        see join.py); the keys of its name it passes over stay open to their frames until opened.
        """
        if self.error is not None:
            raise self.error
        if self.retired is not None:
            raise self.retired
        if key is None:
            base = name if name is not None else ""
            self._occurrences[base] += 1
            key = f"{base}#{self._occurrences[base]}"
            self.opened += 1
        else:
            base, _, number = key.rpartition("#")
            seen, n = self._occurrences[base], int(number)
            if n - seen > MAX_SKIPPED:
                raise ProtocolError(f"Collective {key!r} is {n - seen} past the last of its name on this rank.")
            self._skipped.update(f"{base}#{m}" for m in range(seen + 1, n))
            self._skipped.discard(key)
            self._occurrences[base] = max(seen, n)
        inbox = self._inbox(key)
        inbox.descriptor = descriptor
        inbox.known[self.place.rank] = descriptor
        foreign = inbox.foreign(descriptor)
        if foreign:
            self._start_abort(key, inbox, foreign)
        if self._damaged:
            self._start_abort(key, inbox, {}, reason=self._damaged)
            self._damaged = ""
        self._active += 1
        self._opened[key] = time.monotonic()
        return key, inbox

    def counts(self) -> dict[str, int]:
        """How many collectives of each name this rank has opened (the last key's number)."""
        return dict(self._occurrences)

    def behind(self, counts: dict[str, int]) -> bool:
        """Whether some collective of ``counts`` (another rank's) is one this rank has not opened."""
        return bool(self._skipped) or any(self._occurrences.get(b, 0) < n for b, n in counts.items())

    def unopened(self) -> list[tuple[str, str]]:
        """(key, descriptor) of the collectives with frames here that this rank has not opened."""
        return [(k, inbox.heard()) for k, inbox in self._inboxes.items() if inbox.descriptor is None]

    def stalled(self, older_than_s: float) -> list[str]:
        """Keys of the collectives in flight for longer than older_than_s."""
        now = time.monotonic()
        return sorted(k for k, t in self._opened.items() if now - t > older_than_s)

    def release(self, key: str) -> None:
        inbox = self._inboxes.pop(key, None)
        if inbox is not None and inbox.error is None:
            self.unused += inbox.untaken()
        self._opened.pop(key, None)
        self._active -= 1
        if self._active == 0 and self.retired is not None and self._link is not None:
            self._link.end()

    async def recv(self, key: str, inbox: Inbox, slot: int, chunk: int) -> Received:
        """The frame (slot, chunk) of a collective, after checking its author ran the same call.

        A slot names what a frame carries (a ring step, a segment, an origin rank), chosen so that
        a frame forwarded unchanged keeps its key from hop to hop.
        """
        frame = await inbox.take((slot, chunk))
        if frame.header.descriptor != inbox.descriptor:
            self._start_abort(key, inbox, {frame.header.sender_rank: frame.header.descriptor})
            raise await inbox.failure()
        return frame

    def has_room(self) -> bool:
        """Whether the link to the successor takes another DATA frame now (see link.py)."""
        return self._link is None or self._link.has_room

    async def room(self) -> None:
        """Waits until the link may have room; check has_room again."""
        if self._link is not None:
            await self._link.room()

    def forward(self, frame: Received) -> None:
        """Sends a received frame on to the successor as it is: the same header, the same payload."""
        if self._link is not None:
            self._link.forward(frame.header, frame.payload, frame.raw)

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
        """Sends one DATA frame; with ``checksum`` on, its header carries the frame's crc32."""
        header = wire.FrameHeader(
            kind=wire.DATA,
            view_id=self.place.view_id,
            sender_rank=self.place.rank,
            op_key=key,
            descriptor=inbox.descriptor,
            step=slot,
            chunk=chunk,
            origin=origin,
            origin_count=origin_count,
            dtype=dtype,  # type: ignore[arg-type]
            count=count,
            codec=codec,  # type: ignore[arg-type]
        )
        if self.checksum:
            header.crc32 = wire.frame_crc(header, payload)
        if self._link is not None:
            self._link.send(header, payload)

    # -- the peer server's side ------------------------------------------------------------

    def check_sender(self, hello: wire.FrameHeader) -> None:
        """Accepts a stream only from this view's predecessor."""
        expected = predecessor(self.place.rank, self.place.size)
        if hello.sender_rank != expected:
            raise ProtocolError(
                f"A stream claims rank {hello.sender_rank}, but rank {expected} is the only "
                f"predecessor of rank {self.place.rank} in view {self.view_id}."
            )

    def on_frame(self, frame: Received) -> None:
        """Routes one frame from the predecessor to its collective."""
        header = frame.header
        self.counters.bytes_received += len(frame.raw) + header.shm_bytes
        if header.kind == wire.DATA:
            damage = self._damage(frame)
            if damage:
                self.counters.frames_rejected += 1
                self._on_damage(header.op_key, damage)
                return
        if self._finished(header.op_key):
            # A collective this rank already finished or gave up on: a late data frame is
            # dropped; an abort is still passed on (the other ranks' laps need it) but kept nowhere.
            if header.kind == wire.ABORT:
                self._on_abort(header.op_key, Inbox(), header)
            else:
                self.counters.frames_rejected += 1
            return
        inbox = self._inbox(header.op_key)
        if inbox.descriptor is None and self.on_unopened is not None and not inbox.announced:
            inbox.announced = True
            self.on_unopened(header.op_key, header.descriptor)
        if header.kind == wire.DATA:
            if inbox.error is None:
                inbox.deliver((header.step, header.chunk), frame)
                # Checked on arrival too, not only when taken: a rank that disagrees on the root
                # waits for frames that never come, and never takes the ones that did.
                if inbox.descriptor is not None and header.descriptor != inbox.descriptor:
                    self._start_abort(header.op_key, inbox, {header.sender_rank: header.descriptor})
        elif header.kind == wire.ABORT:
            self._on_abort(header.op_key, inbox, header)
        else:
            raise ProtocolError(f"A frame of kind {header.kind} is not expected mid-stream.")

    def retire(self, exc: BaseException) -> None:
        """Ends the view softly: new collectives fail with exc, those in flight may finish.

        Once none is in flight, the stream to the successor ends cleanly, which tells the
        successor that nothing more will come (see starve); so a drain ends within one lap.
        """
        if self.retired is not None or self.error is not None:
            return
        self.retired = exc
        if self._active == 0 and self._link is not None:
            self._link.end()

    def predecessor_gone(self, exc: BaseException) -> None:
        """The stream from the predecessor ended: collectives waiting for more frames fail with exc."""
        if self._starved is None:
            self._starved = exc
        for inbox in self._inboxes.values():
            inbox.starve(self._starved)

    def close(self, exc: BaseException) -> None:
        """Fails every collective of this view with exc and stops sending at once."""
        if self.error is None:
            self.error = exc
        for inbox in self._inboxes.values():
            inbox.fail(exc)
        if self._link is not None:
            self._link.close()

    @property
    def drained(self) -> bool:
        """True once the link to the successor has ended (or there never was one)."""
        return self._link is None or self._link.done

    async def wait_closed(self) -> None:
        """Waits for the link to the successor to end. A cancelled caller stays cancelled (and the
        link runs on), so one deadline covers the waits on several sessions."""
        if self._link is not None:
            await self._link.wait_closed()

    # -- internals -------------------------------------------------------------------------

    def _finished(self, key: str) -> bool:
        """Whether ``key`` names a collective this rank opened and has since released."""
        if key in self._inboxes:
            return False
        base, _, number = key.rpartition("#")
        return number.isdigit() and int(number) <= self._occurrences.get(base, 0) and key not in self._skipped

    def _inbox(self, key: str) -> Inbox:
        inbox = self._inboxes.get(key)
        if inbox is None:
            inbox = self._inboxes[key] = Inbox()
            if self.error is not None:
                inbox.fail(self.error)
            elif self._starved is not None:
                inbox.starve(self._starved)
        return inbox

    def _link_failed(self, exc: BaseException, why: str) -> None:
        """The link to the successor failed: every collective fails, and, if the successor looks
        dead (``why``), the coordinator hears of it."""
        self.close(exc)
        if why and self._on_peer_failure is not None:
            self._on_peer_failure(self.view_id, successor(self.place.rank, self.place.size), why)

    def _damage(self, frame: Received) -> str:
        """Why a DATA frame must not be used ("" if it may): a failed or a missing checksum."""
        header = frame.header
        where = (f"frame {header.step}/{header.chunk} from rank {header.sender_rank} reached rank "
                 f"{self.place.rank} in view {self.view_id}")
        if header.HasField("crc32"):
            if wire.frame_crc(header, frame.payload) != header.crc32:
                return f"{where} corrupted (crc32 mismatch); it was not used"
        elif self.checksum:
            return (f"{where} without a checksum, but this worker requires checksums "
                    f"(set RINGSERVE_CHECKSUM on every worker)")
        return ""

    def _on_damage(self, key: str, reason: str) -> None:
        """Aborts the collective a damaged frame belongs to, on every rank.

        The checksum covers the header too, so the collective the frame names may itself be
        damaged: if no collective of that name is open here, every open one is aborted, and if
        none is open, the next one to open is. A frame is never used, and no collective is left
        waiting for a frame that will not come.
        """
        if self._finished(key):
            return
        if key in self._inboxes:
            keys = [key]
        else:
            keys = list(self._inboxes)
            if not keys:
                self._damaged = reason
        for k in keys:
            self._start_abort(k, self._inboxes[k], {}, reason=reason)

    def _abort_error(self, key: str, inbox: Inbox) -> RingserveError:
        if inbox.abort_reason == MISMATCH:
            return MismatchError(key, inbox.known)
        return CorruptFrameError(key, inbox.abort_reason)

    def _start_abort(self, key: str, inbox: Inbox, descriptors: dict[int, str], reason: str = MISMATCH) -> None:
        inbox.known.update(descriptors)
        if reason != MISMATCH:
            inbox.abort_reason = reason
        if inbox.abort_sent:
            return
        inbox.abort_sent = True
        inbox.fail_later(self.abort_grace_s, lambda: self._abort_error(key, inbox))
        if reason == MISMATCH:
            log.warning("rank %d view %d: collective %r disagrees with its predecessor: %s",
                        self.place.rank, self.view_id, key, inbox.known)
        else:
            log.error("rank %d view %d: collective %r aborted: %s", self.place.rank, self.view_id, key, reason)
        self._send_abort(key, inbox, origin=self.place.rank, final=False)

    def _send_abort(self, key: str, inbox: Inbox, *, origin: int, final: bool) -> None:
        header = wire.FrameHeader(
            kind=wire.ABORT,
            view_id=self.view_id,
            sender_rank=self.place.rank,
            op_key=key,
            reason=inbox.abort_reason,
            abort_origin=origin,
            abort_final=final,
        )
        header.rank_descriptors.update(inbox.known)
        if self._link is not None:
            self._link.control(wire.encode(header))

    def _on_abort(self, key: str, inbox: Inbox, header: wire.FrameHeader) -> None:
        # Lap 1 collects every rank's descriptor on its way round the ring; lap 2 (final) hands the
        # full list to everyone. A rank fails its collective on the final lap, or after a grace.
        inbox.known.update(header.rank_descriptors)
        if header.reason and header.reason != MISMATCH:
            inbox.abort_reason = header.reason
        me = self.place.rank
        if header.abort_origin != me:
            self._send_abort(key, inbox, origin=header.abort_origin, final=header.abort_final)
        elif not header.abort_final:
            self._send_abort(key, inbox, origin=me, final=True)
        if header.abort_final or header.abort_origin == me:
            inbox.fail(self._abort_error(key, inbox))
        else:
            inbox.abort_sent = True
            inbox.fail_later(self.abort_grace_s, lambda: self._abort_error(key, inbox))
