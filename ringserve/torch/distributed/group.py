"""``ProcessGroupRingserve``: a torch ``ProcessGroup`` whose ops run on ringserve's ring.

torch calls these methods for ``dist.all_reduce`` and the rest (on the default group and on
``new_group``'s sub-rings alike), and DDP's reducer calls them from
C++ through the ProcessGroup trampoline. Each op checks its arguments, starts its ringserve calls
(ops.py, over the group's Plane) and returns a ``RingserveWork`` at once; ``async_op=False`` is
torch waiting on it. An op ringserve cannot do raises NotImplementedError before anything starts.

The group runs in the view it was formed in: once a peer dies or leaves, ringserve moves to a new
view and every op of this group, in flight or later, fails with DistBackendError on every
survivor (a torch group's members are fixed). Recovery is a new group (see docs/guide/torch-distributed.md).
Likewise once an op of the group times out on any rank: every later op of the group fails on
every rank of it, as gloo's do (breaker.py); the other groups go on.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from ringserve.constants import WORK_WAIT_SLACK_S
from ringserve.torch.distributed import ops, sparse
from ringserve.torch.distributed.breaker import name_op
from ringserve.torch.distributed.plane import Plane
from ringserve.torch.distributed.rendezvous import World, join_world
from ringserve.torch.distributed.settings import Settings
from ringserve.torch.distributed.work import Completer, RingserveWork, backend_error

BACKEND_NAME = "ringserve"
_MONITORED = "monitored_barrier"  # the name of monitored_barrier's messages (torch's tags are ints)


def _opt(opts: Any, kind: type) -> Any:
    return kind() if opts is None else opts


def _op(what: str) -> Callable[[Callable[..., RingserveWork]], Callable[..., RingserveWork]]:
    """An op of the group: refused at once, before it starts, once the group's view is gone or a
    timeout broke the group; named ``what`` while it starts its calls (a timeout of one of them
    breaks the group, see breaker.py)."""

    def wrap(method: Callable[..., RingserveWork]) -> Callable[..., RingserveWork]:
        @functools.wraps(method)
        def op(self: ProcessGroupRingserve, *args: Any, **kwargs: Any) -> RingserveWork:
            self._check(what)
            outer = name_op(what)
            try:
                return method(self, *args, **kwargs)
            finally:
                name_op(outer)

        return op

    return wrap


def _tensor_list(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _seconds(timeout: Any) -> float | None:
    """A timeout in seconds; None when unset (torch's options leave it at -1 ms) or zero."""
    seconds: float | None = timeout.total_seconds() if isinstance(timeout, timedelta) else None
    return seconds if seconds is not None and seconds > 0 else None


class ProcessGroupRingserve(dist.ProcessGroup):
    """torch.distributed's "ringserve" backend (made by ``init_process_group("ringserve")``).

    Args:
        plane: the ring the group's ops run on.
        settings: compression and the rest (see settings.Options).
        world: the worker of the default group, released with it; None for a new_group.
    """

    def __init__(self, plane: Plane, settings: Settings, world: World | None = None) -> None:
        super().__init__(plane.rank, plane.size)  # type: ignore[call-arg]  # the (rank, size) form
        self.plane = plane
        self.settings = settings
        self._world = world
        self._completer = Completer(plane.timeout_s + WORK_WAIT_SLACK_S)
        self._residuals = ops.Residuals() if settings.error_feedback else None
        self._closed = False
        self._group_name = ""
        self._group_desc = ""

    # torch's names: a ProcessGroup without C++ backends keeps its name and description itself.
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupRingserve(rank={self.plane.rank}, size={self.plane.size}, view={self.plane.view_id})"

    def _run(self, what: str, started: ops.Started, opts: Any = None) -> RingserveWork:
        return self._completer.track(what, started.parts, started.finish, self._limit(opts))

    def _on(self, opts: Any) -> Plane:
        """The plane an op runs on: the group's, under the op's own timeout where it has one."""
        seconds = _seconds(getattr(opts, "timeout", None))
        return self.plane if seconds is None else self.plane.with_timeout(seconds)

    def _limit(self, opts: Any) -> float:
        """How long a caller waits for an op: its deadline, and a slack for the ring to fail it first."""
        seconds = _seconds(getattr(opts, "timeout", None))
        return (self.plane.timeout_s if seconds is None else seconds) + WORK_WAIT_SLACK_S

    def _check(self, what: str) -> None:
        """Fails an op at once, before it starts, once the group's view is gone or a timeout broke
        the group: every later op raises DistBackendError as the first failed one did, and none
        waits for peers that left or gave up."""
        if self._closed:
            raise dist.DistBackendError(f"ringserve: {what} on a process group that was shut down.")
        moved = self.plane.moved_on()
        if moved is not None:
            raise backend_error(moved, what)
        broken = self.plane.breaker.error()
        if broken is not None:
            raise backend_error(broken, what)

    # -- reductions ------------------------------------------------------------------------

    @_op("all_reduce")
    def allreduce(self, tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.AllreduceOptions)
        tensor = ops.single(_tensor_list(tensors), "all_reduce")
        op = ops.core_op(opts.reduceOp, "all_reduce", tensor.dtype)
        if tensor.is_sparse:
            return self._run("all_reduce", sparse.allreduce(self._on(opts), tensor, op), opts)
        return self._run("all_reduce", ops.allreduce(
            self._on(opts), tensor, op, compression=self.settings.compression, residuals=self._residuals), opts)

    @_op("all_reduce_coalesced")
    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.AllreduceCoalescedOptions)
        tensors = _tensor_list(tensors)
        op = ops.core_op(opts.reduceOp, "all_reduce_coalesced", tensors[0].dtype if tensors else None)
        return self._run("all_reduce_coalesced", ops.allreduce_coalesced(
            self._on(opts), tensors, op, compression=self.settings.compression), opts)

    @_op("reduce")
    def reduce(self, tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.ReduceOptions)
        tensor = ops.single(_tensor_list(tensors), "reduce")
        op = ops.core_op(opts.reduceOp, "reduce", tensor.dtype)
        return self._run("reduce", ops.reduce(self._on(opts), tensor, opts.rootRank, op), opts)

    @_op("reduce_scatter")
    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.ReduceScatterOptions)
        output = ops.single(_tensor_list(output_tensors), "reduce_scatter")
        inputs = input_tensors[0] if input_tensors and not isinstance(input_tensors[0], torch.Tensor) else input_tensors
        op = ops.core_op(opts.reduceOp, "reduce_scatter", output.dtype)
        return self._run("reduce_scatter", ops.reduce_scatter_list(self._on(opts), output, list(inputs), op), opts)

    @_op("reduce_scatter_tensor")
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.ReduceScatterOptions)
        op = ops.core_op(opts.reduceOp, "reduce_scatter_tensor", output.dtype)
        return self._run("reduce_scatter_tensor", ops.reduce_scatter_into(self._on(opts), output, input, op), opts)

    _reduce_scatter_base = reduce_scatter_single

    @_op("reduce_scatter_tensor_coalesced")
    def reduce_scatter_single_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                        opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.ReduceScatterOptions)
        op = ops.core_op(opts.reduceOp, "reduce_scatter_tensor_coalesced", outputs[0].dtype if outputs else None)
        plane = self._on(opts)
        return self._many("reduce_scatter_tensor_coalesced",
                          [ops.reduce_scatter_into(plane, o, i, op) for o, i in zip(outputs, inputs, strict=True)], opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- moves -----------------------------------------------------------------------------

    @_op("broadcast")
    def broadcast(self, tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.BroadcastOptions)
        tensor = ops.single(_tensor_list(tensors), "broadcast")
        return self._run("broadcast", ops.broadcast(self._on(opts), tensor, opts.rootRank), opts)

    @_op("all_gather")
    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RingserveWork:
        tensor = ops.single(_tensor_list(input_tensors), "all_gather")
        outputs = output_tensors[0] if output_tensors and not isinstance(output_tensors[0], torch.Tensor) else output_tensors
        return self._run("all_gather", ops.allgather(self._on(opts), list(outputs), tensor), opts)

    @_op("all_gather_into_tensor")
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RingserveWork:
        return self._run("all_gather_into_tensor", ops.allgather_into(self._on(opts), output, input), opts)

    _allgather_base = all_gather_single

    @_op("all_gather_into_tensor_coalesced")
    def all_gather_single_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                    opts: Any = None) -> RingserveWork:
        plane = self._on(opts)
        return self._many("all_gather_into_tensor_coalesced",
                          [ops.allgather_into(plane, o, i) for o, i in zip(outputs, inputs, strict=True)], opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_op("all_gather_coalesced")
    def allgather_coalesced(self, output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
                            opts: Any = None) -> RingserveWork:
        """``output_lists[src][i]`` gets group rank src's ``inputs[i]`` (torch hands the lists by
        source rank first)."""
        return self._run("all_gather_coalesced", ops.allgather_coalesced(self._on(opts), output_lists, list(inputs)),
                         opts)

    @_op("gather")
    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.GatherOptions)
        tensor = ops.single(_tensor_list(input_tensors), "gather")
        outputs = output_tensors[0] if output_tensors else []
        return self._run("gather", ops.gather(self._on(opts), list(outputs), tensor, opts.rootRank), opts)

    @_op("scatter")
    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.ScatterOptions)
        output = ops.single(_tensor_list(output_tensors), "scatter")
        inputs = input_tensors[0] if input_tensors else []
        return self._run("scatter", ops.scatter(self._on(opts), output, list(inputs), opts.rootRank), opts)

    @_op("barrier")
    def barrier(self, opts: Any = None) -> RingserveWork:
        part = self._on(opts).barrier()
        return self._completer.track("barrier", [part], lambda _: [], self._limit(opts))

    # -- point-to-point and all-to-all ------------------------------------------------------

    @_op("send")
    def send(self, tensors: Any, dst: int, tag: int = 0) -> RingserveWork:
        """Sends to group rank ``dst``; done once the bytes are on the link (gloo's send too)."""
        tensor = ops.single(_tensor_list(tensors), "send")
        part = self.plane.send(ops.as_bytes(tensor), dst, tag)
        return self._completer.track("send", [part], lambda _: [tensor], self._limit(None))

    def recv(self, tensors: Any, src: int, tag: int = 0) -> RingserveWork:
        return self._recv(_tensor_list(tensors), src, tag)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> RingserveWork:
        return self._recv(_tensor_list(tensors), None, tag)

    @_op("recv")
    def _recv(self, tensors: list[torch.Tensor], src: int | None, tag: int) -> RingserveWork:
        """A recv from group rank ``src`` (None: from any); the work's ``_source_rank()`` is the
        sender's group rank once it is done (what ``dist.recv`` returns, as a global rank)."""
        tensor = ops.single(tensors, "recv")
        buffer = torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8, device="cpu").numpy()
        part = self.plane.recv(buffer, src, tag)

        def finish(results: list[Any]) -> list[torch.Tensor]:
            ops.fill(tensor, buffer)
            return [tensor]

        work = self._completer.track("recv", [part], finish, self._limit(None))
        work.sender_of = part  # its result is the sender's group rank
        return work

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """torch's ``ProcessGroup.monitored_barrier``, as gloo's does it: every other rank checks in
        with group rank 0 and waits for its answer; rank 0 waits for each within ``timeout`` (the
        group's when None) and raises RuntimeError naming the ranks that did not come (the first
        one, or with ``wait_all_ranks`` all of them). torch's ``dist.monitored_barrier`` itself
        refuses every backend but gloo; this is the process group's own method.
        """
        self._check("monitored_barrier")
        seconds = self.plane.timeout_s if timeout is None else max(timeout.total_seconds(), 0.0)
        ms = int(seconds * 1000)
        plane = self.plane.with_timeout(max(seconds, 1e-3))
        token = np.zeros(1, dtype=np.uint8)
        if self.plane.rank != 0:
            try:
                plane.send(token, 0, _MONITORED).result(seconds + WORK_WAIT_SLACK_S)
                plane.recv(np.zeros(1, dtype=np.uint8), 0, _MONITORED).result(seconds + WORK_WAIT_SLACK_S)
            except Exception as exc:
                raise RuntimeError(
                    f"Rank {self.plane.rank} successfully reached monitoredBarrier, but received errors while waiting "
                    f"for send/recv from rank 0. Please check rank 0 logs for faulty rank ({exc})."
                ) from exc
            return
        start = time.monotonic()
        if seconds <= 0:
            raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {ms} ms.")
        arrivals = {r: plane.recv(np.zeros(1, dtype=np.uint8), r, _MONITORED) for r in range(1, self.plane.size)}
        failed: list[int] = []
        for r, arrival in arrivals.items():
            left = seconds if wait_all_ranks else seconds - (time.monotonic() - start)
            try:
                arrival.result(max(left, 0.0))
            except Exception as exc:
                if not wait_all_ranks:
                    raise RuntimeError(f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {ms} ms") from exc
                failed.append(r)
        if failed:
            raise RuntimeError(f"[Rank 0]: Ranks {', '.join(map(str, failed))} failed to pass monitoredBarrier in {ms} ms")
        for r in arrivals:
            plane.send(token, r, _MONITORED).result(seconds + WORK_WAIT_SLACK_S)

    @_op("all_to_all_single")
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], opts: Any = None) -> RingserveWork:
        return self._run("all_to_all_single", ops.all_to_all(self._on(opts), output, input, output_split_sizes,
                                                             input_split_sizes), opts)

    alltoall_base = all_to_all_single

    @_op("all_to_all")
    def alltoall(self, output_tensors: Sequence[torch.Tensor], input_tensors: Sequence[torch.Tensor],
                 opts: Any = None) -> RingserveWork:
        return self._run("all_to_all", ops.all_to_all_list(self._on(opts), list(output_tensors), list(input_tensors)),
                         opts)

    # -- lifecycle -------------------------------------------------------------------------

    def _many(self, what: str, started: list[ops.Started], opts: Any = None) -> RingserveWork:
        parts = [p for s in started for p in s.parts]
        counts = [len(s.parts) for s in started]

        def finish(results: list[Any]) -> list[Any]:
            values, offset = [], 0
            for s, n in zip(started, counts, strict=True):
                values.append(s.finish(results[offset: offset + n]))
                offset += n
            return values

        return self._completer.track(what, parts, finish, self._limit(opts))

    def shutdown(self) -> None:
        """Releases the group: its completion threads, and for the default group the worker and the
        coordinator the backend started (a worker that hvd.init() started is left running)."""
        if self._closed:
            return
        self._closed = True
        self._completer.close()
        if self._world is not None:
            worker = self._world.context.worker
            if worker.running_view == self.plane.view_id:
                worker.pin_view(None)
            self._world.close()

    def abort(self) -> None:
        self.shutdown()


