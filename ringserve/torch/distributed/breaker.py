"""A process group after a timeout: broken for good, on every rank of it, as gloo's is.

Once an op of a torch group passed its timeout on some rank, the ranks no longer agree on where
they are in the group's sequence of ops. Left alone, the late rank would find the frames that the
timed-out rank sent before it gave up, and its op would *succeed*, while the timed-out rank's
next op met the late rank's last one: the ranks' op numbers out of step, later ops timing out or
failing with MismatchError. gloo closes the group's connections on a timeout ("Application
timeout caused pair closure"), so every later op of the group fails on every rank, at once.

Here a group's ``Breaker`` does the same, over ringserve's point-to-point path:

- **Tripped by a timeout.** An op of the group that fails with CollectiveTimeoutError trips it on
  the loop, where the timeout is raised, before any later op of the group starts there. The rank
  then sends every other member of the group a *notice*: a message of NOTICE_BYTES that says which
  op timed out, on which rank, after how long. A send is eager (worker/ops/p2p.py): the notice
  waits in the peer's inbox until read, whatever the peer is doing.
- **Tripped by a notice.** Every op of the group, on the loop and before it opens its collective,
  looks for a notice from each member (``pending``: a dictionary look-up per member). An op that
  finds one reads it, trips the breaker with its words, and fails; it never runs. So the late
  rank's op fails instead of consuming the frames the timed-out rank left behind.
- **After a trip** every op of the group fails at once, before it starts (group._check), with
  DistBackendError caused by ``GroupTimedOutError``, which names the op that timed out, the rank,
  and the group's timeout. Other groups, the default one included, have breakers of their own.

Only the group's own ops trip it (those made through ProcessGroupRingserve's op methods, which
name themselves with ``name_op``): monitored_barrier's waits are meant to time out and report.
A late rank whose op was already in flight when the notice came may finish it, or time out in
it; either way its next op of the group fails, which is as far as any rank can know.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import numpy as np

from ringserve.errors import CollectiveTimeoutError, GroupTimedOutError
from ringserve.worker.dataplane import keys
from ringserve.worker.dataplane.session import ViewPlane
from ringserve.worker.ops import p2p

log = logging.getLogger("ringserve.torch")

# The size of a notice: its words, in UTF-8, padded with zeros (a recv needs the size in advance).
NOTICE_BYTES = 2048

_local = threading.local()


def name_op(what: str | None) -> str | None:
    """Names the torch op being made on this thread (None: none); returns the name it replaces."""
    previous: str | None = getattr(_local, "what", None)
    _local.what = what
    return previous


def op_name() -> str | None:
    """The torch op being made on this thread (see ``name_op``), or None."""
    return getattr(_local, "what", None)


class Breaker:
    """Whether the ops of one torch group may still run (see the module's docstring).

    Args:
        name: the name its notices travel under (the group's own).
        rank: this rank's group rank.
        members: the view ranks of the group, in group-rank order.
        timeout_s: the group's timeout, named in its errors.
    """

    def __init__(self, *, name: str, rank: int, members: tuple[int, ...], timeout_s: float) -> None:
        self.name = name
        self.rank = rank
        self.members = members
        self.timeout_s = timeout_s
        me = members[rank]
        # (group rank, view rank, ring spec of its notices to this rank) of every other member.
        self._senders = [(g, r, keys.spec_of(p2p.pair(r, me))) for g, r in enumerate(members) if r != me]
        self.reason: str | None = None  # set once, on the loop; read from any thread

    def error(self) -> GroupTimedOutError | None:
        """What every op of the group fails with once the breaker tripped (None: not tripped)."""
        reason = self.reason
        if reason is None:
            return None
        return GroupTimedOutError(
            f"{reason} After a timeout every op of the group fails, on every rank of it, as gloo's do: make a new "
            "group (dist.new_group) to go on."
        )

    def pending(self, plane: ViewPlane) -> int | None:
        """The view rank of a member whose notice waits here, unread (None: none). On the loop."""
        waiting, peek, name = plane.waiting, plane.numbering.peek, self.name
        return next((r for _, r, spec in self._senders if waiting(peek(name, spec))), None)

    async def read(self, plane: ViewPlane, sender: int, *, chunk_bytes: int, timeout_s: float) -> None:
        """Reads the notice of view rank ``sender`` (``pending``'s) and trips with its words. On the loop."""
        group_rank = self.members.index(sender)
        if self.reason is None:  # at once: ops that start while the notice is read fail too
            self.reason = (f"An op of the group timed out on rank {group_rank} of the group (the group's timeout "
                           f"is {self.timeout_s:g} s).")
        buffer = np.zeros(NOTICE_BYTES, dtype=np.uint8)
        try:
            await p2p.recv(plane.session(p2p.pair(sender, self.members[self.rank])), buffer, name=self.name,
                           chunk_bytes=chunk_bytes, timeout_s=timeout_s)
        except Exception as exc:  # the words are lost, not the trip: the reason above stands
            log.warning("rank %d of group %s, view %d: the notice of rank %d of the group could not be read: %s",
                        self.rank, self.name, plane.view_id, group_rank, exc)
            return
        self.reason = buffer.tobytes().rstrip(b"\0").decode("utf-8", "replace")

    async def trip(self, plane: ViewPlane, what: str, exc: CollectiveTimeoutError, *, chunk_bytes: int,
                   timeout_s: float) -> None:
        """``what``, an op of the group, timed out here with ``exc`` after ``timeout_s``: trips the
        breaker (if no earlier timeout did) and sends every other member its notice. On the loop."""
        if self.reason is not None:
            return
        whose = ("the group's timeout" if timeout_s == self.timeout_s
                 else f"the op's own timeout (the group's is {self.timeout_s:g} s)")
        self.reason = f"{what} timed out on rank {self.rank} of the group after {timeout_s:g} s, {whose}: {exc}"
        log.warning("rank %d of group %s, view %d: %s The group is broken: telling its other members.",
                    self.rank, self.name, plane.view_id, self.reason)
        words = self.reason.encode("utf-8")[:NOTICE_BYTES]
        notice = np.zeros(NOTICE_BYTES, dtype=np.uint8)
        notice[:len(words)] = np.frombuffer(words, dtype=np.uint8)
        me = self.members[self.rank]
        sent = await asyncio.gather(*(
            p2p.send(plane.session(p2p.pair(me, r)), notice, name=self.name, chunk_bytes=chunk_bytes,
                     timeout_s=timeout_s)
            for _, r, _ in self._senders), return_exceptions=True)
        for (g, _, _), result in zip(self._senders, sent, strict=True):
            if isinstance(result, BaseException):  # a peer gone: its own ops of the group fail anyway
                log.warning("rank %d of group %s, view %d: the notice to rank %d of the group was not sent: %s",
                            self.rank, self.name, plane.view_id, g, result)
