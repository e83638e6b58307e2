"""Backend tensors to numpy and back, on Keras 3's TensorFlow and torch backends.

Collectives run on numpy arrays (ringserve.api). On the torch backend Keras runs eagerly, and a
tensor becomes an array with one copy (``keras.ops.convert_to_numpy``). On the TensorFlow backend
``model.fit`` traces the train step into a graph, where a tensor has no value yet: the collective
then runs as a graph op through ``tf.numpy_function``, which hands the op's inputs to Python as
numpy arrays when the graph runs (one copy each way, and the Python call holds the GIL; the cost
is measured in docs/guide/tensorflow.md). ``numpy_function`` rather than ``py_function``: it skips
the EagerTensor wrappers, and ``stateful=True`` keeps the graph from pruning or reordering it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from ringserve import graph_ops
from ringserve.errors import UnsupportedError

HostFn = Callable[[list[np.ndarray]], list[np.ndarray]]


def name() -> str:
    """The Keras backend in use ("tensorflow", "torch", ...)."""
    return str(keras.backend.backend())


def check_supported() -> None:
    """Raises UnsupportedError on a backend other than TensorFlow and torch."""
    if name() not in ("tensorflow", "torch"):
        raise UnsupportedError(
            f"ringserve.keras runs on Keras's tensorflow and torch backends, not on {name()!r}: "
            "set KERAS_BACKEND=torch or KERAS_BACKEND=tensorflow before importing keras.")


def to_numpy(value: Any) -> np.ndarray:
    """An eager tensor, variable or array as a numpy array."""
    return np.asarray(keras.ops.convert_to_numpy(value))


def host_call(fn: HostFn, tensors: Sequence[Any], out_dtypes: Sequence[Any] | None = None,
              same_shapes: bool = True) -> list[Any]:
    """Runs ``fn`` on the tensors' values as numpy arrays and returns its arrays as backend tensors,
    eagerly or (TensorFlow) as an op of the graph being traced.

    Args:
        fn: takes one array per tensor, returns arrays of ``out_dtypes`` (default: the inputs').
        tensors: backend tensors (or arrays, or variables).
        out_dtypes: the dtypes fn returns, when they differ from the inputs'.
        same_shapes: fn returns arrays of the inputs' shapes (so graph tensors keep known shapes).
    """
    check_supported()
    if not tensors:
        return []
    if name() == "tensorflow":
        import tensorflow as tf

        inputs = [tf.convert_to_tensor(t) for t in tensors]
        tout = list(out_dtypes) if out_dtypes is not None else [t.dtype for t in inputs]
        return graph_ops.numpy_op(fn, inputs, tout, same_shapes)
    arrays = [to_numpy(t) for t in tensors]
    return [keras.ops.convert_to_tensor(a) for a in fn(arrays)]
