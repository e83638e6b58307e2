"""Grouped collectives with Horovod's names and arguments: a list of tensors as one fused collective.

- ``grouped_allreduce`` (its in-place and async forms): one allreduce per wire dtype and device;
- ``grouped_allgather``: one allgather for the whole list, whatever its dtypes;
- ``grouped_reducescatter``: one reduce-scatter per dtype.

All three are differentiable, with Horovod's gradients: a grouped allreduce of the gradients, the
averaged gradients narrowed to this rank's rows, and the scaled gradients gathered.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ringserve import api
from ringserve.torch import _tensors, basics, ops
from ringserve.torch.compression import Compression, Compressor, split, wire_codec
from ringserve.torch.handles import Handle, claim_name
from ringserve.torch.starts import allreduce_start, rescale, scaled
from ringserve.worker.ops.process_sets import ProcessSet


def _grouped_start(
    tensors: Sequence[torch.Tensor], *, op: ops.ReduceOp, name: str | None,
    compression: type[Compressor] | Compressor, prescale_factor: float, postscale_factor: float,
    in_place: bool, process_set: ProcessSet | None = None,
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
        # Adasum: each tensor keeps its own coefficients, as Horovod's fused Adasum does.
        parts = [compressed[i][0].numel() for i in members] if op is ops.Adasum else None
        handles.append((members, allreduce_start(
            flat, op=op, name=part_name, compression=on_wire, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, out=None, parts=parts, process_set=process_set)))
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
                compression: type[Compressor] | Compressor, process_set: ProcessSet | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(_grouped_start(tensors, op=op, name=name, compression=compression, prescale_factor=prescale,
                                    postscale_factor=postscale, in_place=False, process_set=process_set).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        # As allreduce's: the gradient of a reduction is the same reduction of the gradients.
        op, prescale, postscale, process_set = ctx.args
        reduced = _grouped_start(grads, op=op, name=None, compression=Compression.none, prescale_factor=prescale,
                                 postscale_factor=postscale, in_place=False, process_set=process_set).wait()
        return (None, None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] | Compressor = Compression.none,
                      op: ops.ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: object = None) -> list[torch.Tensor]:
    """Reduces a list of tensors as one fused collective per dtype; returns new tensors
    (differentiable, as allreduce); over ``process_set``'s members only, when one is given."""
    ps = basics.resolve_set(process_set)
    reduce_op = ops.resolve(op, average)
    return list(_GroupedAllreduce.apply(reduce_op, name, prescale_factor, postscale_factor, compression, ps,
                                        *tensors))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ops.ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: object = None, *,
                            compression: type[Compressor] | Compressor = Compression.none,
                            ) -> Handle[list[torch.Tensor]]:
    """Starts grouped_allreduce() and returns its handle."""
    ps = basics.resolve_set(process_set)
    return _grouped_start(tensors, op=ops.resolve(op, average), name=name, compression=compression,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor, in_place=False,
                          process_set=ps)


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
    ps = basics.resolve_set(process_set)
    return _grouped_start(tensors, op=ops.resolve(op, average), name=name, compression=Compression.none,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor, in_place=True,
                          process_set=ps)


# -- grouped allgather and reducescatter ------------------------------------------------------

def _grouped_allgather_start(tensors: Sequence[torch.Tensor], name: str | None,
                             process_set: ProcessSet | None = None) -> Handle[list[torch.Tensor]]:
    """One collective for the whole list (see ringserve.worker.ops.grouped), any mix of dtypes."""
    with basics.named_call(claim_name("grouped_allgather", name)) as call:
        pairs = [_tensors.raw(t) if t.dim() else (t.detach().cpu().numpy(), None) for t in tensors]
        arrays = [a for a, _ in pairs]
        future = call.submit(lambda w: w.grouped_allgather(arrays, name=name, process_set=process_set))

    def finish(results: list[np.ndarray]) -> list[torch.Tensor]:
        return [_tensors.restore(r, layout, rows=r.shape[0]) for r, (_, layout) in zip(results, pairs, strict=True)
                if layout is not None]

    return Handle(future, finish, claim=call.claim)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows = [t.shape[0] for t in tensors]
        ctx.process_set = process_set
        return tuple(_grouped_allgather_start(tensors, name, process_set).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        # Horovod's: the gradients averaged over the ranks, then this rank's rows of each.
        ps = ctx.process_set
        reduced = _grouped_start(grads, op=ops.Average, name=None, compression=Compression.none,
                                 prescale_factor=1.0, postscale_factor=1.0, in_place=False, process_set=ps).wait()
        rows = api.allgather(np.array([ctx.rows], dtype=np.int64), process_set=ps)  # (ranks, tensors)
        offsets = rows[: basics.set_rank(ps)].sum(axis=0).tolist()
        return (None, None, *(g.narrow(0, int(at), n) for g, at, n in zip(reduced, offsets, ctx.rows, strict=True)))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: object = basics.global_process_set) -> list[torch.Tensor]:
    """allgather() of each tensor of a list, in one collective (differentiable).

    Each tensor's dimension 0 may differ between ranks; the other dimensions and the dtypes match.
    """
    return list(_GroupedAllgather.apply(name, basics.resolve_set(process_set), *tensors))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: object = basics.global_process_set) -> Handle[list[torch.Tensor]]:
    """Starts grouped_allgather() and returns its handle."""
    return _grouped_allgather_start(tensors, name, basics.resolve_set(process_set))


