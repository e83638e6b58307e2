"""``DistributedGradientTape`` and ``broadcast_variables``: custom TensorFlow training loops.


```python
import ringserve.tensorflow as hvd

hvd.init()
opt = tf.keras.optimizers.SGD(0.01 * hvd.size())

@tf.function
def step(x, y, first):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss
```

The tape is wrapped, not subclassed at run time: ``gradient`` reduces what the wrapped tape
returns, and every other attribute is the wrapped tape's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from ringserve import bindings
from ringserve.bindings import Average, Compression, ReduceOp, Sum
from ringserve.errors import InvalidArgumentError
from ringserve.tensorflow import collectives
from ringserve.tensorflow._host import host_call

GRADIENTS = "ringserve.tf.gradients"


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients averaged over every rank.

    Args:
        gradtape: the tape that recorded the forward pass.
        device_dense, device_sparse: accepted for Horovod's signature.
        compression: Compression.none (default), fp16, bf16 or int8.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors (fused with the
            others); by default they are gathered and stay sparse, as in Horovod.
        op: Average (default) or Sum.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            size / factor after it.
        process_set: average over this registered set's members only.

    Dense gradients travel fused: one allreduce per dtype for the whole list.
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression: object = Compression.none, sparse_as_dense: bool = False,
                 op: ReduceOp | str = Average, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups: object = None, process_set: object = None) -> None:
        reduce_op = bindings.resolve_op(op)
        if reduce_op not in (Average, Sum):
            raise InvalidArgumentError(f"DistributedGradientTape reduces with Average or Sum, not {reduce_op!r}.")
        if gradient_predivide_factor <= 0:
            raise InvalidArgumentError(
                f"gradient_predivide_factor ({gradient_predivide_factor}) must be greater than zero.")
        if gradient_predivide_factor != 1.0 and reduce_op is not Average:
            raise InvalidArgumentError("gradient_predivide_factor needs op=Average.")
        bindings.wire_of(compression)
        self._tape = gradtape
        self._compression = compression
        self._sparse_as_dense = sparse_as_dense
        self._op = reduce_op
        self._predivide = float(gradient_predivide_factor)
        self._process_set = collectives.process_set_of(process_set)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_tape"], name)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: Any = tf.UnconnectedGradients.NONE) -> Any:
        """The wrapped tape's gradients, reduced over the ranks (same structure as ``sources``).

        A gradient that is None on this rank (a variable the loss does not reach) is reduced as
        zeros, so that every rank runs the same collective, and comes back as zeros.
        """
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads)
        variables = tf.nest.flatten(sources)
        reduced = self._reduce(flat, variables)
        return tf.nest.pack_sequence_as(grads, reduced)

    def _reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        out: list[Any] = list(grads)
        dense: list[int] = []
        for i, (g, v) in enumerate(zip(grads, variables, strict=True)):
            if g is None:
                out[i] = tf.zeros_like(v)
                dense.append(i)
            elif isinstance(g, tf.IndexedSlices) and not self._sparse_as_dense:
                out[i] = collectives.allreduce(g, op=self._op, name=f"{GRADIENTS}.sparse{i}",
                                               process_set=self._process_set)
            else:
                out[i] = tf.convert_to_tensor(g)
                dense.append(i)
        if dense:
            size = bindings.size() if self._process_set is None else len(self._process_set.ranks)
            op, pre, post = self._op, 1.0, 1.0
            if self._op is Average and self._predivide != 1.0:
                op, pre, post = Sum, 1.0 / self._predivide, self._predivide / size
            process_set = self._process_set

            def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
                return bindings.fused_allreduce(arrays, op=op, name=GRADIENTS, compression=self._compression,
                                                prescale_factor=pre, postscale_factor=post, process_set=process_set)

            for i, r in zip(dense, host_call(run, [out[i] for i in dense]), strict=True):
                out[i] = r
        return out


def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int, process_set: object = None) -> Any:
    """Overwrites every variable with ``root_rank``'s value, in one broadcast per dtype; eagerly, or as
    an op inside a ``tf.function`` (the returned op, for graph code that wants to depend on it).

    Raises:
        MismatchError: the ranks hold variables of different shapes or dtypes.
    """
    variables = list(variables)
    if not variables:
        return tf.no_op()
    ps = collectives.process_set_of(process_set)

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return bindings.fused_broadcast(arrays, root=root_rank, name="ringserve.tf.broadcast_variables",
                                        process_set=ps)

    values = host_call(run, [v.read_value() if hasattr(v, "read_value") else v for v in variables])
    return tf.group(*[v.assign(value) for v, value in zip(variables, values, strict=True)])
