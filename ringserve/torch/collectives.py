"""Tensor collectives with Horovod's names and arguments: allreduce, allgather, broadcast,
reducescatter, their in-place and async forms, handles, barrier and join.

Async forms return a ``Handle`` (handles.py); ``synchronize(handle)`` waits for it and returns the
result, and ``poll(handle)`` says whether it is done. A tensor passed to an async call must not be modified
until the call is synchronized: CPU tensors are read in place, without a copy.

``allreduce``, ``allgather``, ``broadcast`` and ``reducescatter`` are differentiable, as in Horovod.
Grouped allreduce is in ``grouped``, the sparse reduction in ``sparse``; what starting any of them
does (the tensor made an array, the call submitted, the result made a tensor) is ``starts``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ringserve import api
from ringserve.torch import _tensors, basics, ops
from ringserve.torch.compression import Compression, Compressor, split, wire_codec
from ringserve.torch.handles import Handle, claim_name, poll, synchronize
from ringserve.torch.starts import allgather_start, allreduce_start, broadcast_start, rescale, scaled
from ringserve.worker.ops.process_sets import ProcessSet

# Handles are handles.py's; they are named here too, beside the collectives that return them.
__all__ = [
    "Handle", "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "join", "poll", "reducescatter",
    "reducescatter_async", "synchronize",
]


# -- allreduce -------------------------------------------------------------------------------

class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ops.ReduceOp, name: str | None,
                prescale: float, postscale: float, compression: type[Compressor] | Compressor,
                process_set: ProcessSet | None) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        return allreduce_start(tensor, op=op, name=name, compression=compression, prescale_factor=prescale,
                                postscale_factor=postscale, out=None, process_set=process_set).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, prescale, postscale, process_set = ctx.args
        reduced = allreduce_start(grad, op=op, name=None, compression=Compression.none, prescale_factor=prescale,
                                   postscale_factor=postscale, out=None, process_set=process_set).wait()
        return reduced, None, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] | Compressor = Compression.none, op: ops.ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: object = None) -> torch.Tensor:
    """Returns the reduction of ``tensor`` over all ranks, as a new tensor (differentiable).

    Args:
        tensor: the same shape and dtype on every rank.
        average: deprecated; use op.
        name: matches the call across ranks (named calls may be issued in any order).
        compression: how the tensor travels (Compression.none, fp16, bf16, int8).
        op: Average (default), Sum, Min or Max.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after the reduction.
        process_set: reduce over that set's ranks only (an Average divides by its size); only its
            members call it. None or global_process_set: every rank.
    """
    ps = basics.resolve_set(process_set)
    reduce_op = ops.resolve(op, average)
    result: torch.Tensor = _Allreduce.apply(tensor, reduce_op, name, prescale_factor, postscale_factor, compression, ps)
    return result


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ops.ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: object = None) -> Handle[torch.Tensor]:
    """Starts allreduce() and returns its handle; synchronize(handle) returns a new tensor."""
    ps = basics.resolve_set(process_set)
    return allreduce_start(tensor, op=ops.resolve(op, average), name=name, compression=Compression.none,
                            prescale_factor=prescale_factor, postscale_factor=postscale_factor, out=None,
                            process_set=ps)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ops.ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: object = None) -> torch.Tensor:
    """Reduces ``tensor`` in place over all ranks and returns it."""
    return allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set).wait()


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ops.ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: object = None) -> Handle[torch.Tensor]:
    """Starts allreduce_() and returns its handle; synchronize(handle) returns ``tensor``."""
    ps = basics.resolve_set(process_set)
    return allreduce_start(tensor, op=ops.resolve(op, average), name=name, compression=Compression.none,
                            prescale_factor=prescale_factor, postscale_factor=postscale_factor, out=tensor,
                            process_set=ps)


# -- allgather, broadcast, reducescatter -----------------------------------------------------

class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet | None) -> torch.Tensor:
        ctx.rows = tensor.shape[0]
        ctx.process_set = process_set
        return allgather_start(tensor, name, process_set).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ps = ctx.process_set
        reduced = allreduce_start(grad, op=ops.Average, name=None, compression=Compression.none,
                                   prescale_factor=1.0, postscale_factor=1.0, out=None, process_set=ps).wait()
        rows = api.allgather(np.array([ctx.rows], dtype=np.int64), process_set=ps)
        offset = int(rows[: basics.set_rank(ps)].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: object = None) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` along dimension 0 in rank order (differentiable).

    Dimension 0 may differ between ranks; the other dimensions and the dtype must match. Over a
    process set, its members' tensors in the set's rank order.
    """
    result: torch.Tensor = _Allgather.apply(tensor, name, basics.resolve_set(process_set))
    return result


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: object = None) -> Handle[torch.Tensor]:
    """Starts allgather() and returns its handle."""
    return allgather_start(tensor, name, basics.resolve_set(process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet | None) -> torch.Tensor:
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return broadcast_start(tensor, root_rank, name, None, process_set).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = allreduce_start(grad, op=ops.Average, name=None, compression=Compression.none, prescale_factor=1.0,
                                   postscale_factor=1.0, out=None, process_set=ctx.process_set).wait()
        if api.rank() != ctx.root_rank:  # roots are global ranks, over a process set too
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: object = None) -> torch.Tensor:
    """Returns root_rank's ``tensor`` on every rank, as a new tensor (differentiable). ``root_rank``
    is a global rank, a member of ``process_set`` when one is given (as in Horovod)."""
    result: torch.Tensor = _Broadcast.apply(tensor, root_rank, name, basics.resolve_set(process_set))
    return result


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: object = None) -> Handle[torch.Tensor]:
    return broadcast_start(tensor, root_rank, name, None, basics.resolve_set(process_set))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: object = None) -> torch.Tensor:
    """Overwrites ``tensor`` with root_rank's, in place, and returns it."""
    return broadcast_async_(tensor, root_rank, name, process_set).wait()


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: object = None) -> Handle[torch.Tensor]:
    return broadcast_start(tensor, root_rank, name, tensor, basics.resolve_set(process_set))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ops.ReduceOp | None = None,
                        process_set: object = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        *, compression: type[Compressor] | Compressor = Compression.none) -> Handle[torch.Tensor]:
    """Starts reducescatter() and returns its handle. The arguments are in Horovod's order;
    ``compression`` (which Horovod's reducescatter_async lacks) is ringserve's, by keyword."""
    ps = basics.resolve_set(process_set)
    core = ops.core_op(ops.resolve(op), "reducescatter")
    with basics.named_call(claim_name("reducescatter", name)) as call:
        compression, codec = split(compression)
        wire, cctx = compression.compress(scaled(tensor.detach(), prescale_factor))
        array, layout = _tensors.reducible(wire)
        codec = wire_codec(codec, wire.dtype, array.dtype.kind)
        future = call.submit(lambda w: w.reduce_scatter(array, op=core, name=name, compression=codec, process_set=ps))

    def finish(result: np.ndarray) -> torch.Tensor:
        part = _tensors.restore(result, layout, rows=result.shape[0])
        return rescale(compression.decompress(part, cctx), postscale_factor)

    return Handle(future, finish, claim=call.claim)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, compression: type[Compressor] | Compressor,
                op: ops.ReduceOp, prescale: float, postscale: float, process_set: ProcessSet | None) -> torch.Tensor:
        ctx.scale = (basics.set_size(process_set) if op is ops.Sum else 1.0) * prescale * postscale
        ctx.process_set = process_set
        return reducescatter_async(tensor, name, op, process_set, prescale, postscale, compression=compression).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # Horovod's convention, which code written for it expects: every rank's rows of the
        # gradient, gathered, and for Sum scaled by the world size (as if the gradients of all the
        # ranks' losses were summed, the way allreduce's Sum gradient is).
        scaled = grad * ctx.scale if ctx.scale != 1.0 else grad
        return allgather_start(scaled, None, ctx.process_set).wait(), None, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] | Compressor = Compression.none,
                  op: ops.ReduceOp | None = None, process_set: object = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduces ``tensor`` over all ranks and returns this rank's rows of the result (differentiable).

    Rows are split as evenly as possible, the first ranks getting one more, as in Horovod (over a
    process set, by the rank within the set).
    """
    result: torch.Tensor = _Reducescatter.apply(tensor, name, compression, ops.resolve(op), prescale_factor,
                                                postscale_factor, basics.resolve_set(process_set))
    return result


def barrier(process_set: object = None) -> None:
    """Returns once every rank (of ``process_set``, if given) has called barrier()."""
    ps = basics.resolve_set(process_set)
    try:
        api.barrier(process_set=ps)
    finally:
        basics.waited()


def join(device: int = -1) -> int:
    """Horovod's join for uneven data: this rank has run out of data.

    Until every rank has joined, this rank takes part in the others' allreduces with zeros (so an
    Average still divides by the world size, as in Horovod) and in their barriers, including the
    gradient allreduces of a DistributedOptimizer; their allgathers, broadcasts, alltoalls and
    reducescatters fail with a RuntimeError on every rank while a rank has joined, as Horovod's do.
    Returns the rank that joined last, the same on every rank.

    Args:
        device: Horovod's device for its zero tensors; ringserve stands in on the CPU.
    """
    try:
        return api.join()
    finally:
        basics.waited()
