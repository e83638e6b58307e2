"""Ringserve's collectives as TensorFlow graph ops, and their errors, for the Keras and TensorFlow
bindings.

``numpy_op`` runs a function of numpy arrays as an op of the graph being traced (``tf.numpy_function``).
Inside ``tf.function`` (and so inside Keras's ``model.fit`` on the TensorFlow backend) a collective
runs as a ``tf.numpy_function`` op. When it raises, TensorFlow reports the error as one of its own
(``tf.errors.UnknownError``, with the Python traceback as text), and the ringserve error's class is
lost: ``ringserve.elastic.run`` would not see that a rank died, and would end the worker instead of
going back to the last commit. Horovod maps TensorFlow's error back by reading its message.

Here the function run as the op keeps the error it raised (``carry``), and the elastic wrapper
(``run``) raises that error again when the framework's error reports it (``raised_in_graph``).

TensorFlow is imported by ``numpy_op`` only: this module is part of the framework-free binding core.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from ringserve.elastic import run as elastic_run
from ringserve.errors import RingserveError

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.Lock()
_carried: list[RingserveError] = []  # the last ringserve error raised inside a graph op, if any


def numpy_op(fn: Callable[[list[np.ndarray]], list[np.ndarray]], inputs: Sequence[Any], tout: Sequence[Any],
             same_shapes: bool) -> list[Any]:
    """``fn`` as a stateful op of the TensorFlow graph being traced: it gets the inputs' values as
    numpy arrays when the graph runs, and its arrays become the op's outputs (of dtypes ``tout``).
    ``stateful=True`` keeps the graph from pruning or reordering it; a ringserve error it raises is
    kept for ``raised_in_graph``.

    Args:
        fn: one array per input in, one array per dtype of ``tout`` out.
        inputs: tf.Tensors of the graph.
        tout: the outputs' dtypes.
        same_shapes: the outputs have the inputs' static shapes.
    """
    import tensorflow as tf

    outputs = tf.numpy_function(carry(lambda *xs: fn(list(xs))), list(inputs), Tout=list(tout), stateful=True)
    outputs = list(outputs) if isinstance(outputs, list | tuple) else [outputs]
    if same_shapes:
        for out, given in zip(outputs, inputs, strict=True):
            out.set_shape(given.shape)
    return outputs


def carry(fn: F) -> F:
    """``fn``, keeping the ringserve error it raises for ``raised_in_graph`` (it still raises it)."""

    @functools.wraps(fn)
    def kept(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RingserveError as exc:
            with _lock:
                _carried[:] = [exc]
            raise

    return kept  # type: ignore[return-value]


def raised_in_graph(error: BaseException) -> RingserveError | None:
    """The ringserve error that a graph op raised and the framework reported as ``error``: the
    last one kept by ``carry``, if ``error``'s text names its class. It is taken (returned once)."""
    with _lock:
        carried = _carried.pop() if _carried else None
    if carried is None or isinstance(error, RingserveError):
        return None
    return carried if type(carried).__name__ in str(error) else None


def translate(func: F) -> F:
    """``func``, raising the ringserve error a framework error reports (see ``raised_in_graph``) in
    place of the framework's error."""

    @functools.wraps(func)
    def translated(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            original = raised_in_graph(exc)
            if original is None:
                raise
            raise original from exc

    return translated  # type: ignore[return-value]


def run(func: F) -> F:
    """``ringserve.elastic.run`` for code whose collectives may run as graph ops: a framework error
    that reports a ringserve error (a rank died, the ring changed) is raised as that error, so that
    the wrapper recovers from it as it does in eager code."""
    return elastic_run(translate(func))
