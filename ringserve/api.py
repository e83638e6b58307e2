"""The synchronous numpy API: one Worker on a background event-loop thread.

There is one module-level default context, created by ``init()`` and dropped by ``shutdown()``:
the documented exception to "no module-level mutable state", which the Horovod-style functions
need. Code that wants several workers in a process uses ``Context`` or ``Worker`` directly.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from ringserve import powersgd
from ringserve.config import WorkerConfig
from ringserve.constants import THREAD_WAIT_SLACK_S
from ringserve.errors import CollectiveTimeoutError, InvalidArgumentError, NotInitializedError, RingChangedError
from ringserve.loop import LoopThread, uncancelled
from ringserve.worker.ops.process_sets import ProcessSet, WholeWorld
from ringserve.worker.runtime import Worker

T = TypeVar("T")



class Context:
    """A Worker on its own loop thread, driven from synchronous code."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._thread = LoopThread(use_uvloop=config.use_uvloop)
        self.worker = Worker(config=config)

    def start(self) -> Context:
        try:
            self._thread.run(self.worker.start(), self.config.rendezvous_timeout_s + self.config.connect_timeout_s + THREAD_WAIT_SLACK_S)
        except BaseException:
            self._thread.stop()
            raise
        return self

    def submit(self, call: Callable[[Worker], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """Starts a call on the loop and returns its future (for async handles).

        The future raises a cancellation only when it was cancelled: one that ringserve's own
        machinery caused raises RingChangedError instead (see ``loop.uncancelled``).
        """
        worker = self.worker
        view = worker.latest_view

        def stray() -> RingChangedError:
            return RingChangedError(view, worker.latest_view, "the call was cancelled inside ringserve, not by its "
                                    "caller; the world is taken to have changed")

        return self._thread.submit(uncancelled(call(worker), stray))

    def wait(self, future: concurrent.futures.Future[T], timeout_s: float | None = None) -> T:
        """The result of a submitted call, waiting at most a collective's deadline plus a slack.

        Raises:
            CollectiveTimeoutError: the call did not finish in time; it is cancelled.
        """
        wait = self.config.collective_timeout_s + THREAD_WAIT_SLACK_S if timeout_s is None else timeout_s
        try:
            return future.result(wait)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise CollectiveTimeoutError(f"A call on the ringserve worker did not finish within {wait:g} s.") from None

    def call(self, call: Callable[[Worker], Coroutine[Any, Any, T]], timeout_s: float | None = None) -> T:
        """Runs a worker call and waits for it: by default a collective's deadline plus a slack.

        Raises:
            CollectiveTimeoutError: the call did not finish in time; it is cancelled.
        """
        return self.wait(self.submit(call), timeout_s)

    def close(self) -> None:
        cfg = self.config
        try:
            self._thread.run(self.worker.close(), cfg.drain_timeout_s + cfg.rpc_timeout_s + THREAD_WAIT_SLACK_S)
        finally:
            self._thread.stop()


_default: Context | None = None


def init(coordinator: str | None = None, **overrides: Any) -> None:
    """Joins the world and blocks until the first view that includes this process forms; or, for
    a process that comes to a running world, until it is known there: it is admitted once it is
    ready, at its first collective or at ``elastic.run`` (WorkerConfig.admit_when_ready), and
    meanwhile ``rank()`` and ``size()`` say where it would stand if admitted now.

    Args:
        coordinator: host:port; defaults to RINGSERVE_COORDINATOR.
        **overrides: any WorkerConfig field, over the RINGSERVE_* environment.

    Raises:
        CoordinatorUnreachableError: the coordinator did not answer within connect_timeout_s.
        RendezvousTimeoutError: no view that includes this process formed within rendezvous_timeout_s.
    """
    global _default
    if _default is not None:
        return
    if "RINGSERVE_ADMIT_WHEN_READY" not in os.environ:
        # A script's joiner is admitted once ready (see WorkerConfig.admit_when_ready).
        overrides = {"admit_when_ready": True, **overrides}
    config = WorkerConfig.from_env(coordinator=coordinator, **overrides)
    _default = Context(config).start()
    # A script that ends without shutdown() (an uncaught error) still leaves cleanly: gRPC's
    # threads must not be torn down under a running loop at interpreter exit.
    atexit.register(shutdown)


def shutdown() -> None:
    """Leaves the world and stops the background thread; init() may be called again afterwards."""
    global _default
    ctx, _default = _default, None
    if ctx is not None:
        atexit.unregister(shutdown)
        ctx.close()


def is_initialized() -> bool:
    """Whether init() has run in this process (and shutdown() has not since)."""
    return _default is not None


def context() -> Context:
    """The default context; raises NotInitializedError before init()."""
    if _default is None:
        raise NotInitializedError("ringserve is not initialized: call ringserve.init() first.")
    return _default


def _worker() -> Worker:
    return context().worker


def rank() -> int:
    """This process's rank in the current view."""
    return _worker().rank


def size() -> int:
    """The number of ranks in the current view."""
    return _worker().size


def local_rank() -> int:
    """This process's rank among the ranks on its host."""
    return _worker().local_rank


def local_size() -> int:
    """The number of ranks on this process's host."""
    return _worker().local_size


def cross_rank() -> int:
    """The index of this process's host among the hosts."""
    return _worker().cross_rank


def cross_size() -> int:
    """The number of hosts."""
    return _worker().cross_size


def _where() -> tuple[int, int]:
    worker = _worker()
    return worker.rank, worker.size


# Every rank of the default context's view: ``process_set=None`` means it too. It holds no state
# (it reads the default context), so it outlives shutdown() and init().
global_process_set: ProcessSet = WholeWorld(_where)


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Registers a process set (a ProcessSet, or its ranks) and returns it, bound to an id; every
    rank calls it with the same ranks, in the same order (see ``Worker.add_process_set``).

    Raises:
        InvalidArgumentError: on every rank at once: a rank repeats or is not in the view, no rank,
            every rank (the global set), a set of those ranks exists, or the ranks disagree.
    """
    return context().call(lambda w: w.add_process_set(process_set))


def remove_process_set(process_set: ProcessSet) -> None:
    """Removes a registered process set on every rank (called alike everywhere); its id becomes None.

    Raises:
        InvalidArgumentError: on every rank at once: the global set, a set not registered, or the
            ranks disagree.
    """
    context().call(lambda w: w.remove_process_set(process_set))


def process_sets() -> dict[int, list[int]]:
    """The registered process sets of the current view, id -> ranks (the global set is 0)."""
    return context().call(_registered)


async def _registered(worker: Worker) -> dict[int, list[int]]:
    return worker.process_sets()


def allreduce(
    a: Any,
    op: str = "average",
    name: str | None = None,
    out: np.ndarray | None = None,
    *,
    compression: str | powersgd.PowerSGD | None = None,
    residual: np.ndarray | None = None,
    check_finite: bool = False,
    parts: Sequence[int] | None = None,
    process_set: ProcessSet | None = None,
) -> np.ndarray:
    """Returns a new array of a's shape and dtype: the reduction of every rank's ``a``.

    ``compression=ringserve.PowerSGD(...)`` averages a float32 ``a`` (op average only) as
    PowerSGD's low-rank approximation, with its error feedback and warm start kept under ``name``
    (required): two allreduces, ``name``.p and ``name``.q (see ringserve.powersgd).

    ``out=a`` reduces in place (as torch.distributed.all_reduce does); any other ``out`` of the
    same shape and dtype receives the result. ``compression``, ``residual`` (error feedback) and
    ``check_finite``: see ``Worker.allreduce``.

    ``op="adasum"``: Adasum (Maleki et al.; Horovod's CPU algorithm, see ringserve/worker/ops/adasum.py)
    of floating point arrays, bit-identical on every rank, on a world whose size is a power of two
    (UnsupportedError otherwise, as Horovod refuses it); ``parts`` gives each tensor fused in ``a``
    its own coefficients.

    ``process_set`` (every collective takes one): a set from ``add_process_set``; the collective
    runs over its members only, as a ring of their own, concurrently with other sets' and the
    whole world's. Only members call it (InvalidArgumentError at once elsewhere).
    """
    if isinstance(compression, powersgd.PowerSGD):
        return _powersgd_allreduce(a, compression, op=op, name=name, out=out, process_set=process_set,
                                   extra=residual is not None or check_finite or parts is not None)
    return context().call(lambda w: w.allreduce(a, op=op, name=name, out=out, compression=compression,
                                                residual=residual, check_finite=check_finite, parts=parts,
                                                process_set=process_set))


def _powersgd_allreduce(a: Any, compressor: powersgd.PowerSGD, *, op: str, name: str | None, out: np.ndarray | None,
                        process_set: ProcessSet | None, extra: bool) -> np.ndarray:
    if name is None:
        raise InvalidArgumentError("An allreduce with PowerSGD needs a name: its warm start and error feedback are kept by it.")
    if op != "average":
        raise InvalidArgumentError(f"PowerSGD averages (op 'average'), not {op!r}.")
    if extra:
        raise InvalidArgumentError("PowerSGD keeps its own error feedback: it takes no residual, check_finite or parts.")
    array = np.asarray(a)
    if array.dtype != np.float32:
        raise InvalidArgumentError(f"PowerSGD reduces float32 arrays, not {array.dtype}.")
    rnd = compressor.begin(name, array.reshape(-1), [array.shape])
    ctx = context()

    def reduce(w: Worker, x: np.ndarray, n: str) -> Coroutine[Any, Any, np.ndarray]:
        return w.allreduce(x, op="average", name=n, process_set=process_set)

    reduced = ctx.call(lambda w: powersgd.exchange(rnd, name, lambda x, n: reduce(w, x, n)),
                       timeout_s=2 * ctx.config.collective_timeout_s + THREAD_WAIT_SLACK_S)
    result = rnd.finish(reduced).reshape(array.shape)
    if out is None:
        return result
    out[...] = result
    return out


def broadcast(a: Any, root: int = 0, name: str | None = None, *, process_set: ProcessSet | None = None) -> np.ndarray:
    """Root's ``a`` on every rank; ``root`` is a global rank (a member of ``process_set``, if given)."""
    return context().call(lambda w: w.broadcast(a, root=root, name=name, process_set=process_set))


def allgather(a: Any, name: str | None = None, *, process_set: ProcessSet | None = None) -> np.ndarray:
    return context().call(lambda w: w.allgather(a, name=name, process_set=process_set))


def reduce_scatter(a: Any, op: str = "average", name: str | None = None, *, compression: str | None = None,
                   process_set: ProcessSet | None = None) -> np.ndarray:
    return context().call(lambda w: w.reduce_scatter(a, op=op, name=name, compression=compression,
                                                     process_set=process_set))


def alltoall(a: Any, splits: Any = None, name: str | None = None, *,
             process_set: ProcessSet | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sends ``splits[d]`` rows of ``a`` (along axis 0) to rank d; returns the rows every rank sent
    this one, concatenated in rank order, and how many rows came from each (int64).

    Without splits, axis 0 is split evenly (its length must be a multiple of the world size).
    Otherwise one non-negative integer per rank, summing to at most ``len(a)``; rows past the sum
    are not sent (Horovod's rule). Wrong splits fail on every rank (InvalidArgumentError here,
    MismatchError on ranks whose arguments were right) within ``abort_grace_s``.
    Over a process set, d counts its members (ranks within the set).
    """
    return context().call(lambda w: w.alltoall(a, splits=splits, name=name, process_set=process_set))


def grouped_allgather(arrays: Sequence[Any], name: str | None = None, *,
                      process_set: ProcessSet | None = None) -> list[np.ndarray]:
    """``allgather`` of each array of a list, as one collective (arrays of any dtypes)."""
    return context().call(lambda w: w.grouped_allgather(arrays, name=name, process_set=process_set))


def grouped_reduce_scatter(arrays: Sequence[Any], op: str = "average", name: str | None = None, *,
                           compression: str | list[str | None] | None = None,
                           process_set: ProcessSet | None = None) -> list[np.ndarray]:
    """``reduce_scatter`` of each array of a list, as one collective per dtype."""
    return context().call(lambda w: w.grouped_reduce_scatter(arrays, op=op, name=name, compression=compression,
                                                             process_set=process_set))


def join() -> int:
    """Horovod's join for uneven data: this rank has no more data. Until every rank has joined, it
    takes part in the others' allreduces with zeros (Average still divides by the world size) and
    barriers, and refuses their other collectives (they fail with MismatchError), as Horovod does.
    Returns the rank that joined last, the same on every rank. Waits at most ``join_timeout_s``.
    """
    ctx = context()
    return ctx.call(lambda w: w.join(), timeout_s=ctx.config.join_timeout_s + ctx.config.collective_timeout_s
                    + THREAD_WAIT_SLACK_S)


def barrier(*, process_set: ProcessSet | None = None) -> None:
    context().call(lambda w: w.barrier(process_set=process_set))


def broadcast_object(obj: object = None, root: int = 0, name: str | None = None, *,
                     process_set: ProcessSet | None = None) -> object:
    return context().call(lambda w: w.broadcast_object(obj, root=root, name=name, process_set=process_set))


def allgather_object(obj: object, name: str | None = None, *, process_set: ProcessSet | None = None) -> list[object]:
    return context().call(lambda w: w.allgather_object(obj, name=name, process_set=process_set))
