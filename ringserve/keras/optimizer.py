"""DistributedOptimizer for Keras 3: averages gradients across ranks inside ``model.fit``.

Keras 3's trainers end every train step with one call, ``optimizer.apply(gradients, variables)``
(the torch backend's after ``loss.backward()``, the TensorFlow backend's inside the traced step).
``DistributedOptimizer`` is an optimizer that wraps another, as Keras's own ``LossScaleOptimizer``
does: its ``apply`` averages the gradients over every rank, in one fused allreduce per dtype, then
hands them to the wrapped optimizer. No class is made at run time; the wrapped optimizer keeps its
variables, learning rate and iteration count, and ``optimizer.learning_rate``,
``optimizer.iterations`` and ``optimizer.variables`` reach them.

``backward_passes_per_step=N``: gradients are added up locally over N train steps, then reduced
once and applied once (the other steps apply nothing, and ``iterations`` counts applied steps, as
in Horovod). The sum is kept in host memory beside the reduction, so the skipped steps cost one
addition and no communication.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from ringserve import bindings
from ringserve.bindings import Average, Compression, ReduceOp, Sum
from ringserve.errors import InvalidArgumentError
from ringserve.keras import _backend
from ringserve.worker.ops.process_sets import ProcessSet, WholeWorld

# The name of the gradient reduction (one collective per dtype: ".float32" and so on is added).
GRADIENTS = "ringserve.keras.gradients"


@keras.saving.register_keras_serializable(package="ringserve")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras 3 optimizer so that every applied step uses gradients averaged over all ranks.

    Args:
        optimizer: any ``keras.optimizers.Optimizer`` (SGD, Adam, ...), not built yet or built.
        name: the wrapper's name; by default the wrapped optimizer's, prefixed "Distributed".
        compression: Compression.none (default), fp16, bf16 or int8: how gradients travel (sums are
            added in float32).
        sparse_as_dense: accepted for Horovod's signature; Keras 3 gradients are always reduced as
            dense tensors (an embedding's ``IndexedSlices`` are densified).
        gradient_predivide_factor: with Average, divide by this before the sum and by
            size / factor after it.
        op: Average (default) or Sum.
        backward_passes_per_step: train steps whose gradients are added up locally before one
            reduction and one applied step.
        average_aggregated_gradients: with backward_passes_per_step > 1, divide the local sum by the
            number of passes (Horovod's default is False: the sum).
        process_set: average over this registered set's members only.

    Example:
        ```python
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        ```
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        name: str | None = None,
        device_dense: str = "",
        device_sparse: str = "",
        compression: object = Compression.none,
        sparse_as_dense: bool = False,
        gradient_predivide_factor: float = 1.0,
        op: ReduceOp | str = Average,
        backward_passes_per_step: int = 1,
        average_aggregated_gradients: bool = False,
        process_set: object = None,
    ) -> None:
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise InvalidArgumentError(
                f"DistributedOptimizer wraps a keras.optimizers.Optimizer, not {optimizer!r} "
                "(legacy Keras 2 and tf.compat.v1 optimizers are not Keras 3 optimizers).")
        if isinstance(optimizer, DistributedOptimizer):
            raise InvalidArgumentError("The optimizer is a DistributedOptimizer already: wrap it once.")
        reduce_op = bindings.resolve_op(op)
        if reduce_op not in (Average, Sum):
            raise InvalidArgumentError(f"DistributedOptimizer reduces with Average or Sum, not {reduce_op!r}.")
        if gradient_predivide_factor <= 0:
            raise InvalidArgumentError(
                f"gradient_predivide_factor ({gradient_predivide_factor}) must be greater than zero.")
        if gradient_predivide_factor != 1.0 and reduce_op is not Average:
            raise InvalidArgumentError("gradient_predivide_factor needs op=Average.")
        if int(backward_passes_per_step) != backward_passes_per_step or backward_passes_per_step < 1:
            raise InvalidArgumentError(
                f"backward_passes_per_step ({backward_passes_per_step}) must be a whole number of at least 1.")
        bindings.wire_of(compression)  # raises for an unknown one
        _backend.check_supported()
        super().__init__(learning_rate=0.0, name=name or f"Distributed{optimizer.name}")
        self.inner_optimizer = optimizer
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = reduce_op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = average_aggregated_gradients
        if process_set is not None and not isinstance(process_set, ProcessSet):
            raise InvalidArgumentError(f"process_set must be a ProcessSet (or None), not {process_set!r}.")
        self.process_set = None if isinstance(process_set, WholeWorld) else process_set
        self._member = self.process_set is None or bool(self.process_set.included())
        self._sums: list[np.ndarray] | None = None
        self._passes = 0
        self.reductions = 0  # how many gradient reductions this rank has run (for tests and logs)

    # -- the wrapped optimizer's state, reached through the wrapper ---------------------------------

    def build(self, var_list: list[Any]) -> None:
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self) -> list[Any]:
        return list(self._variables) + list(self.inner_optimizer.variables)

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Any:
        return self.inner_optimizer.iterations

    def scale_loss(self, loss: Any) -> Any:
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list: list[Any]) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def reset(self) -> None:
        """Drops gradients added up locally but not yet reduced (elastic restore calls it)."""
        self._sums = None
        self._passes = 0

    # -- the step ------------------------------------------------------------------------------

    def apply(self, grads: list[Any], trainable_variables: list[Any] | None = None) -> None:
        """Reduces ``grads`` over the ranks (every backward_passes_per_step calls), then applies them."""
        variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
        if not getattr(self, "built", False):
            self.build(variables)
        grads = [keras.ops.zeros_like(v) if g is None else g for g, v in zip(grads, variables, strict=True)]
        if not grads:
            return
        dtypes = [keras.backend.standardize_dtype(v.dtype) for v in variables]
        results = _backend.host_call(self._reduce, grads, out_dtypes=[*dtypes, "int32"], same_shapes=False)
        reduced = [keras.ops.reshape(r, v.shape) for r, v in zip(results[:-1], variables, strict=True)]
        if self.backward_passes_per_step == 1:
            self.inner_optimizer.apply(reduced, variables)
        elif _backend.name() == "torch":
            if int(keras.ops.convert_to_numpy(results[-1])):
                self.inner_optimizer.apply(reduced, variables)
        else:
            keras.ops.cond(keras.ops.equal(keras.ops.reshape(results[-1], ()), 1),
                           lambda: self.inner_optimizer.apply(reduced, variables), lambda: None)

    def _reduce(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Host side of apply: adds this pass's gradients up, and every backward_passes_per_step
        passes reduces them; returns the gradients to apply and 1 (apply) or 0 (skip)."""
        if self.backward_passes_per_step > 1:
            self._sums = [a.copy() for a in arrays] if self._sums is None else [
                np.add(s, a, out=s) for s, a in zip(self._sums, arrays, strict=True)]
            self._passes += 1
            if self._passes < self.backward_passes_per_step:
                return [np.zeros_like(a) for a in arrays] + [np.array(0, dtype=np.int32)]
            arrays = self._sums
            if self.average_aggregated_gradients:
                arrays = [(a / self.backward_passes_per_step).astype(a.dtype, copy=False) for a in arrays]
            self.reset()
        if not self._member:
            return [*arrays, np.array(1, dtype=np.int32)]
        self.reductions += 1
        if self.op is Average and self.gradient_predivide_factor != 1.0:
            size = bindings.size() if self.process_set is None else len(self.process_set.ranks)
            reduced = bindings.fused_allreduce(
                arrays, op=Sum, name=GRADIENTS, compression=self.compression,
                prescale_factor=1.0 / self.gradient_predivide_factor,
                postscale_factor=self.gradient_predivide_factor / size, process_set=self.process_set)
        else:
            reduced = bindings.fused_allreduce(arrays, op=self.op, name=GRADIENTS, compression=self.compression,
                                               process_set=self.process_set)
        return [*reduced, np.array(1, dtype=np.int32)]

    # -- saving ----------------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "compression": bindings.wire_of(self.compression),
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "op": self.op.value,
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None) -> DistributedOptimizer:
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"), custom_objects=custom_objects)
        wire = config.pop("compression", None)
        compression = getattr(Compression, wire) if wire else Compression.none
        return cls(inner, compression=compression, **config)
