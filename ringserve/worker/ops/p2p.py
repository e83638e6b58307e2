"""Point-to-point messages: a send on one rank and its recv on another, over the view's links.

A message from rank s to rank d of a view is a collective of the two-member ring ``(s, d)``
(session.py), run by the executor like any other: its key ``name#n/s.d`` names its direction, so
the n-th message called ``name`` from s to d meets exactly the n-th recv called ``name`` from s on
d. Messages 0 -> 2 and 2 -> 0 in flight at once are keyed apart, and so are messages of different
names (torch's tags are names: a recv matches the sends of its source and tag, in order). Frames
that arrive before their recv is opened wait in its inbox (plane.py), so a send never waits for
its recv to be posted.

- **A send** (programs.message) is done once its frames are on the link to the receiver: an
  eager send, as gloo's is. With checksums on, the executor's confirmation lap makes it wait for
  the receiver too.
- **A recv** places the frames straight into its buffer. The descriptor carries the dtype and
  size, so a recv whose buffer differs from what was sent fails with MismatchError naming both.
- **A recv from any source** (``recv_any``) waits for the first frame of the next message of its
  name from any of its candidate senders (frames that came before it was posted count), then
  receives that message as a recv from that sender would: so it takes the message a recv from
  that sender would have taken, and leaves the others' messages to later recvs.
- **Failures** are the executor's and the plane's: the deadline (CollectiveTimeoutError), the
  sender's stream ending (PeerUnavailableError), the view changing (RingChangedError).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ringserve.errors import CollectiveTimeoutError, InvalidArgumentError
from ringserve.worker.dataplane import keys, programs
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.programs import executor
from ringserve.worker.dataplane.session import Session
from ringserve.worker.dataplane.values import Blocks

if TYPE_CHECKING:
    from ringserve.worker.dataplane.session import ViewPlane


def pair(src: int, dst: int) -> tuple[int, int]:
    """The ring a message from view rank ``src`` to view rank ``dst`` runs over.

    Raises:
        InvalidArgumentError: ``src`` and ``dst`` are the same rank.
    """
    if src == dst:
        raise InvalidArgumentError(f"A message from rank {src} to itself cannot be sent: copy the tensor instead.")
    return (int(src), int(dst))


def _descriptor(flat: np.ndarray) -> Descriptor:
    return Descriptor("message", dtype=flat.dtype.name, count=flat.size)


def _check(session: Session, position: int, what: str) -> None:
    ring = session.ring
    if ring.size != 2 or ring.index != position:
        raise InvalidArgumentError(
            f"A {what} runs on the ring (sender, receiver), but this session is the ring {ring.members} at "
            f"position {ring.index}."
        )


async def send(session: Session, data: np.ndarray, *, name: str, chunk_bytes: int, timeout_s: float) -> None:
    """Sends ``data`` (any array; it travels flat, in C order) to the session's other member.

    Raises:
        InvalidArgumentError: the session is not a ring (this rank, receiver).
        CollectiveTimeoutError, PeerUnavailableError, RingChangedError: as any collective.
    """
    _check(session, 0, "send")
    flat = np.ascontiguousarray(data).reshape(-1)
    values = Blocks(flat.dtype, [flat, None])
    program = programs.message(session.ring, flat.size, max(1, chunk_bytes // flat.dtype.itemsize))
    await executor.run(session, name, _descriptor(flat), timeout_s, program, values)


async def recv(session: Session, out: np.ndarray, *, name: str, chunk_bytes: int, timeout_s: float) -> np.ndarray:
    """Receives the session's other member's message into ``out`` (a writable, C-contiguous
    array of the message's dtype and size) and returns ``out``.

    Raises:
        InvalidArgumentError: the session is not a ring (sender, this rank), or ``out`` is not
            writable and contiguous.
        MismatchError: the sender sent another dtype or size.
        CollectiveTimeoutError, PeerUnavailableError, RingChangedError: as any collective.
    """
    _check(session, 1, "recv")
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgumentError("A recv needs a writable, C-contiguous numpy array to receive into.")
    flat = out.reshape(-1)
    # The block to fill is ``out`` itself: Blocks.place writes frames in place when the size fits.
    values = Blocks(flat.dtype, [flat, None], expect=[flat.size, None])
    program = programs.message(session.ring, flat.size, max(1, chunk_bytes // flat.dtype.itemsize))
    await executor.run(session, name, _descriptor(flat), timeout_s, program, values)
    return out


async def recv_any(plane: ViewPlane, out: np.ndarray, *, name: str, sources: Sequence[int], chunk_bytes: int,
                   timeout_s: float) -> int:
    """Receives into ``out`` the next message called ``name`` from whichever of the view ranks
    ``sources`` sent one first (the lowest rank among those already here), and returns its rank.

    Raises:
        CollectiveTimeoutError: no message came within ``timeout_s`` (or it did not finish in it).
        InvalidArgumentError, MismatchError, PeerUnavailableError, RingChangedError: as ``recv``.
    """
    me = plane.place.rank
    rings = {int(s): pair(s, me) for s in sorted(sources)}
    if not rings:
        raise InvalidArgumentError(f"A recv from any source needs a rank to receive from besides rank {me}.")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    sender = None
    try:
        async with asyncio.timeout(timeout_s):
            while sender is None:
                # Checked after every wake-up, and opened below before any other await: two recvs
                # from any source never pick the same message.
                sender = next((s for s, ring in rings.items()
                               if plane.waiting(plane.numbering.peek(name, keys.spec_of(ring)))), None)
                if sender is None:
                    await plane.arrival()
    except TimeoutError:
        raise CollectiveTimeoutError(
            f"A recv of {name!r} from any of ranks {list(rings)} timed out: no message came within {timeout_s:g} s "
            f"on rank {me} of view {plane.view_id}."
        ) from None
    await recv(plane.session(rings[sender]), out, name=name, chunk_bytes=chunk_bytes,
               timeout_s=max(deadline - loop.time(), 1e-3))
    return sender
