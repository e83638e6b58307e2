"""The ring a process group runs on: its ranks, and ringserve's collectives started on them.

This is the one seam between the torch process group (group.py) and ringserve's worker. Every
op of the group is one or more of these calls; each returns the concurrent future of the call on
the worker's event loop.

- **The default group** runs over the whole view (``members`` None); its ranks are the view's.
- **A ``new_group(ranks)``** is a sub-ring of the view (``subset``): its collectives run on the
  worker's session over ``members``, the group's global ranks in group-rank order, so group rank
  ``i`` is position ``i`` of the ring, and roots and blocks are counted in group ranks, as torch
  counts them. Keys name their ring (worker/dataplane/keys.py), so a group's collectives never meet the
  world's or another group's, whatever order the ranks issue them in. A group of every rank in
  rank order is the whole view, numbered apart by its tag.
- **send / recv** run over the two-member ring (sender, receiver) of their global ranks
  (worker/ops/p2p.py), under a name per group and tag: ``<tag>.p2p.<torch tag>``. So messages of one
  direction, group and tag are matched in order, as torch matches them, and 0 -> 2 and 2 -> 0 in
  flight at once are keyed apart. A recv from any source (``recv`` with ``src`` None) takes the
  next message of its tag from whichever rank of the group sent one first (worker/ops/p2p.py).
- **all_to_all** is ringserve's alltoall over the group's ring, on bytes.

**Deadlines.** Every call of a plane runs under the plane's ``timeout_s``: the timeout given to
``init_process_group`` or ``new_group`` (``with_timeout`` makes a plane that names its ops alike
under another, for an op given its own timeout). The first of the group's ops to time out breaks
the group, on every rank of it (``breaker``, shared by those planes: see breaker.py); a call
checks it on the loop before it opens its collective.

Ops of one plane are matched across ranks by their order of issue, as torch requires of every
group: each plane names its ops ``<tag>`` so that ringserve numbers them ``<tag>#1``, ``<tag>#2``,
..., apart from other groups' and from ringserve's own unnamed collectives. A call takes its
session on the loop before its first await, so calls start there in the order they were issued.
A reduction, broadcast or gather started inside a callback of a finished op (a DDP comm hook's
``.then``) is named after that op instead (``<tag>.then.<label>``, see work.py): the threads that
run callbacks start ops in no order the ranks share.
"""

from __future__ import annotations

import concurrent.futures
import copy
import itertools
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ringserve.api import Context
from ringserve.errors import CollectiveTimeoutError, InvalidArgumentError, RingChangedError
from ringserve.torch.distributed.breaker import Breaker, op_name
from ringserve.torch.distributed.work import completing
from ringserve.worker.dataplane.descriptor import Descriptor
from ringserve.worker.dataplane.session import Session
from ringserve.worker.ops import collectives, p2p, refusal

if TYPE_CHECKING:
    from ringserve.worker.runtime import Worker

T = TypeVar("T")
# The descriptor of an all_to_all of bytes (collectives.alltoall's, for uint8 rows of nothing).
_ALLTOALL_BYTES = Descriptor("alltoall", dtype="uint8", rows=())
Future = concurrent.futures.Future
Call = Callable[[Session, dict[str, Any]], Coroutine[Any, Any, T]]


