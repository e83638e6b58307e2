"""The Worker: a ringserve worker, made of a node and its public faces.

- ``worker.node`` (node.py) owns the lifecycle and the parts: the peer server, the control client,
  the planes, the lifeline and the tasks. It decides how the worker stands and publishes it;
- ``worker.collectives`` (faces/collectives.py): allreduce, broadcast, ..., process sets;
- ``worker.elastic`` (faces/elastic.py): what elastic training asks of a worker (commits, leaving,
  admissions, the wait for a newer view).

The Worker itself starts and closes the node, answers where it stands (rank, size, view, ...)
from the ``Standing`` the node publishes (any thread may ask), and routes the calls of other
threads to the node's loop. Its collective and elastic methods are delegates to the faces, kept
because ringserve.api, ringserve.torch, ringserve.elastic and users' code call them by those names.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Coroutine
from dataclasses import replace
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from ringserve.commits import Commit
from ringserve.config import WorkerConfig
from ringserve.errors import RingChangedError
from ringserve.loop import uncancelled
from ringserve.observe import Counters, Timeline
from ringserve.worker.control.standing import Standing, on_loop
from ringserve.worker.dataplane.peers import PEER_SERVICE
from ringserve.worker.faces.collectives import Collectives
from ringserve.worker.faces.elastic import Elastic
from ringserve.worker.node import Node
from ringserve.worker.ops.process_sets import WholeWorld

__all__ = ["PEER_SERVICE", "Standing", "Worker"]

P = ParamSpec("P")
R = TypeVar("R")


def delegate(face: str, method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Worker, P], R]:
    """A Worker method that calls ``method`` on the face ``worker.<face>``, with its signature and
    its docstring, marked as a delegate: the old name of a call that lives on the face now. A
    coroutine's cancellation that its caller did not ask for becomes RingChangedError there, as
    at the synchronous API's boundary (loop.uncancelled). A worker still preparing to join a
    running world (admit_when_ready) is ready at its first collective: it waits to be admitted
    first (Node.ready_to_join)."""

    @functools.wraps(method)
    def forward(self: Worker, /, *args: P.args, **kwargs: P.kwargs) -> R:
        result = method(getattr(self, face), *args, **kwargs)
        if inspect.iscoroutine(result):
            call: Coroutine[Any, Any, Any] = result
            if face == "collectives" and self.node.preparing:
                call = _admitted_first(self.node, call)
            return cast(R, uncancelled(call, functools.partial(_stray, self, self.latest_view)))
        return result

    forward.__doc__ = f"Delegates to ``worker.{face}.{method.__name__}``:\n\n{method.__doc__ or ''}"
    return forward


async def _admitted_first(node: Node, call: Coroutine[Any, Any, R]) -> R:
    """``call``, once the node is in a view (see Node.ready_to_join)."""
    try:
        await node.ready_to_join()
    except BaseException:
        call.close()  # never awaited: closed, so that no "never awaited" warning is left
        raise
    return await call


def _stray(worker: Worker, view: int) -> RingChangedError:
    """The error of a call cancelled inside ringserve, not by its caller (see loop.uncancelled)."""
    return RingChangedError(view, worker.latest_view, "the call was cancelled inside ringserve, not by its caller; "
                            "the world is taken to have changed")


class Worker:
    """A ringserve worker in the running event loop.

    Example:
        ```python
        async with Worker(coordinator="127.0.0.1:50051") as w:
            total = await w.collectives.allreduce(np.ones(4), op="sum")   # or w.allreduce(...)
        ```

    Args:
        coordinator: the coordinator's address (else ``config.coordinator``).
        config: the worker's settings (WorkerConfig() by default; see WorkerConfig.from_env()).
    """

    def __init__(self, coordinator: str | None = None, *, config: WorkerConfig | None = None) -> None:
        config = config or WorkerConfig()
        if coordinator and config.coordinator != coordinator:
            config = replace(config, coordinator=coordinator)
        self.config = config
        self.node = Node(config)
        self.collectives = Collectives(self.node)
        self.elastic = Elastic(self.node)
        self.global_process_set = WholeWorld(lambda: (self.rank, self.size))

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> Worker:
        """Starts the peer server, joins the coordinator and waits for a view that includes us.

        Raises:
            CoordinatorUnreachableError: the coordinator did not answer within connect_timeout_s.
            RendezvousTimeoutError: no view formed within rendezvous_timeout_s.
            ViewInstallError: the first view could not be installed (the cause is chained).
        """
        await self.node.start()
        return self

    async def close(self) -> None:
        """Leaves the world and releases every task, stream, channel, shared ring and the server
        (after letting collectives in flight finish, for up to drain_timeout_s; see Node.close)."""
        await self.node.close()

    async def __aenter__(self) -> Worker:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    async def set_timeline(self, timeline: Timeline | None) -> Timeline | None:
        """Makes the collectives started from now on write to ``timeline`` (None: to none), in this
        view and the next; returns the timeline it replaced, for the caller to close. A coroutine,
        so that the swap happens on the loop, between collectives. (ringserve.torch's start_timeline.)
        """
        return self.node.set_timeline(timeline)

    def pin_view(self, view_id: int | None) -> None:
        """Makes collectives fail with RingChangedError once the current view is not ``view_id``.

        Elastic training pins the view its state was synced in: a rank that hears of a new view
        before its next collective must not start that collective in the new world while the
        others are restoring and syncing there (their collectives would never meet). None unpins.
        Callable from any thread; the pin holds once this returns.
        """
        on_loop(self.node.loop, self.node.pin, view_id, wait_s=self.config.rpc_timeout_s)

    # -- the parameter store ---------------------------------------------------------------

    async def put_params(self, key: str, data: bytes) -> int:
        """Stores a blob on the coordinator (initial parameters for joiners); returns its version."""
        assert self.node.control is not None
        return await self.node.control.put_params(key, data)

    async def get_params(self, key: str) -> bytes:
        """The blob stored under ``key`` on the coordinator."""
        assert self.node.control is not None
        return await self.node.control.get_params(key)

    # -- who and where it is (any thread: from the published standing, see standing.py) -----

    @property
    def counters(self) -> Counters:
        return self.node.counters

    @property
    def worker_id(self) -> str:
        return self.node.worker_id

    @property
    def address(self) -> str:
        return self.node.address

    @property
    def metrics_url(self) -> str | None:
        """Where Prometheus scrapes this worker, when metrics_port is set."""
        return self.node.metrics.url if self.node.metrics is not None else None

    @property
    def rank(self) -> int:
        return self.node.standing.known().rank

    @property
    def size(self) -> int:
        return self.node.standing.known().size

    @property
    def local_rank(self) -> int:
        return self.node.standing.known().local_rank

    @property
    def local_size(self) -> int:
        return self.node.standing.known().local_size

    @property
    def cross_rank(self) -> int:
        return self.node.standing.known().cross_rank

    @property
    def cross_size(self) -> int:
        return self.node.standing.known().cross_size

    @property
    def view_id(self) -> int:
        return self.node.standing.current().view_id

    @property
    def latest_view(self) -> int:
        """The newest view this worker has heard of (it may not be a member)."""
        return self.node.standing.latest_view

    @property
    def pending_workers(self) -> int:
        """Workers waiting to join, as the last heartbeat answer about the current view said."""
        return self.node.standing.pending_workers

    @property
    def tag(self) -> str:
        """"rank R view V" (or "worker ADDRESS view V" outside any view), for log lines."""
        return self.node.tag

    @property
    def running_view(self) -> int:
        """The view collectives run in: the pinned one, else the current one (0 if none)."""
        return self.node.standing.running_view

    # -- delegates to worker.collectives (faces/collectives.py) -----------------------------

    allreduce = delegate("collectives", Collectives.allreduce)
    broadcast = delegate("collectives", Collectives.broadcast)
    allgather = delegate("collectives", Collectives.allgather)
    reduce_scatter = delegate("collectives", Collectives.reduce_scatter)
    alltoall = delegate("collectives", Collectives.alltoall)
    grouped_allgather = delegate("collectives", Collectives.grouped_allgather)
    grouped_reduce_scatter = delegate("collectives", Collectives.grouped_reduce_scatter)
    join = delegate("collectives", Collectives.join)
    barrier = delegate("collectives", Collectives.barrier)
    broadcast_object = delegate("collectives", Collectives.broadcast_object)
    allgather_object = delegate("collectives", Collectives.allgather_object)
    send = delegate("collectives", Collectives.send)
    recv = delegate("collectives", Collectives.recv)
    add_process_set = delegate("collectives", Collectives.add_process_set)
    add_process_sets = delegate("collectives", Collectives.add_process_sets)
    remove_process_set = delegate("collectives", Collectives.remove_process_set)
    process_sets = delegate("collectives", Collectives.process_sets)

    # -- delegates to worker.elastic (faces/elastic.py) -------------------------------------

    @property
    def committed(self) -> Commit | None:
        """Delegates to ``worker.elastic.committed``."""
        return self.elastic.committed

    @property
    def leaving(self) -> bool:
        """Delegates to ``worker.elastic.leaving``."""
        return self.elastic.leaving

    @leaving.setter
    def leaving(self, leaving: bool) -> None:
        self.elastic.leaving = leaving

    @property
    def heartbeat_interval_s(self) -> float:
        """Delegates to ``worker.elastic.heartbeat_interval_s``."""
        return self.elastic.heartbeat_interval_s

    report_committed = delegate("elastic", Elastic.report_committed)
    wait_for_view = delegate("elastic", Elastic.wait_for_view)
    commit_mark = delegate("elastic", Elastic.commit_mark)
    wait_reported = delegate("elastic", Elastic.wait_reported)
    admit_waiting = delegate("elastic", Elastic.admit_waiting)
    ready_to_join = delegate("elastic", Elastic.ready_to_join)
    sight = delegate("elastic", Elastic.sight)