def _group_timeout(opts: Any, settings: Settings, default_s: float) -> float:
    """The deadline of every op of a new group: the timeout given to init_process_group or
    new_group. Where none was given (torch's default, 30 minutes), RINGSERVE_COLLECTIVE_TIMEOUT_S
    (or ``Options(worker={"collective_timeout_s": ...})``) when set, which ``default_s`` holds."""
    given = _seconds(getattr(opts, "timeout", None))
    if given is None or (settings.timeout_from_env and opts.timeout == default_pg_timeout):
        return default_s
    return given


def create(opts: Any, pg_options: Any = None) -> ProcessGroupRingserve | dist.ProcessGroup:
    """torch's factory of the "ringserve" backend (``register_backend(..., extended_api=True)``).

    The default group joins ringserve (see rendezvous.py); a ``new_group(ranks)`` is a sub-ring of
    the default group's plane (``Plane.subset``), made on its members only (torch hands the others
    GroupMember.NON_GROUP_MEMBER without calling the backend).
    """
    settings = Settings.from_env(pg_options)
    ranks = list(opts.global_ranks_in_group)
    default = dist.distributed_c10d._world.default_pg
    if ranks and isinstance(default, ProcessGroupRingserve):
        timeout_s = _group_timeout(opts, settings, default.plane.context.config.collective_timeout_s)
        return ProcessGroupRingserve(default.plane.subset(ranks, tag=f"torch.group.{opts.group_id}", timeout_s=timeout_s),
                                     settings)
    if ranks and sorted(ranks) != list(range(max(opts.group_size, len(ranks)))):
        raise NotImplementedError(
            f"A ringserve group of ranks {ranks} under a default group of another backend is not supported: its "
            "sub-ring is one of ringserve's default group. Make ringserve the default backend "
            "(init_process_group('ringserve')), or use every rank."
        )
    world = join_world(opts.store, opts.group_rank, opts.group_size, opts.timeout, settings)
    worker = world.context.worker
    try:
        plane = Plane(world.context, tag=None if not ranks else f"torch.group.{opts.group_id}", view_id=worker.view_id,
                      timeout_s=_group_timeout(opts, settings, world.context.config.collective_timeout_s))
        # The group's members are fixed: once the view moves on, every op fails (see the docstring).
        worker.pin_view(plane.view_id)
        world.view_id = plane.view_id
        group = ProcessGroupRingserve(plane, settings, world)
    except BaseException:
        world.close()
        raise
    return group

