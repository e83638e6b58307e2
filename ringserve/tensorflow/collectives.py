"""Collectives on tf.Tensor, with Horovod's signatures: ``hvd.allreduce``, ``allgather``, ...

Each works eagerly and inside a ``tf.function`` (see _host.py). ``allreduce`` is differentiable
(the gradient of an average over the ranks is the average of the ranks' gradients), and reduces a
``tf.IndexedSlices`` (an embedding's gradient) as Horovod does: by gathering every rank's indices
and values, so that it stays sparse.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ringserve import api, bindings, bridge
from ringserve.bindings import Average, Compression, ReduceOp, Sum, process_set_of
from ringserve.errors import InvalidArgumentError
from ringserve.tensorflow._host import host_call
from ringserve.worker.ops.process_sets import ProcessSet


def _set_size(ps: ProcessSet | None) -> int:
    return api.size() if ps is None else len(ps.ranks)


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression: object = Compression.none, op: ReduceOp | str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
              process_set: object = None) -> Any:
    """The reduction of every rank's ``tensor`` (the average by default), as a tensor of its shape.

    Args:
        tensor: a tf.Tensor (or variable, or array), or a tf.IndexedSlices.
        average: Horovod's deprecated flag (False means Sum); use ``op``.
        device_dense, device_sparse: accepted for Horovod's signature (reductions run on the host).
        compression: Compression.none, fp16, bf16 or int8: how floating point values travel.
        op: Average (default), Sum, Min, Max or Product (IndexedSlices: Average or Sum).
        prescale_factor, postscale_factor: multiply before and after the reduction.
        name: the collective's name.
        process_set: reduce over this registered set's members only.
    """
    reduce_op = bindings.resolve_op(op, average)
    ps = process_set_of(process_set)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, reduce_op, name, ps)
    return _dense_allreduce(tf.convert_to_tensor(tensor), reduce_op, name or "ringserve.tf.allreduce",
                            compression, float(prescale_factor), float(postscale_factor), ps)


def _dense_allreduce(tensor: tf.Tensor, op: ReduceOp, name: str, compression: object, prescale: float,
                     postscale: float, ps: ProcessSet | None) -> tf.Tensor:
    run = bridge.allreduce(op=op, name=name, compression=compression, process_set=ps, prescale_factor=prescale,
                           postscale_factor=postscale)
    if op not in (Average, Sum) or not tensor.dtype.is_floating:
        return host_call(run, [tensor])[0]

    @tf.custom_gradient
    def reduce(x: tf.Tensor) -> tuple[tf.Tensor, Any]:
        def grad(upstream: tf.Tensor) -> tf.Tensor:
            # d(sum or average over ranks)/dx is the same reduction of the upstream gradients.
            return _dense_allreduce(upstream, op, f"{name}.grad", compression, prescale, postscale, ps)

        return host_call(run, [x])[0], grad

    return reduce(tensor)


def _sparse_allreduce(slices: tf.IndexedSlices, op: ReduceOp, name: str | None,
                      ps: ProcessSet | None) -> tf.IndexedSlices:
    if op not in (Average, Sum):
        raise InvalidArgumentError(f"A tf.IndexedSlices is reduced with Average or Sum, not {op!r}.")
    values = allgather(slices.values, name=f"{name or 'ringserve.tf.sparse'}.values", process_set=ps)
    indices = allgather(slices.indices, name=f"{name or 'ringserve.tf.sparse'}.indices", process_set=ps)
    if op is Average:
        values = values / tf.cast(_set_size(ps), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def grouped_allreduce(tensors: list[Any], average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression: object = Compression.none,
                      op: ReduceOp | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, process_set: object = None) -> list[tf.Tensor]:
    """Reduces every tensor of the list in one collective per dtype (one ring pass for all)."""
    run = bridge.allreduce(op=bindings.resolve_op(op, average), name=name or "ringserve.tf.grouped_allreduce",
                           compression=compression, process_set=process_set_of(process_set),
                           prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return host_call(run, tensors)


def allgather(tensor: Any, name: str | None = None, process_set: object = None) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along the first axis, in rank order (the ranks' tensors
    may differ in that axis only)."""
    value = tf.convert_to_tensor(tensor)
    run = bridge.allgather(name=name, process_set=process_set_of(process_set))
    out = host_call(run, [value], same_shapes=False)[0]
    if not tf.executing_eagerly():
        out.set_shape(tf.TensorShape([None]).concatenate(value.shape[1:]))
    return out


def broadcast(tensor: Any, root_rank: int, name: str | None = None, process_set: object = None) -> tf.Tensor:
    """``root_rank``'s ``tensor`` on every rank, bit for bit."""
    run = bridge.broadcast(root_rank=root_rank, name=name, process_set=process_set_of(process_set))
    return host_call(run, [tensor])[0]


def reducescatter(tensor: Any, device_dense: str = "", compression: object = Compression.none,
                  op: ReduceOp | str | None = Average, name: str | None = None, process_set: object = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """This rank's block, along the first axis, of the reduction of every rank's ``tensor`` (blocks
    split the first axis as evenly as it goes, the first ranks taking one row more)."""
    value = tf.convert_to_tensor(tensor)
    run = bridge.reducescatter(op=bindings.resolve_op(op), name=name, process_set=process_set_of(process_set),
                               compression=compression, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor)
    out = host_call(run, [value], same_shapes=False)[0]
    if not tf.executing_eagerly():
        out.set_shape(tf.TensorShape([None]).concatenate(value.shape[1:]))
    return out


def broadcast_object(obj: object, root_rank: int = 0, session: object = None, name: str | None = None,
                     process_set: object = None) -> object:
    """``root_rank``'s picklable object on every rank (eager only)."""
    return api.broadcast_object(obj, root=root_rank, name=name, process_set=process_set_of(process_set))


def allgather_object(obj: object, session: object = None, name: str | None = None,
                     process_set: object = None) -> list[object]:
    """Every rank's picklable object, in rank order (eager only)."""
    return api.allgather_object(obj, name=name, process_set=process_set_of(process_set))


def barrier(process_set: object = None) -> None:
    """Returns once every rank (of the set) has called it."""
    api.barrier(process_set=process_set_of(process_set))
