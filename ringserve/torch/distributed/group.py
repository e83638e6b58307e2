"""``ProcessGroupRingserve``: a torch ``ProcessGroup`` whose ops run on ringserve's ring.

torch calls these methods for ``dist.all_reduce`` and the rest (on the default group and on
``new_group``'s sub-rings alike), and DDP's reducer calls them from
C++ through the ProcessGroup trampoline. Each op checks its arguments, starts its ringserve calls
(ops.py, over the group's Plane) and returns a ``RingserveWork`` at once; ``async_op=False`` is
torch waiting on it. An op ringserve cannot do raises NotImplementedError before anything starts.

The group runs in the view it was formed in: once a peer dies or leaves, ringserve moves to a new
view and every op of this group, in flight or later, fails with DistBackendError on every
survivor (a torch group's members are fixed). Recovery is a new group (see docs/guide/torch-distributed.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringserve.torch.distributed import ops
from ringserve.torch.distributed.plane import Plane
from ringserve.torch.distributed.rendezvous import World, join_world
from ringserve.torch.distributed.settings import Settings
from ringserve.torch.distributed.work import Completer, RingserveWork, backend_error

BACKEND_NAME = "ringserve"
# A waiting caller gives up this long after a collective's own deadline (which fails it first).
_WAIT_SLACK_S = 30.0


def _opt(opts: Any, kind: type) -> Any:
    return kind() if opts is None else opts


def _op(what: str) -> Callable[[Callable[..., RingserveWork]], Callable[..., RingserveWork]]:
    """An op of the group: refused at once, before it starts, once the group's view is gone."""

    def wrap(method: Callable[..., RingserveWork]) -> Callable[..., RingserveWork]:
        @functools.wraps(method)
        def op(self: ProcessGroupRingserve, *args: Any, **kwargs: Any) -> RingserveWork:
            self._check(what)
            return method(self, *args, **kwargs)

        return op

    return wrap


