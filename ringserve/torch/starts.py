"""Starting a collective on tensors: the tensor made an array the wire carries, the call
submitted to the worker's loop, and the finish that makes the result a tensor again.

Shared by the Horovod-named collectives (collectives.py), their grouped forms (grouped.py), the
sparse reduction (sparse.py) and SyncBatchNorm (sync_batch_norm.py). ``scaled`` and ``rescale`` are
Horovod's prescale and postscale factors.
"""

from __future__ import annotations

import numpy as np
import torch

from ringserve.torch import _tensors, basics, ops
from ringserve.torch.compression import Compressor, split, wire_codec
from ringserve.torch.handles import Handle, claim_name
from ringserve.worker.ops.process_sets import ProcessSet

__all__ = ["allgather_start", "allreduce_start", "broadcast_start", "rescale", "scaled"]


def scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor * factor`` in ``tensor``'s dtype; integers are scaled in float64, as Horovod does."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point():
        return tensor * factor
    return (tensor.double() * factor).to(tensor.dtype)


def rescale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Scales a result the caller owns in place where it can; the dtype is kept."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point():
        return tensor.mul_(factor)
    return scaled(tensor, factor)


def allreduce_start(
    tensor: torch.Tensor, *, op: ops.ReduceOp, name: str | None, compression: type[Compressor] | Compressor,
    prescale_factor: float, postscale_factor: float, out: torch.Tensor | None, parts: list[int] | None = None,
    process_set: ProcessSet | None = None,
) -> Handle[torch.Tensor]:
    with basics.named_call(claim_name("allreduce", name)) as call:
        source = tensor.detach()
        # Adasum adds no codec on the wire: a compressor casts around it (fp16 as in Horovod).
        compression, codec = (compression, None) if op is ops.Adasum else split(compression)
        wire, cctx = compression.compress(scaled(source, prescale_factor))
        array, layout = _tensors.reducible(wire)
        # Reduce in place when the wire array is our own copy, or is the memory of ``out`` itself; never
        # into the caller's input of an out-of-place call.
        aliases_input = _tensors.shares_memory(array, source)
        into_out = (out is not None and aliases_input and out.is_contiguous()
                    and array.__array_interface__["data"][0] == out.data_ptr())
        target = array if into_out or not aliases_input else None
        core = ops.core_op(op)
        if core == "average" and array.dtype.kind in "iu":
            # Horovod averages integers as a sum scaled by 1 / size in float64, which truncates
            # toward zero (the core's integer average floors): a joined rank's zeros show it.
            core, postscale_factor = "sum", postscale_factor / basics.set_size(process_set)
        codec = None if core == "adasum" else wire_codec(codec, wire.dtype, array.dtype.kind)
        future = call.submit(lambda w: w.allreduce(array, op=core, name=name, out=target, compression=codec,
                                                   parts=parts, process_set=process_set))

    def finish(result: np.ndarray) -> torch.Tensor:
        if into_out:
            assert out is not None
            if postscale_factor != 1.0:
                with torch.no_grad():
                    out.copy_(scaled(out, postscale_factor))
            return out
        reduced = rescale(compression.decompress(_tensors.restore(result, layout), cctx), postscale_factor)
        if out is None:
            return reduced
        with torch.no_grad():
            return out.copy_(reduced)

    return Handle(future, finish, claim=call.claim)


def allgather_start(tensor: torch.Tensor, name: str | None,
                     process_set: ProcessSet | None = None) -> Handle[torch.Tensor]:
    with basics.named_call(claim_name("allgather", name)) as call:
        array, layout = _tensors.raw(tensor)
        future = call.submit(lambda w: w.allgather(array, name=name, process_set=process_set))
    return Handle(future, lambda result: _tensors.restore(result, layout, rows=result.shape[0]), claim=call.claim)


def broadcast_start(tensor: torch.Tensor, root_rank: int, name: str | None,
                     out: torch.Tensor | None, process_set: ProcessSet | None = None) -> Handle[torch.Tensor]:
    with basics.named_call(claim_name("broadcast", name)) as call:
        array, layout = _tensors.raw(tensor)
        future = call.submit(lambda w: w.broadcast(array, root=root_rank, name=name, process_set=process_set))

    def finish(result: np.ndarray) -> torch.Tensor:
        value = _tensors.restore(result, layout)
        if out is None:
            return value
        with torch.no_grad():
            return out.copy_(value)

    return Handle(future, finish, claim=call.claim)