class Plane:
    """Ring collectives of one process group on a ringserve worker.

    Args:
        context: the worker (with its event-loop thread) the ops run on.
        tag: the name its ops are numbered under (None: ringserve's unnamed sequence).
        view_id: the view the group was formed in; the group's ops run only in it.
        members: the group's ranks in the view, in group-rank order (None: every rank, in order).
        timeout_s: the deadline of each of its calls (None: the worker's collective deadline).
    """

    def __init__(self, context: Context, *, tag: str | None, view_id: int,
                 members: tuple[int, ...] | None = None, timeout_s: float | None = None) -> None:
        self.context = context
        self.timeout_s = context.config.collective_timeout_s if timeout_s is None else float(timeout_s)
        self.tag = tag
        self.view_id = view_id
        self.members = members
        worker = context.worker
        self.global_rank_of_self = worker.rank
        if members is None:
            self.rank, self.size = worker.rank, worker.size
        else:
            self.rank, self.size = members.index(worker.rank), len(members)
        # Labels of the ops started outside callbacks; shared with the planes with_timeout makes,
        # whose ops are numbered in the same sequence. (next() of a count is atomic under the GIL.)
        self._issued = itertools.count(1)
        # Whether a timeout broke the group: shared with those planes too.
        self.breaker = Breaker(name=f"{tag or 'torch'}.timeout", rank=self.rank, timeout_s=self.timeout_s,
                               members=tuple(range(self.size)) if members is None else members)

    def _issue(self) -> tuple[str | None, str]:
        """The name an op starts under and its label (see the module's docstring)."""
        scope = completing()
        if scope is None:
            return self.tag, str(next(self._issued))
        label = scope.child()
        return f"{self.tag or 'torch'}.then.{label}", label

    @staticmethod
    def _labelled(future: Future[T], label: str) -> Future[T]:
        future.ringserve_label = label  # type: ignore[attr-defined]  # read by work.Completer
        return future

    def with_timeout(self, timeout_s: float) -> Plane:
        """This plane (its ring, and the same sequence of op names) with calls under ``timeout_s``."""
        if timeout_s == self.timeout_s:
            return self
        other = copy.copy(self)
        other.timeout_s = float(timeout_s)
        return other

    def global_rank(self, rank: int) -> int:
        """The view rank of group rank ``rank``.

        Raises:
            InvalidArgumentError: ``rank`` is not a rank of the group.
        """
        if not 0 <= rank < self.size:
            raise InvalidArgumentError(f"Rank {rank} is not a rank of this group of {self.size} (0 to {self.size - 1}).")
        return rank if self.members is None else self.members[rank]

    def moved_on(self) -> RingChangedError | None:
        """Why the group's ops can no longer run (its view is gone), or None while they can."""
        latest = self.context.worker.latest_view
        if latest == self.view_id:
            return None
        return RingChangedError(self.view_id, latest, "a peer died or left, and a torch group's members are fixed")

    def _on(self, call: Call[T]) -> Future[T]:
        """Starts ``call(session, options)`` on the loop, over the group's ring."""
        return self._start(call, self.members)

    def _start(self, call: Call[T], ring: tuple[int, ...] | None) -> Future[T]:
        """Starts ``call(session, options)`` on the loop, on the session over the view ranks
        ``ring`` (None: the whole view), taken there before the call's first await. It fails
        instead once a timeout broke the group; a timeout of the call breaks it, if the call is
        one of the group's torch ops (breaker.py)."""
        timeout_s, breaker, what = self.timeout_s, self.breaker, op_name()

        async def run(worker: Worker) -> T:
            # The worker's session over a member tuple (the sub-ring its process sets use too).
            session = worker.collectives.session(ring)
            chunk_bytes = worker.config.chunk_bytes
            broken = breaker.error()
            if broken is None:
                sender = breaker.pending(session.plane)
                if sender is not None:
                    await breaker.read(session.plane, sender, chunk_bytes=chunk_bytes, timeout_s=timeout_s)
                    broken = breaker.error()
            if broken is not None:
                raise broken
            try:
                return await call(session, {"chunk_bytes": chunk_bytes, "timeout_s": timeout_s})
            except CollectiveTimeoutError as exc:
                if what is not None:
                    await breaker.trip(session.plane, what, exc, chunk_bytes=chunk_bytes, timeout_s=timeout_s)
                raise

        return self.context.submit(run)

    def allreduce(self, array: np.ndarray, op: str, *, out: np.ndarray | None, compression: str | None,
                  residual: np.ndarray | None) -> Future[np.ndarray]:
        tag, label = self._issue()
        return self._labelled(self._on(lambda s, o: collectives.allreduce(
            s, array, op=op, name=tag, out=out, compression=compression, residual=residual, **o)), label)

    def broadcast(self, array: np.ndarray, root: int) -> Future[np.ndarray]:
        """Group rank ``root``'s ``array`` on every rank of the group."""
        tag, label = self._issue()
        return self._labelled(self._on(lambda s, o: collectives.broadcast(s, array, root=root, name=tag, **o)), label)

    def allgather(self, array: np.ndarray) -> Future[np.ndarray]:
        """Every rank's ``array`` concatenated along axis 0 in group-rank order (lengths may differ)."""
        tag, label = self._issue()
        return self._labelled(self._on(lambda s, o: collectives.allgather(s, array, name=tag, **o)), label)

    def allgather_blocks(self, array: np.ndarray, descriptor: Descriptor) -> Future[list[np.ndarray]]:
        """Every rank's 1-D uint8 ``array`` (lengths may differ), one per group rank, in order;
        ``descriptor`` names what the blocks hold, and ranks that disagree on it fail (MismatchError)."""
        tag, label = self._issue()
        return self._labelled(self._on(lambda s, o: collectives.allgather_blocks(
            s, array, row=1, name=tag, descriptor=descriptor, **o)), label)

    def reduce_scatter(self, array: np.ndarray, op: str) -> Future[np.ndarray]:
        """Row ``rank`` of the reduction of every rank's ``array`` (shaped (size, n))."""
        tag, label = self._issue()
        return self._labelled(self._on(lambda s, o: collectives.reduce_scatter(s, array, op=op, name=tag, **o)), label)

    def barrier(self) -> Future[None]:
        if self.tag is None:
            return self._on(lambda s, o: collectives.barrier(s, timeout_s=o["timeout_s"]))
        # A named barrier: a one-element sum in this plane's sequence.
        one = np.zeros(1, dtype=np.int32)
        tag = self.tag
        return self._on(lambda s, o: _discard(collectives.allreduce(s, one, op="sum", name=tag, **o)))

    def alltoall(self, array: np.ndarray, send_counts: Sequence[int], recv_counts: Sequence[int], *,
                 problem: str = "") -> Future[np.ndarray]:
        """The bytes every rank of the group sent this one, in group-rank order: ``array`` (1-D
        uint8) is split into ``send_counts[d]`` bytes for group rank d, and ``recv_counts[o]``
        bytes must come from group rank o. ``problem``: what is wrong with this rank's arguments;
        the op then fails on every rank of the group at once (refusal.refuse), not by a deadline.

        Raises (from the future):
            InvalidArgumentError: ``problem``, or what came differs from ``recv_counts`` (the ranks'
                split sizes disagree).
        """
        tag, expected = self.tag, [int(c) for c in recv_counts]

        async def call(session: Session, options: dict[str, Any]) -> np.ndarray:
            if problem:
                await refusal.refuse(session, tag, _ALLTOALL_BYTES, problem, options["timeout_s"])
            data, counts = await collectives.alltoall(session, array, splits=list(send_counts), name=tag, **options)
            if counts.tolist() != expected:
                raise InvalidArgumentError(
                    f"all_to_all: rank {session.place.rank} of the group expected {expected} bytes from each rank "
                    f"(its output split sizes), but the ranks sent {counts.tolist()}: the ranks' split sizes disagree."
                )
            return data

        return self._on(call)

    def _p2p_name(self, tag: int | str) -> str:
        """The name of the messages of ``tag``: torch's int tags, or a name of ours (never an int's)."""
        return f"{self.tag or 'torch'}.p2p.{tag if isinstance(tag, str) else int(tag)}"

    def send(self, array: np.ndarray, dst: int, tag: int | str) -> Future[None]:
        """Sends ``array`` to group rank ``dst``; done once it is on the link (see worker/ops/p2p.py)."""
        ring = p2p.pair(self.global_rank_of_self, self.global_rank(dst))
        name = self._p2p_name(tag)
        return self._start(lambda s, o: p2p.send(s, array, name=name, **o), ring)

    def recv(self, array: np.ndarray, src: int | None, tag: int | str) -> Future[int]:
        """Receives into ``array`` the next message of ``tag`` from group rank ``src`` (None: from
        whichever rank of the group sent one first); returns the sender's group rank."""
        name = self._p2p_name(tag)
        if src is not None:
            ring = p2p.pair(self.global_rank(src), self.global_rank_of_self)

            async def named(session: Session, options: dict[str, Any]) -> int:
                await p2p.recv(session, array, name=name, **options)
                return int(src)

            return self._start(named, ring)
        others = [self.global_rank(r) for r in range(self.size) if r != self.rank]

        async def anyone(session: Session, options: dict[str, Any]) -> int:
            sender = await p2p.recv_any(session.plane, array, name=name, sources=others, **options)
            return sender if self.members is None else self.members.index(sender)

        return self._on(anyone)

    def subset(self, ranks: Sequence[int], tag: str, timeout_s: float | None = None) -> Plane:
        """The plane of a new group of ``ranks`` (this plane's ranks, in group-rank order; torch
        sorts them unless told not to), ops numbered under ``tag``, under ``timeout_s`` (None:
        this plane's).

        Raises:
            InvalidArgumentError: ranks repeat or fall outside this plane's, or leave this rank out.
        """
        members = tuple(self.global_rank(int(r)) for r in ranks)
        if len(set(members)) != len(members) or self.global_rank_of_self not in members:
            raise InvalidArgumentError(f"A group of ranks {list(ranks)} must list distinct ranks, this one's among them.")
        whole = members == tuple(range(self.context.worker.size))
        return Plane(self.context, tag=tag, view_id=self.view_id, members=None if whole else members,
                     timeout_s=self.timeout_s if timeout_s is None else timeout_s)


async def _discard(call: Any) -> None:
    await call
