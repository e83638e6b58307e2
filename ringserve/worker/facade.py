"""The Worker's public face: where it stands, and its collectives.

- Where it stands (rank, size, view, ...) is read from the ``Standing`` its loop publishes
  (standing.py), so any thread may ask.
- Each collective takes the session it runs on from ``_session`` (the whole current view, or a
  sub-ring of it) on the loop, at the moment it starts: the view and the ring are fixed before the
  first frame, and the arguments are checked (collectives.py) before anything is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ringserve.config import WorkerConfig
from ringserve.errors import InvalidArgumentError
from ringserve.worker import adasum, collectives, grouped
from ringserve.worker import join as joining
from ringserve.worker.session import Session
from ringserve.worker.standing import Standing


class Facade:
    """The public face of a Worker (its base class: the Worker provides ``_session`` and
    publishes ``_standing``)."""

    config: WorkerConfig
    address: str
    _standing: Standing
    _metrics: Any

    def _labels(self) -> tuple[int, int]:
        standing = self._standing
        return (standing.place.rank, standing.place.view_id) if standing.place is not None else (-1, standing.latest_view)

    @property
    def metrics_url(self) -> str | None:
        """Where Prometheus scrapes this worker, when metrics_port is set."""
        return self._metrics.url if self._metrics is not None else None

    @property
    def rank(self) -> int:
        return self._standing.known().rank

    @property
    def size(self) -> int:
        return self._standing.known().size

    @property
    def local_rank(self) -> int:
        return self._standing.known().local_rank

    @property
    def local_size(self) -> int:
        return self._standing.known().local_size

    @property
    def cross_rank(self) -> int:
        return self._standing.known().cross_rank

    @property
    def cross_size(self) -> int:
        return self._standing.known().cross_size

    @property
    def view_id(self) -> int:
        return self._standing.current().view_id

    @property
    def latest_view(self) -> int:
        """The newest view this worker has heard of (it may not be a member)."""
        return self._standing.latest_view

    @property
    def pending_workers(self) -> int:
        """Workers waiting to join, as the last heartbeat answer about the current view said."""
        return self._standing.pending_workers

    @property
    def tag(self) -> str:
        """"rank R view V" (or "worker ADDRESS view V" outside any view), for log lines."""
        return self._standing.tag(self.address)

    @property
    def running_view(self) -> int:
        """The view collectives run in: the pinned one, else the current one (0 if none)."""
        return self._standing.running_view

    # -- collectives -----------------------------------------------------------------------

    def _session(self, members: Sequence[int] | None = None) -> Session:
        raise NotImplementedError

    def _opts(self) -> dict[str, Any]:
        return {"chunk_bytes": self.config.chunk_bytes, "timeout_s": self.config.collective_timeout_s}

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
    ) -> np.ndarray:
        """Reduces ``a`` across ranks; returns a new array of a's shape and dtype on every rank.

        With ``out`` (an array of a's shape and dtype, or ``a`` itself) the result is written
        there instead, and no result buffer is allocated. ``compression`` ("fp16", "bf16" or
        "int8") packs floating point chunks on the wire and adds in float32 (see
        ringserve.codecs for each codec's error bound). ``residual``, a float32 array of a's size
        (float64 for float64), turns on error feedback: it is added to ``a`` and then replaced by
        what this rank's encodings lost; keep it from call to call. ``check_finite`` raises
        NonFiniteError on every rank when the result holds NaN or Inf.

        ``op="adasum"``: Adasum (see worker/adasum.py) of floating point arrays, on a world whose
        size is a power of two, without compression or residual; ``parts`` (element counts that
        tile ``a``) gives each tensor fused in ``a`` its own coefficients, as Horovod does.
        """
        if op == "adasum":
            if compression is not None or residual is not None:
                raise InvalidArgumentError("op adasum takes no compression and no residual.")
            result = await adasum.allreduce(self._session(), a, name=name, out=out,
                                            parts=None if parts is None else list(parts), **self._opts())
            if check_finite and not np.isfinite(result).all():
                raise collectives._non_finite_error(name or "adasum")
            return result
        if parts is not None:
            raise InvalidArgumentError("parts is for op adasum only.")
        return await collectives.allreduce(self._session(), a, op=op, name=name, out=out, compression=compression,
                                           residual=residual, check_finite=check_finite, **self._opts())

    async def _allreduce_among(self, members: Sequence[int], a: Any, op: str = "average", name: str | None = None,
                               out: np.ndarray | None = None) -> np.ndarray:
        """Internal, not API yet: an allreduce over the ranks ``members`` of the current view only,
        as a ring in that order, concurrently with the view's other collectives (process sets
        build on it). Every member must call it with the same members in the same order; an
        average divides by their number. Its key is counted apart from the whole view's (see
        keys.py), so its calls never meet another ring's.

        Raises:
            InvalidArgumentError: members repeat, fall outside the view, or leave this rank out.
        """
        return await collectives.allreduce(self._session(members), a, op=op, name=name, out=out, **self._opts())

    async def broadcast(self, a: Any, root: int = 0, name: str | None = None) -> np.ndarray:
        """Returns root's ``a`` on every rank; every rank passes an array of the same shape and dtype."""
        return await collectives.broadcast(self._session(), a, root=root, name=name, **self._opts())

    async def allgather(self, a: Any, name: str | None = None) -> np.ndarray:
        """Concatenates every rank's ``a`` along axis 0, in rank order (first dimensions may differ)."""
        return await collectives.allgather(self._session(), a, name=name, **self._opts())

    async def reduce_scatter(
        self, a: Any, op: str = "average", name: str | None = None, *, compression: str | None = None
    ) -> np.ndarray:
        """Reduces ``a`` and returns this rank's part along axis 0 (the first ranks get a row more)."""
        return await collectives.reduce_scatter(self._session(), a, op=op, name=name, compression=compression,
                                                **self._opts())

    async def alltoall(self, a: Any, splits: Any = None, name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Sends ``splits[d]`` rows of ``a`` to rank d (an even split of axis 0 without splits);
        returns the rows every rank sent this one, in rank order, and how many came from each."""
        return await collectives.alltoall(self._session(), a, splits=splits, name=name, **self._opts())

    async def grouped_allgather(self, arrays: Sequence[Any], name: str | None = None) -> list[np.ndarray]:
        """allgather of each array of a list, in one collective."""
        return await grouped.grouped_allgather(self._session(), list(arrays), name=name, **self._opts())

    async def grouped_reduce_scatter(self, arrays: Sequence[Any], op: str = "average", name: str | None = None, *,
                                     compression: str | None | list[str | None] = None) -> list[np.ndarray]:
        """reduce_scatter of each array of a list, in one collective per dtype (and codec: one for
        every floating point array, or one per array)."""
        return await grouped.grouped_reduce_scatter(self._session(), list(arrays), op=op, name=name,
                                                    compression=compression, **self._opts())

    async def join(self) -> int:
        """Horovod's join for uneven data: until every rank has joined, this rank takes part in the
        others' allreduces with zeros (and refuses their other collectives, as Horovod does; see
        join.py); returns the rank that joined last, the same on every rank. A join is over the
        whole view: collectives over sub-rings are not stood in for."""
        return await joining.join(self._session(), chunk_bytes=self.config.chunk_bytes,
                                  timeout_s=self.config.collective_timeout_s, join_timeout_s=self.config.join_timeout_s)

    async def barrier(self) -> None:
        """Returns once every rank has called barrier."""
        await collectives.barrier(self._session(), timeout_s=self.config.collective_timeout_s)

    async def broadcast_object(self, obj: object = None, root: int = 0, name: str | None = None) -> object:
        """Returns root's picklable ``obj`` on every rank. Objects travel only between the view's peers."""
        return await collectives.broadcast_object(self._session(), obj, root=root, name=name, **self._opts())

    async def allgather_object(self, obj: object, name: str | None = None) -> list[object]:
        """Returns every rank's picklable ``obj`` in rank order."""
        return await collectives.allgather_object(self._session(), obj, name=name, **self._opts())
