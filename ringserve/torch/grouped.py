"""Grouped allreduce: a list of tensors reduced as one fused collective per wire dtype and device,
with Horovod's names and arguments (``grouped_allreduce``, its in-place and async forms)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import torch

from ringserve.torch import basics, ops
from ringserve.torch.collectives import Handle, _allreduce_start
from ringserve.torch.compression import Compression, Compressor, split


def _grouped_start(
    tensors: Sequence[torch.Tensor], *, op: ops.ReduceOp, name: str | None,
    compression: type[Compressor] | Compressor, prescale_factor: float, postscale_factor: float,
    in_place: bool,
) -> Handle[list[torch.Tensor]]:
    """Fuses tensors of one wire dtype and device into one buffer, and reduces each buffer once."""
    around, codec = split(compression)
    # The wire codec (if any) is applied by each fused reduction; a compressor without one, here.
    on_wire = Compression.none if codec is None else compression
    compressed = [around.compress(t.detach()) for t in tensors]
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, (wire, _) in enumerate(compressed):
        groups.setdefault((wire.dtype, wire.device), []).append(i)
    handles: list[tuple[list[int], Handle[torch.Tensor]]] = []
    for k, members in enumerate(groups.values()):
        flat = torch.cat([compressed[i][0].reshape(-1) for i in members])
        part_name = None if name is None else f"{name}.{k}"
        handles.append((members, _allreduce_start(
            flat, op=op, name=part_name, compression=on_wire, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, out=None)))
    future: concurrent.futures.Future[None] = concurrent.futures.Future()
    future.set_result(None)

    def finish(_: None) -> list[torch.Tensor]:
        results: list[torch.Tensor] = [tensors[0]] * len(tensors)
        for members, handle in handles:
            flat = handle.wait()
            offset = 0
            for i in members:
                wire, cctx = compressed[i]
                part = flat[offset: offset + wire.numel()].view(wire.shape)
                offset += wire.numel()
                value = around.decompress(part, cctx)
                if in_place:
                    with torch.no_grad():
                        tensors[i].copy_(value)
                    value = tensors[i]
                results[i] = value
        return results

    return Handle(future, finish, parts=[handle for _, handle in handles])


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: ops.ReduceOp, name: str | None, prescale: float, postscale: float,
                compression: type[Compressor] | Compressor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, prescale, postscale)
        return tuple(_grouped_start(tensors, op=op, name=name, compression=compression, prescale_factor=prescale,
                                    postscale_factor=postscale, in_place=False).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        # As allreduce's: the gradient of a reduction is the same reduction of the gradients.
        op, prescale, postscale = ctx.args
        reduced = _grouped_start(grads, op=op, name=None, compression=Compression.none, prescale_factor=prescale,
                                 postscale_factor=postscale, in_place=False).wait()
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] | Compressor = Compression.none,
                      op: ops.ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: object = None) -> list[torch.Tensor]:
    """Reduces a list of tensors as one fused collective per dtype; returns new tensors
    (differentiable, as allreduce)."""
    basics.check_process_set(process_set)
    reduce_op = ops.resolve(op, average)
    return list(_GroupedAllreduce.apply(reduce_op, name, prescale_factor, postscale_factor, compression, *tensors))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ops.ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: object = None, *,
                            compression: type[Compressor] | Compressor = Compression.none,
                            ) -> Handle[list[torch.Tensor]]:
    """Starts grouped_allreduce() and returns its handle."""
    basics.check_process_set(process_set)
    return _grouped_start(tensors, op=ops.resolve(op, average), name=name, compression=compression,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor, in_place=False)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: ops.ReduceOp | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: object = None) -> list[torch.Tensor]:
    """Reduces a list of tensors in place; returns them."""
    return grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                    process_set).wait()


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ops.ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: object = None) -> Handle[list[torch.Tensor]]:
    """Starts grouped_allreduce_() and returns its handle."""
    basics.check_process_set(process_set)
    return _grouped_start(tensors, op=ops.resolve(op, average), name=name, compression=Compression.none,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor, in_place=True)
