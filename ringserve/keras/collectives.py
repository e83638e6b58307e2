"""Collectives on Keras backend tensors: ``hvd.allreduce``, ``allgather``, ``broadcast``, ...

Each takes a backend tensor (a ``tf.Tensor`` or a ``torch.Tensor``), a variable or an array, and
returns a backend tensor. They work eagerly and, on the TensorFlow backend, inside a traced
function (see ringserve/keras/_backend.py for how, and at what cost).
"""

from __future__ import annotations

from typing import Any

from ringserve import api, bindings, bridge
from ringserve.bindings import Average, Compression, ReduceOp, process_set_of
from ringserve.keras import _backend


def allreduce(value: Any, name: str | None = None, average: bool | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: ReduceOp | str | None = None,
              compression: object = Compression.none, process_set: object = None) -> Any:
    """Reduces ``value`` over every rank (Horovod's ``hvd.allreduce``); the average by default.

    Args:
        value: a backend tensor, variable or array; every rank passes one of the same shape and dtype.
        name: the collective's name (ranks must call same-named collectives in the same order).
        average: deprecated Horovod flag (False means Sum); use ``op``.
        prescale_factor, postscale_factor: multiply before and after the reduction.
        op: Average (default), Sum, Min, Max or Product.
        compression: Compression.none, fp16, bf16 or int8 (how floating point values travel).
        process_set: reduce over this registered set's members only.

    Returns:
        A backend tensor of value's shape and dtype.
    """
    run = bridge.allreduce(op=bindings.resolve_op(op, average), name=name or "ringserve.keras.allreduce",
                           compression=compression, process_set=process_set_of(process_set),
                           prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return _backend.host_call(run, [value])[0]


def grouped_allreduce(values: list[Any], name: str | None = None, op: ReduceOp | str | None = Average,
                      compression: object = Compression.none, process_set: object = None) -> list[Any]:
    """Reduces every tensor of ``values`` in one collective per dtype; returns backend tensors."""
    run = bridge.allreduce(op=bindings.resolve_op(op), name=name or "ringserve.keras.grouped_allreduce",
                           compression=compression, process_set=process_set_of(process_set))
    return _backend.host_call(run, values)


def allgather(value: Any, name: str | None = None, process_set: object = None) -> Any:
    """Every rank's ``value`` concatenated along the first axis, in rank order (ranks may differ in
    that axis only)."""
    run = bridge.allgather(name=name, process_set=process_set_of(process_set))
    return _backend.host_call(run, [value], same_shapes=False)[0]


def broadcast(value: Any, root_rank: int, name: str | None = None, process_set: object = None) -> Any:
    """``root_rank``'s ``value`` on every rank, bit for bit."""
    run = bridge.broadcast(root_rank=root_rank, name=name, process_set=process_set_of(process_set))
    return _backend.host_call(run, [value])[0]


def reducescatter(value: Any, name: str | None = None, op: ReduceOp | str | None = Average,
                  process_set: object = None) -> Any:
    """This rank's block (along the first axis) of the reduction of every rank's ``value``."""
    run = bridge.reducescatter(op=bindings.resolve_op(op), name=name, process_set=process_set_of(process_set))
    return _backend.host_call(run, [value], same_shapes=False)[0]


def broadcast_object(obj: object, root_rank: int = 0, name: str | None = None, process_set: object = None) -> object:
    """``root_rank``'s picklable object on every rank."""
    return api.broadcast_object(obj, root=root_rank, name=name, process_set=process_set_of(process_set))


def allgather_object(obj: object, name: str | None = None, process_set: object = None) -> list[object]:
    """Every rank's picklable object, in rank order."""
    return api.allgather_object(obj, name=name, process_set=process_set_of(process_set))


def barrier(process_set: object = None) -> None:
    """Returns once every rank (of the set) has called it."""
    api.barrier(process_set=process_set_of(process_set))
