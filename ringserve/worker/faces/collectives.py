"""The worker's collectives, as one face: ``worker.collectives.allreduce(...)`` and the rest.

- Each collective takes the session it runs on (the whole current view, or the sub-ring of a
  process set, see ops/process_sets.py) from the node's current plane (``Node.plane``: checked
  against the pin and the worker's failure), on the loop, at the moment it starts: the view and
  the ring are fixed before the first frame, and the arguments are checked (ops/collectives.py)
  before anything is sent.
- Process sets are registered and removed here, collectively over the whole view (every rank's
  request is gathered, then every rank decides alike: ops/set_policy.py). The registry of the
  view's sets is this face's own.

``Worker``'s collective methods (``worker.allreduce``, ...) are delegates to this face.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from ringserve.config import WorkerConfig
from ringserve.errors import InvalidArgumentError
from ringserve.worker.dataplane.plane import Plane
from ringserve.worker.dataplane.session import Session
from ringserve.worker.ops import adasum, collectives, grouped, p2p
from ringserve.worker.ops import join as joining
from ringserve.worker.ops import process_sets as sets
from ringserve.worker.ops.arguments import non_finite_error
from ringserve.worker.ops.process_sets import ProcessSet, Registry, WholeWorld
from ringserve.worker.ops.set_policy import root_position

__all__ = ["Collectives", "PlaneSource"]


class PlaneSource(Protocol):
    """What the collectives need of the worker's node (node.Node; the simulator's stand-in)."""

    @property
    def config(self) -> WorkerConfig: ...

    @property
    def pinned(self) -> int | None: ...

    def plane(self) -> Plane: ...


class Collectives:
    """The collectives of one worker, over its node's current plane.

    Example:
        ```python
        total = await worker.collectives.allreduce(np.ones(4), op="sum")
        ```

    Args:
        node: the worker's node, which owns the planes (any ``PlaneSource``).
    """

    def __init__(self, node: PlaneSource) -> None:
        self._node = node
        self.sets = Registry()  # this view's process sets (ops/process_sets.py)
        self._registering = asyncio.Lock()  # one registration at a time, in call order

    def plane(self) -> Plane:
        """The plane collectives run on now (see ``Node.plane``), its process sets entered."""
        plane = self._node.plane()
        self.sets.enter(plane.view_id, plane.place.rank, plane.place.size)
        return plane

    def session(self, members: Sequence[int] | None = None) -> Session:
        """The session collectives run on now: the whole current view, or a sub-ring of it."""
        return self.plane().session(None if members is None else tuple(members))

    def set_session(self, process_set: ProcessSet | None) -> Session:
        """The session a collective on ``process_set`` (None: the global set) runs on now.

        Raises:
            InvalidArgumentError: not a ProcessSet; a set not registered here, or without this rank.
            RingChangedError: the set was registered in an earlier view (see process_sets.py).
        """
        plane = self.plane()
        if process_set is None or isinstance(process_set, WholeWorld):
            return plane.session(None)
        if not isinstance(process_set, ProcessSet):
            raise InvalidArgumentError(f"process_set must be a ProcessSet (or None), not {process_set!r}.")
        return plane.session(self.sets.lookup(process_set, synced_here=self._node.pinned == plane.view_id))

    def _rooted(self, process_set: ProcessSet | None, root: int) -> tuple[Session, int]:
        """The session of a rooted collective, and its root's position in it (roots are global
        ranks, as in Horovod)."""
        session = self.set_session(process_set)
        if session.spec == "":
            return session, root
        assert process_set is not None
        return session, root_position(session.ring.members, root, process_set.process_set_id)

    def _opts(self) -> dict[str, Any]:
        config = self._node.config
        return {"chunk_bytes": config.chunk_bytes, "timeout_s": config.collective_timeout_s}

    async def allreduce(
        self,
        a: Any,
        op: str = "average",
        name: str | None = None,
        out: np.ndarray | None = None,
        *,
        compression: str | None = None,
        residual: np.ndarray | None = None,
        check_finite: bool = False,
        parts: Sequence[int] | None = None,
        process_set: ProcessSet | None = None,
    ) -> np.ndarray:
        """Reduces ``a`` across ranks; returns a new array of a's shape and dtype on every rank.

        With ``out`` (an array of a's shape and dtype, or ``a`` itself) the result is written
        there instead, and no result buffer is allocated. ``compression`` ("fp16", "bf16" or
        "int8") packs floating point chunks on the wire and adds in float32 (see
        ringserve.codecs for each codec's error bound). ``residual``, a float32 array of a's size
        (float64 for float64), turns on error feedback: it is added to ``a`` and then replaced by
        what this rank's encodings lost; keep it from call to call. ``check_finite`` raises
        NonFiniteError on every rank when the result holds NaN or Inf.

        ``op="adasum"``: Adasum (see worker/ops/adasum.py) of floating point arrays, on a world whose
        size is a power of two, without compression or residual; ``parts`` (element counts that
        tile ``a``) gives each tensor fused in ``a`` its own coefficients, as Horovod does.

        ``process_set`` (every collective takes one): run over the ranks of that registered set
        only, as a ring of its own (an average divides by its size); None is the global set. Only
        its members call it.
        """
        session = self.set_session(process_set)
        if op == "adasum":
            if compression is not None or residual is not None:
                raise InvalidArgumentError("op adasum takes no compression and no residual.")
            result = await adasum.allreduce(session, a, name=name, out=out,
                                            parts=None if parts is None else list(parts), **self._opts())
            if check_finite and not np.isfinite(result).all():
                raise non_finite_error(name or "adasum")
            return result
        if parts is not None:
            raise InvalidArgumentError("parts is for op adasum only.")
        return await collectives.allreduce(session, a, op=op, name=name, out=out, compression=compression,
                                           residual=residual, check_finite=check_finite, **self._opts())

    async def allreduce_among(self, members: Sequence[int], a: Any, op: str = "average", name: str | None = None,
                               out: np.ndarray | None = None) -> np.ndarray:
        """An allreduce over the ranks ``members`` of the current view only, as a ring in
        that order, concurrently with the view's other collectives (process sets run on the same
        sessions, in sorted order). Every member must call it with the same members in the same order; an
        average divides by their number. Its key is counted apart from the whole view's (see
        keys.py), so its calls never meet another ring's.

        Raises:
            InvalidArgumentError: members repeat, fall outside the view, or leave this rank out.
        """
        return await collectives.allreduce(self.session(members), a, op=op, name=name, out=out, **self._opts())

    async def broadcast(self, a: Any, root: int = 0, name: str | None = None, *,
                        process_set: ProcessSet | None = None) -> np.ndarray:
        """Returns root's ``a`` on every rank; every rank passes an array of the same shape and dtype.
        ``root`` is a global rank, a member of ``process_set`` when one is given (as in Horovod)."""
        session, position = self._rooted(process_set, root)
        return await collectives.broadcast(session, a, root=position, name=name, **self._opts())

    async def allgather(self, a: Any, name: str | None = None, *, process_set: ProcessSet | None = None) -> np.ndarray:
        """Concatenates every rank's ``a`` along axis 0, in rank order (first dimensions may differ);
        over a process set, its members' in the set's (sorted) rank order."""
        return await collectives.allgather(self.set_session(process_set), a, name=name, **self._opts())

    async def reduce_scatter(
        self, a: Any, op: str = "average", name: str | None = None, *, compression: str | None = None,
        process_set: ProcessSet | None = None,
    ) -> np.ndarray:
        """Reduces ``a`` and returns this rank's part along axis 0 (the first ranks get a row more);
        over a process set, parts go by the rank within the set (``ProcessSet.rank()``)."""
        return await collectives.reduce_scatter(self.set_session(process_set), a, op=op, name=name,
                                                compression=compression, **self._opts())

    async def alltoall(self, a: Any, splits: Any = None, name: str | None = None, *,
                       process_set: ProcessSet | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Sends ``splits[d]`` rows of ``a`` to rank d (an even split of axis 0 without splits);
        returns the rows every rank sent this one, in rank order, and how many came from each.
        Over a process set, d counts the set's members (its rank within the set)."""
        return await collectives.alltoall(self.set_session(process_set), a, splits=splits, name=name,
                                          **self._opts())

    async def grouped_allgather(self, arrays: Sequence[Any], name: str | None = None, *,
                                process_set: ProcessSet | None = None) -> list[np.ndarray]:
        """allgather of each array of a list, in one collective."""
        return await grouped.grouped_allgather(self.set_session(process_set), list(arrays), name=name,
                                               **self._opts())

    async def grouped_reduce_scatter(self, arrays: Sequence[Any], op: str = "average", name: str | None = None, *,
                                     compression: str | list[str | None] | None = None,
                                     process_set: ProcessSet | None = None) -> list[np.ndarray]:
        """reduce_scatter of each array of a list, in one collective per dtype (and codec: one for
        every floating point array, or one per array)."""
        return await grouped.grouped_reduce_scatter(self.set_session(process_set), list(arrays), op=op, name=name,
                                                    compression=compression, **self._opts())

    async def join(self) -> int:
        """Horovod's join for uneven data: until every rank has joined, this rank takes part in the
        others' allreduces with zeros (and refuses their other collectives, as Horovod does; see
        join.py); returns the rank that joined last, the same on every rank. A join is over the
        whole view: collectives over sub-rings are not stood in for."""
        return await joining.join(self.session(), chunk_bytes=self._node.config.chunk_bytes,
                                  timeout_s=self._node.config.collective_timeout_s, join_timeout_s=self._node.config.join_timeout_s)

    async def barrier(self, *, process_set: ProcessSet | None = None) -> None:
        """Returns once every rank (of ``process_set``, if given) has called barrier."""
        await collectives.barrier(self.set_session(process_set), timeout_s=self._node.config.collective_timeout_s)

    async def broadcast_object(self, obj: object = None, root: int = 0, name: str | None = None, *,
                               process_set: ProcessSet | None = None) -> object:
        """Returns root's picklable ``obj`` on every rank. Objects travel only between the view's peers."""
        session, position = self._rooted(process_set, root)
        return await collectives.broadcast_object(session, obj, root=position, name=name, **self._opts())

    async def send(self, a: np.ndarray, dest: int, name: str) -> None:
        """Sends ``a`` (contiguous) to rank ``dest`` of this view: done once it is on the link (see
        worker/ops/p2p.py); the ``n``-th send called ``name`` to ``dest`` meets its ``n``-th recv
        of that name from this rank."""
        plane = self.plane()
        session = plane.session(p2p.pair(plane.place.rank, dest))
        await p2p.send(session, np.ascontiguousarray(a), name=name, **self._opts())

    async def recv(self, out: np.ndarray, source: int, name: str) -> np.ndarray:
        """Receives into ``out`` the next message called ``name`` from rank ``source`` of this view;
        its dtype and size must be the sent array's (MismatchError names both otherwise)."""
        plane = self.plane()
        session = plane.session(p2p.pair(source, plane.place.rank))
        return await p2p.recv(session, out, name=name, **self._opts())

    async def allgather_object(self, obj: object, name: str | None = None, *,
                               process_set: ProcessSet | None = None) -> list[object]:
        """Returns every rank's picklable ``obj`` in rank order (the set's members' over a set)."""
        return await collectives.allgather_object(self.set_session(process_set), obj, name=name, **self._opts())

    # -- process sets ----------------------------------------------------------------------

    async def add_process_set(self, process_set: ProcessSet | Iterable[int]) -> ProcessSet:
        """Registers a process set of some of the view's ranks: a collective over the whole view,
        which every rank calls with the same ranks, in the same order as its other registrations.
        Returns the set (``process_set`` itself when it is a ProcessSet), with the same id on every
        rank: the smallest free one. It lives as long as the view (see process_sets.py).

        Raises:
            InvalidArgumentError: on every rank at once, when the ranks asked for different sets,
                or the set has a rank twice, a rank outside the view, no rank, every rank (the
                global set), or the ranks of a set registered already.
        """
        async with self._registering:
            plane = self.plane()
            return await sets.register(plane.session(None), self.sets, process_set, **self._opts())

    async def add_process_sets(self, process_sets: Iterable[ProcessSet | Iterable[int]]) -> list[ProcessSet]:
        """Registers a list of process sets at once, all or none, as Horovod's
        ``init(process_sets=[...])`` does: a set whose ranks are registered already takes that
        set's id (so naming the same sets again is no error); returns them bound, in order.

        Raises:
            InvalidArgumentError: on every rank at once, when a set is wrong (as add_process_set
                says), two sets of the list have the same ranks, or the ranks' lists differ.
        """
        async with self._registering:
            plane = self.plane()
            return await sets.register_init(plane.session(None), self.sets, list(process_sets),
                                            **self._opts())

    async def remove_process_set(self, process_set: ProcessSet) -> None:
        """Removes a registered process set on every rank (a collective over the whole view, called
        alike everywhere); its id is free again and ``process_set.process_set_id`` becomes None.

        Raises:
            InvalidArgumentError: on every rank at once, for the global set, a set not registered
                in this view, or when the ranks asked to remove different sets.
        """
        async with self._registering:
            plane = self.plane()
            await sets.unregister(plane.session(None), self.sets, process_set, **self._opts())

    def process_sets(self) -> dict[int, list[int]]:
        """The process sets registered in the current view, id -> ranks, the global set (0) included."""
        plane = self.plane()
        registered = {0: list(range(plane.place.size))}
        registered.update((sid, list(ranks)) for sid, ranks in sorted(self.sets.sets.items()))
        return registered