def _tensor_list(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


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
        self._completer = Completer(plane.context.config.collective_timeout_s + _WAIT_SLACK_S)
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

    def _run(self, what: str, started: ops.Started) -> RingserveWork:
        return self._completer.track(what, started.parts, started.finish)

    def _check(self, what: str) -> None:
        """Fails an op at once, before it starts, once the group's view is gone: every later op
        raises DistBackendError as the first failed one did, and none waits for peers that left."""
        if self._closed:
            raise dist.DistBackendError(f"ringserve: {what} on a process group that was shut down.")
        moved = self.plane.moved_on()
        if moved is not None:
            raise backend_error(moved, what)

    # -- reductions ------------------------------------------------------------------------

    @_op("all_reduce")
    def allreduce(self, tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.AllreduceOptions)
        tensor = ops.single(_tensor_list(tensors), "all_reduce")
        op = ops.core_op(opts.reduceOp, "all_reduce")
        return self._run("all_reduce", ops.allreduce(
            self.plane, tensor, op, compression=self.settings.compression, residuals=self._residuals))

    @_op("all_reduce_coalesced")
    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.AllreduceCoalescedOptions)
        op = ops.core_op(opts.reduceOp, "all_reduce_coalesced")
        return self._run("all_reduce_coalesced", ops.allreduce_coalesced(
            self.plane, _tensor_list(tensors), op, compression=self.settings.compression))

    @_op("reduce")
    def reduce(self, tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.ReduceOptions)
        tensor = ops.single(_tensor_list(tensors), "reduce")
        return self._run("reduce", ops.reduce(self.plane, tensor, opts.rootRank, ops.core_op(opts.reduceOp, "reduce")))

    @_op("reduce_scatter")
    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.ReduceScatterOptions)
        output = ops.single(_tensor_list(output_tensors), "reduce_scatter")
        inputs = input_tensors[0] if input_tensors and not isinstance(input_tensors[0], torch.Tensor) else input_tensors
        op = ops.core_op(opts.reduceOp, "reduce_scatter")
        return self._run("reduce_scatter", ops.reduce_scatter_list(self.plane, output, list(inputs), op))

    @_op("reduce_scatter_tensor")
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.ReduceScatterOptions)
        op = ops.core_op(opts.reduceOp, "reduce_scatter_tensor")
        return self._run("reduce_scatter_tensor", ops.reduce_scatter_into(self.plane, output, input, op))

    _reduce_scatter_base = reduce_scatter_single

    @_op("reduce_scatter_tensor_coalesced")
    def reduce_scatter_single_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                        opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.ReduceScatterOptions)
        op = ops.core_op(opts.reduceOp, "reduce_scatter_tensor_coalesced")
        return self._many("reduce_scatter_tensor_coalesced",
                          [ops.reduce_scatter_into(self.plane, o, i, op) for o, i in zip(outputs, inputs, strict=True)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- moves -----------------------------------------------------------------------------

    @_op("broadcast")
    def broadcast(self, tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.BroadcastOptions)
        tensor = ops.single(_tensor_list(tensors), "broadcast")
        return self._run("broadcast", ops.broadcast(self.plane, tensor, opts.rootRank))

    @_op("all_gather")
    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RingserveWork:
        tensor = ops.single(_tensor_list(input_tensors), "all_gather")
        outputs = output_tensors[0] if output_tensors and not isinstance(output_tensors[0], torch.Tensor) else output_tensors
        return self._run("all_gather", ops.allgather(self.plane, list(outputs), tensor))

    @_op("all_gather_into_tensor")
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> RingserveWork:
        return self._run("all_gather_into_tensor", ops.allgather_into(self.plane, output, input))

    _allgather_base = all_gather_single

    @_op("all_gather_into_tensor_coalesced")
    def all_gather_single_coalesced(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                                    opts: Any = None) -> RingserveWork:
        return self._many("all_gather_into_tensor_coalesced",
                          [ops.allgather_into(self.plane, o, i) for o, i in zip(outputs, inputs, strict=True)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_op("all_gather_coalesced")
    def allgather_coalesced(self, output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
                            opts: Any = None) -> RingserveWork:
        return self._many("all_gather_coalesced",
                          [ops.allgather(self.plane, list(o), i) for o, i in zip(output_lists, inputs, strict=True)])

    @_op("gather")
    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.GatherOptions)
        tensor = ops.single(_tensor_list(input_tensors), "gather")
        outputs = output_tensors[0] if output_tensors else []
        return self._run("gather", ops.gather(self.plane, list(outputs), tensor, opts.rootRank))

    @_op("scatter")
    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> RingserveWork:
        opts = _opt(opts, dist.ScatterOptions)
        output = ops.single(_tensor_list(output_tensors), "scatter")
        inputs = input_tensors[0] if input_tensors else []
        return self._run("scatter", ops.scatter(self.plane, output, list(inputs), opts.rootRank))

    @_op("barrier")
    def barrier(self, opts: Any = None) -> RingserveWork:
        part = self.plane.barrier()
        return self._completer.track("barrier", [part], lambda _: [])

    # -- point-to-point and all-to-all ------------------------------------------------------

    @_op("send")
    def send(self, tensors: Any, dst: int, tag: int = 0) -> RingserveWork:
        """Sends to group rank ``dst``; done once the bytes are on the link (gloo's send too)."""
        tensor = ops.single(_tensor_list(tensors), "send")
        part = self.plane.send(ops.as_bytes(tensor), dst, tag)
        return self._completer.track("send", [part], lambda _: [tensor])

    def recv(self, tensors: Any, src: int, tag: int = 0) -> RingserveWork:
        return self._recv(_tensor_list(tensors), src, tag)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> RingserveWork:
        return self._recv(_tensor_list(tensors), None, tag)

    @_op("recv")
    def _recv(self, tensors: list[torch.Tensor], src: int | None, tag: int) -> RingserveWork:
        tensor = ops.single(tensors, "recv")
        buffer = torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8).numpy()
        part = self.plane.recv(buffer, src, tag)

        def finish(results: list[Any]) -> list[torch.Tensor]:
            ops.fill(tensor, buffer)
            return [tensor]

        return self._completer.track("recv", [part], finish)

    @_op("all_to_all_single")
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], opts: Any = None) -> RingserveWork:
        return self._run("all_to_all_single", ops.all_to_all(self.plane, output, input, output_split_sizes,
                                                             input_split_sizes))

    alltoall_base = all_to_all_single

    @_op("all_to_all")
    def alltoall(self, output_tensors: Sequence[torch.Tensor], input_tensors: Sequence[torch.Tensor],
                 opts: Any = None) -> RingserveWork:
        return self._run("all_to_all", ops.all_to_all_list(self.plane, list(output_tensors), list(input_tensors)))

    # -- lifecycle -------------------------------------------------------------------------

    def _many(self, what: str, started: list[ops.Started]) -> RingserveWork:
        parts = [p for s in started for p in s.parts]
        counts = [len(s.parts) for s in started]

        def finish(results: list[Any]) -> list[Any]:
            values, offset = [], 0
            for s, n in zip(started, counts, strict=True):
                values.append(s.finish(results[offset: offset + n]))
                offset += n
            return values

        return self._completer.track(what, parts, finish)

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
        plane = default.plane.subset(ranks, tag=f"torch.group.{opts.group_id}")
        return ProcessGroupRingserve(plane, settings)
    if ranks and sorted(ranks) != list(range(max(opts.group_size, len(ranks)))):
        raise NotImplementedError(
            f"A ringserve group of ranks {ranks} under a default group of another backend is not supported: its "
            "sub-ring is one of ringserve's default group. Make ringserve the default backend "
            "(init_process_group('ringserve')), or use every rank."
        )
    world = join_world(opts.store, opts.group_rank, opts.group_size, opts.timeout, settings)
    worker = world.context.worker
    try:
        plane = Plane(world.context, tag=None if not ranks else f"torch.group.{opts.group_id}", view_id=worker.view_id)
        # The group's members are fixed: once the view moves on, every op fails (see the docstring).
        worker.pin_view(plane.view_id)
        world.view_id = plane.view_id
        group = ProcessGroupRingserve(plane, settings, world)
    except BaseException:
        world.close()
        raise
    return group

