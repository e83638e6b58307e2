"""Running a numpy collective on tf.Tensors, eagerly or as an op of a traced graph.

Eagerly (``tf.executing_eagerly()``), the tensors' values are read with ``.numpy()`` and the results
wrapped with ``tf.convert_to_tensor``: one copy each way, as the torch binding pays. Inside a
``tf.function`` a tensor has no value while the graph is traced, so the collective becomes a graph op
through ``tf.numpy_function``: when the graph runs, TensorFlow hands the op's inputs to Python as
numpy arrays (no copy for CPU tensors), runs the collective while holding the GIL for the Python
part only (the ring's reductions and socket I/O release it), and copies the results back into
tensors. ``stateful=True`` keeps the graph from pruning or reordering the op. The measured cost of
that bridge is in docs/guide/tensorflow.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from ringserve import graph_ops

HostFn = Callable[[list[np.ndarray]], list[np.ndarray]]


def host_call(fn: HostFn, tensors: Sequence[Any], *, out_dtypes: Sequence[tf.DType] | None = None,
              same_shapes: bool = True) -> list[tf.Tensor]:
    """``fn`` on the tensors' values as numpy arrays; its arrays back as tensors (eager or traced).

    Args:
        fn: one array per tensor in, arrays of ``out_dtypes`` (default: the inputs') out.
        tensors: tf.Tensors, variables or arrays.
        out_dtypes: the dtypes of fn's results when they differ from the inputs'.
        same_shapes: fn's results have the inputs' shapes (traced tensors keep their static shapes).
    """
    if not tensors:
        return []
    inputs = [tf.convert_to_tensor(t) for t in tensors]
    tout = list(out_dtypes) if out_dtypes is not None else [t.dtype for t in inputs]
    if tf.executing_eagerly():
        results = fn([t.numpy() for t in inputs])
        return [tf.convert_to_tensor(r, dtype=d) for r, d in zip(results, tout, strict=True)]
    return graph_ops.numpy_op(fn, inputs, tout, same_shapes)
