"""The numpy side of the Keras and TensorFlow collectives: one function per collective, from the
host arrays a binding hands over to the arrays it gets back.

Both bindings run a collective the same way: they copy their tensors to host arrays (eagerly, or
inside a traced function through a host call: keras/_backend.py, tensorflow/_host.py), call a
function of ``list[np.ndarray] -> list[np.ndarray]``, and make tensors of what it returns. Those
functions are made here, once, with the binding's arguments bound (``HostRun``); the bindings keep
only what is theirs (tensor conversion, gradients, static shapes, IndexedSlices).

Example:
    ```python
    run = bridge.allreduce(op=Average, name="grad", compression=Compression.none, process_set=None)
    out = run([np.ones(4, np.float32)])
    ```
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ringserve import api
from ringserve.bindings import ReduceOp, fused_allreduce, wire_of
from ringserve.worker.ops.process_sets import ProcessSet

HostRun = Callable[[list[np.ndarray]], list[np.ndarray]]


def allreduce(*, op: ReduceOp, name: str, compression: object, process_set: ProcessSet | None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> HostRun:
    """Every array reduced across the ranks, in one allreduce per dtype (bindings.fused_allreduce)."""

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return fused_allreduce(arrays, op=op, name=name, compression=compression, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, process_set=process_set)

    return run


def allgather(*, name: str | None, process_set: ProcessSet | None) -> HostRun:
    """The one array's rows from every rank, in rank order."""

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(api.allgather(arrays[0], name=name, process_set=process_set))]

    return run


def broadcast(*, root_rank: int, name: str | None, process_set: ProcessSet | None) -> HostRun:
    """The root's array on every rank."""

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.asarray(api.broadcast(arrays[0], root=root_rank, name=name, process_set=process_set))]

    return run


def reducescatter(*, op: ReduceOp, name: str | None, process_set: ProcessSet | None, compression: object = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> HostRun:
    """This rank's block (along the first axis) of the reduction; floating point values travel in
    the compression's codec; the factors multiply before and after (Horovod's)."""
    codec = wire_of(compression) if compression is not None else None

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        a = arrays[0] if prescale_factor == 1.0 else (arrays[0] * prescale_factor).astype(arrays[0].dtype)
        out = np.asarray(api.reduce_scatter(a, op=op.value, name=name, process_set=process_set,
                                            compression=codec if a.dtype.kind == "f" else None))
        return [out if postscale_factor == 1.0 else (out * postscale_factor).astype(out.dtype)]

    return run