def _grouped_reducescatter_start(
    tensors: Sequence[torch.Tensor], *, name: str | None, op: ops.ReduceOp,
    compression: type[Compressor] | Compressor, prescale_factor: float, postscale_factor: float,
    process_set: ProcessSet | None = None,
) -> Handle[list[torch.Tensor]]:
    """One fused reduce-scatter per wire dtype (see ringserve.worker.ops.grouped)."""
    core = ops.core_op(op, "grouped_reducescatter")
    with basics.named_call(claim_name("grouped_reducescatter", name)) as call:
        around, codec = split(compression)
        compressed = [around.compress(scaled(t.detach(), prescale_factor)) for t in tensors]
        pairs = [_tensors.reducible(w) if w.dim() else (w.cpu().numpy(), None) for w, _ in compressed]
        arrays = [a for a, _ in pairs]
        wire = [wire_codec(codec, w.dtype, a.dtype.kind) for (w, _), a in zip(compressed, arrays, strict=True)]
        future = call.submit(lambda w: w.grouped_reduce_scatter(arrays, op=core, name=name, compression=wire,
                                                                process_set=process_set))

    def finish(results: list[np.ndarray]) -> list[torch.Tensor]:
        out = []
        for r, (_, layout), (_, cctx) in zip(results, pairs, compressed, strict=True):
            assert layout is not None
            part = _tensors.restore(r, layout, rows=r.shape[0])
            out.append(rescale(around.decompress(part, cctx), postscale_factor))
        return out

    return Handle(future, finish, claim=call.claim)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: ops.ReduceOp, prescale: float, postscale: float,
                compression: type[Compressor] | Compressor, process_set: ProcessSet | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.scale = (basics.set_size(process_set) if op is ops.Sum else 1.0) * prescale * postscale
        ctx.process_set = process_set
        return tuple(_grouped_reducescatter_start(tensors, name=name, op=op, compression=compression,
                                                  prescale_factor=prescale, postscale_factor=postscale,
                                                  process_set=process_set).wait())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        # Horovod's, as reducescatter's: every rank's rows of each gradient gathered, scaled by the
        # world size for Sum and by the pre- and postscale factors.
        scaled = [g * ctx.scale if ctx.scale != 1.0 else g for g in grads]
        return (None, None, None, None, None, None, *_grouped_allgather_start(scaled, None, ctx.process_set).wait())


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] | Compressor = Compression.none,
                          op: ops.ReduceOp | None = None, process_set: object = basics.global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """reducescatter() of each tensor of a list, fused into one collective per dtype (differentiable).

    Returns this rank's rows of each reduced tensor (the first ranks get one row more, as Horovod).
    """
    return list(_GroupedReducescatter.apply(name, ops.resolve(op), prescale_factor, postscale_factor,
                                            compression, basics.resolve_set(process_set), *tensors))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ops.ReduceOp | None = None, process_set: object = basics.global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0, *,
                                compression: type[Compressor] | Compressor = Compression.none,
                                ) -> Handle[list[torch.Tensor]]:
    """Starts grouped_reducescatter() and returns its handle."""
    return _grouped_reducescatter_start(tensors, name=name, op=ops.resolve(op), compression=compression,
                                        prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                                        process_set=basics.resolve_set(process_set))
