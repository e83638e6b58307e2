"""What the Keras and TensorFlow bindings share: Horovod's names over the numpy API, with no framework.

``ringserve.keras`` and ``ringserve.tensorflow`` sit side by side on the core and never import each
other (nor ``ringserve.torch``). What both need lives here, framework-free:

- ``require(module, extra)``: a framework import that names the extra to install when it fails;
- the lifecycle and topology functions (``init``, ``rank``, ``size``, ...) and the ``*_built`` flags;
- the reduce ops (``Average``, ``Sum``, ...) and the compressions (``Compression.fp16``, ...);
- ``fused_allreduce`` and ``fused_broadcast``: many arrays in one collective per dtype, which is how
  gradients and model variables travel (one ring pass for a whole model instead of one per tensor).

Each binding turns its framework's tensors into numpy arrays and back; everything below that is here
or in the core.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from ringserve import api
from ringserve.errors import InvalidArgumentError, MissingExtraError, UnsupportedError
from ringserve.worker.ops.process_sets import ProcessSet, WholeWorld

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Compressor",
    "Max",
    "Min",
    "Product",
    "ReduceOp",
    "Sum",
    "cross_rank",
    "cross_size",
    "fused_allreduce",
    "fused_broadcast",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "process_set_of",
    "rank",
    "require",
    "shutdown",
    "size",
]


def require(module: str, extra: str) -> ModuleType:
    """Imports ``module``, or says which extra of ringserve installs it.

    Raises:
        MissingExtraError: (an ImportError) the module is not installed; the message names
            ``pip install ringserve[extra]``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"This part of ringserve needs {module}, which is not installed (or failed to import: {e}); "
            f"install it with `pip install ringserve[{extra}]`."
        ) from e


# -- lifecycle and topology ----------------------------------------------------------------------


def init(comm: object = None, process_sets: object = None, *, coordinator: str | None = None,
         **overrides: Any) -> None:
    """Joins the world (Horovod's ``hvd.init()``); blocks until the first view that includes us.

    Args:
        comm: Horovod's MPI communicator; must be None (ringserve does not use MPI).
        process_sets: a list of ``ProcessSet`` to register (every rank passes the same list), or
            "dynamic", or None.
        coordinator: host:port of the coordinator; defaults to RINGSERVE_COORDINATOR.
        **overrides: any WorkerConfig field, over the RINGSERVE_* environment.

    Raises:
        InvalidArgumentError: an MPI communicator, or process_sets of the wrong kind.
        CoordinatorUnreachableError, RendezvousTimeoutError: as ringserve.init().
    """
    if comm is not None:
        raise InvalidArgumentError("ringserve does not use MPI: init() takes no communicator.")
    if process_sets is None or process_sets == "dynamic":
        static: list[ProcessSet] = []
    elif isinstance(process_sets, list | tuple) and all(
            isinstance(p, ProcessSet) and not isinstance(p, WholeWorld) for p in process_sets):
        static = list(process_sets)
    else:
        raise InvalidArgumentError(
            f"process_sets must be a list of ProcessSet (not the global one) or \"dynamic\", not {process_sets!r}.")
    api.init(coordinator, **overrides)
    if static:
        api.context().call(lambda w: w.add_process_sets(static))


def process_set_of(process_set: object) -> ProcessSet | None:
    """None for the global set (or None), else the registered set given.

    Raises:
        InvalidArgumentError: not a ProcessSet.
    """
    if process_set is None or isinstance(process_set, WholeWorld):
        return None
    if not isinstance(process_set, ProcessSet):
        raise InvalidArgumentError(f"process_set must be a ProcessSet (or None), not {process_set!r}.")
    return process_set


# The lifecycle's end and the topology are the numpy API's own functions.
shutdown = api.shutdown
is_initialized = api.is_initialized
rank = api.rank
size = api.size
local_rank = api.local_rank
local_size = api.local_size
cross_rank = api.cross_rank
cross_size = api.cross_size


def ringserve_built() -> bool:
    return True


def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


# -- reduce ops and compression -------------------------------------------------------------------


