"""Reduce ops of the torch binding, with Horovod's names, and their mapping onto the core's ops."""

from __future__ import annotations

import enum

from ringserve.errors import InvalidArgumentError


class ReduceOp(enum.Enum):
    """A reduction, as Horovod names it (``hvd.Average``, ``hvd.Sum``, ...)."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"

    def __repr__(self) -> str:
        return f"ringserve.torch.{self.name.title()}"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

_CORE_OPS = {Average: "average", Sum: "sum", Min: "min", Max: "max", Product: "product", Adasum: "adasum"}


def resolve(op: ReduceOp | str | None, average: bool | None = None) -> ReduceOp:
    """Returns the op a call asked for, from Horovod's ``op`` and its deprecated ``average`` flag.

    Raises:
        InvalidArgumentError: both were given, the op is unknown, or it is not supported.
    """
    if op is not None and average is not None:
        raise InvalidArgumentError("Pass either op or the deprecated average flag, not both.")
    if op is None:
        op = Sum if average is False else Average
    if isinstance(op, str):
        try:
            op = ReduceOp(op.lower())
        except ValueError:
            names = ", ".join(o.value for o in ReduceOp)
            raise InvalidArgumentError(f"The reduce op {op!r} is unknown; use one of {names}.") from None
    if not isinstance(op, ReduceOp):
        raise InvalidArgumentError(f"The reduce op {op!r} is not a ringserve.torch.ReduceOp.")
    return op


def core_op(op: ReduceOp, collective: str = "allreduce") -> str:
    """The core's name of an op ("average", "sum", "min", "max", "product" or "adasum").

    Raises:
        InvalidArgumentError: Adasum for a collective other than an allreduce (as in Horovod).
    """
    if op is Adasum and collective not in ("allreduce", "grouped_allreduce"):
        raise InvalidArgumentError(f"{collective} does not support Adasum (nor does Horovod's); use Sum or Average.")
    return _CORE_OPS[op]
