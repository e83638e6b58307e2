"""The ring a process group runs on: its ranks, and ringserve's collectives started on them.

This is the one seam between the torch process group (group.py) and ringserve's worker. Every
op of the group is one or more of these calls; each returns the concurrent future of the call on
the worker's event loop. What ringserve does not have yet is here too, each in one method that
raises a NotImplementedError naming what is coming, so that the group never starts what it
cannot finish and never hangs:

- ``send`` / ``recv``: point-to-point messages over links to any peer (the Link seam's next
  step); torch's ``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv`` call them.
- ``alltoall``: torch's ``all_to_all_single`` and ``all_to_all`` call it.
- ``subset``: a sub-ring of some ranks (process sets); torch's ``new_group`` calls it. Today only
  the set of every rank works: it is the world's ring, with its ops numbered apart.

Ops of one plane are matched across ranks by their order of issue, as torch requires of every
group: each plane names its ops ``<tag>`` so that ringserve numbers them ``<tag>#1``, ``<tag>#2``,
..., apart from other groups' and from ringserve's own unnamed collectives.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import numpy as np

from ringserve.api import Context
from ringserve.errors import RingChangedError

Future = concurrent.futures.Future


class Plane:
    """Ring collectives of one process group on a ringserve worker.

    Args:
        context: the worker (with its event-loop thread) the ops run on.
        tag: the name its ops are numbered under (None: ringserve's unnamed sequence).
        view_id: the view the group was formed in; the group's ops run only in it.
    """

    def __init__(self, context: Context, *, tag: str | None, view_id: int) -> None:
        self.context = context
        self.tag = tag
        self.view_id = view_id
        worker = context.worker
        self.rank = worker.rank
        self.size = worker.size

    def moved_on(self) -> RingChangedError | None:
        """Why the group's ops can no longer run (its view is gone), or None while they can."""
        latest = self.context.worker.latest_view
        if latest == self.view_id:
            return None
        return RingChangedError(self.view_id, latest, "a peer died or left, and a torch group's members are fixed")

    def allreduce(self, array: np.ndarray, op: str, *, out: np.ndarray | None, compression: str | None,
                  residual: np.ndarray | None) -> Future[np.ndarray]:
        tag = self.tag
        return self.context.submit(lambda w: w.allreduce(array, op=op, name=tag, out=out, compression=compression,
                                                         residual=residual))

    def broadcast(self, array: np.ndarray, root: int) -> Future[np.ndarray]:
        tag = self.tag
        return self.context.submit(lambda w: w.broadcast(array, root=root, name=tag))

    def allgather(self, array: np.ndarray) -> Future[np.ndarray]:
        """Every rank's ``array`` concatenated along axis 0 in rank order (lengths may differ)."""
        tag = self.tag
        return self.context.submit(lambda w: w.allgather(array, name=tag))

    def reduce_scatter(self, array: np.ndarray, op: str) -> Future[np.ndarray]:
        """Row ``rank`` of the reduction of every rank's ``array`` (shaped (size, n))."""
        tag = self.tag
        return self.context.submit(lambda w: w.reduce_scatter(array, op=op, name=tag))

    def barrier(self) -> Future[None]:
        if self.tag is None:
            return self.context.submit(lambda w: w.barrier())
        # A named barrier: a one-element sum in this plane's sequence.
        one = np.zeros(1, dtype=np.int32)
        tag = self.tag
        return self.context.submit(lambda w: _discard(w.allreduce(one, op="sum", name=tag)))

    # -- what is coming: each raises before anything is started --------------------------------

    def send(self, array: np.ndarray, dst: int, tag: int) -> Future[None]:
        raise NotImplementedError(
            f"send/isend (to rank {dst}) is not supported by the ringserve backend yet: point-to-point "
            "links to any peer are coming with ringserve's Link seam. Use broadcast or scatter to move "
            "a tensor from one rank, or all_gather, meanwhile."
        )

    def recv(self, array: np.ndarray, src: int | None, tag: int) -> Future[int]:
        raise NotImplementedError(
            f"recv/irecv (from {'any rank' if src is None else f'rank {src}'}) is not supported by the "
            "ringserve backend yet: point-to-point links to any peer are coming with ringserve's Link "
            "seam. Use broadcast or scatter to move a tensor from one rank, or all_gather, meanwhile."
        )

    def alltoall(self, array: np.ndarray, send_counts: Sequence[int], recv_counts: Sequence[int]) -> Future[np.ndarray]:
        raise NotImplementedError(
            "all_to_all_single/all_to_all is not supported by the ringserve backend yet: alltoall is "
            "coming with ringserve's Link seam. Use all_gather and keep each rank's slice, meanwhile."
        )

    def subset(self, ranks: Sequence[int], tag: str) -> Plane:
        """The plane of a new group of ``ranks`` (global ranks, sorted), ops numbered under ``tag``.

        Raises:
            NotImplementedError: ``ranks`` is not every rank (sub-rings come with process sets).
        """
        if sorted(ranks) != list(range(self.size)):
            raise NotImplementedError(
                f"new_group(ranks={list(ranks)}) of {len(ranks)} of the {self.size} ranks is not supported by "
                "the ringserve backend yet: sub-rings come with ringserve's process sets. A group of every "
                "rank works; for others, use a second backend for the subgroup (new_group(ranks, backend='gloo'))."
            )
        return Plane(self.context, tag=tag, view_id=self.view_id)


async def _discard(call: Any) -> None:
    await call