class ReduceOp(enum.Enum):
    """A reduction, as Horovod names it (``hvd.Average``, ``hvd.Sum``, ...)."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"

    def __repr__(self) -> str:
        return self.name.title()


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM


def resolve_op(op: ReduceOp | str | None, average: bool | None = None) -> ReduceOp:
    """The op a call asked for, from Horovod's ``op`` and its deprecated ``average`` flag.

    Raises:
        InvalidArgumentError: both were given, or the op is unknown.
    """
    if op is not None and average is not None:
        raise InvalidArgumentError("Pass either op or the deprecated average flag, not both.")
    if op is None:
        return Sum if average is False else Average
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp(op.lower())
        except ValueError:
            pass
    names = ", ".join(o.value for o in ReduceOp)
    raise InvalidArgumentError(f"The reduce op {op!r} is unknown; use one of {names}.")


class Compressor:
    """A gradient compression: the wire codec (see ringserve.codecs) floating point values travel
    in. Sums are added in float32 whatever the codec, so fp16 never overflows in a sum."""

    wire: str | None = None

    def __repr__(self) -> str:
        return f"Compression.{self.wire or 'none'}"


class _Codec(Compressor):
    def __init__(self, wire: str | None) -> None:
        self.wire = wire


class Compression:
    """The compressions: ``none``, ``fp16``, ``bf16`` (half the bytes) and ``int8`` (a quarter)."""

    none: Compressor = _Codec(None)
    fp16: Compressor = _Codec("fp16")
    bf16: Compressor = _Codec("bf16")
    int8: Compressor = _Codec("int8")


def wire_of(compression: object) -> str | None:
    """The wire codec of a compression (None for none).

    Raises:
        InvalidArgumentError: not one of ``Compression``'s (a compress/decompress pair of one's own
            is torch-binding only).
    """
    if compression is None:
        return None
    wire = getattr(compression, "wire", "?")
    if wire not in (None, "fp16", "bf16", "int8"):
        raise InvalidArgumentError(
            f"The compression {compression!r} is unknown; use Compression.none, fp16, bf16 or int8.")
    return wire


# -- fused collectives -----------------------------------------------------------------------------


def fused_allreduce(arrays: Sequence[np.ndarray], *, op: ReduceOp = Average, name: str,
                    compression: object = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet | None = None) -> list[np.ndarray]:
    """Reduces every array across ranks, in one allreduce per dtype; returns new arrays.

    Every rank passes arrays of the same shapes and dtypes, in the same order. ``compression``
    applies to floating point arrays only; ``prescale_factor`` multiplies before the reduction and
    ``postscale_factor`` after it (Horovod's).

    Raises:
        UnsupportedError: op Adasum (use the torch binding's).
        MismatchError: the ranks passed different shapes or dtypes.
    """
    if op is Adasum:
        raise UnsupportedError("The Keras and TensorFlow bindings do not support Adasum; use Average or Sum.")
    codec = wire_of(compression)
    out: list[np.ndarray | None] = [None] * len(arrays)
    for dtype, indices in _by_dtype(arrays).items():
        flat = np.concatenate([np.ascontiguousarray(arrays[i], dtype=dtype).reshape(-1) for i in indices])
        if prescale_factor != 1.0:
            flat = (flat * prescale_factor).astype(dtype, copy=False)
        reduced = api.allreduce(flat, op=op.value, name=f"{name}.{dtype.name}",
                                compression=codec if dtype.kind == "f" else None, process_set=process_set)
        if postscale_factor != 1.0:
            reduced = (reduced * postscale_factor).astype(dtype, copy=False)
        _split_into(out, indices, arrays, reduced)
    return [a for a in out if a is not None]


def fused_broadcast(arrays: Sequence[np.ndarray], *, root: int, name: str,
                    process_set: ProcessSet | None = None) -> list[np.ndarray]:
    """Root's arrays on every rank, bit for bit, in one broadcast per dtype; returns new arrays.

    Raises:
        MismatchError: the ranks passed different shapes, dtypes or roots.
    """
    out: list[np.ndarray | None] = [None] * len(arrays)
    for dtype, indices in _by_dtype(arrays).items():
        flat = np.concatenate([np.ascontiguousarray(arrays[i], dtype=dtype).reshape(-1) for i in indices])
        taken = api.broadcast(flat, root=root, name=f"{name}.{dtype.name}", process_set=process_set)
        _split_into(out, indices, arrays, taken)
    return [a for a in out if a is not None]


def _by_dtype(arrays: Sequence[np.ndarray]) -> dict[np.dtype[Any], list[int]]:
    groups: dict[np.dtype[Any], list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(np.asarray(a).dtype, []).append(i)
    return dict(sorted(groups.items(), key=lambda kv: kv[0].str))  # the same order on every rank


def _split_into(out: list[np.ndarray | None], indices: list[int], arrays: Sequence[np.ndarray],
                flat: np.ndarray) -> None:
    offset = 0
    for i in indices:
        shape = np.shape(arrays[i])
        n = int(np.prod(shape, dtype=np.int64))
        out[i] = flat[offset:offset + n].reshape(shape)
        offset += n
