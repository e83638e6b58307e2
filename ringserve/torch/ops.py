"""Reduce ops of the torch binding: Horovod's names, from the one table all bindings share
(ringserve.bindings: ``ReduceOp``, ``resolve_op``), and what the torch binding adds, the rule that
Adasum is an allreduce's only."""

from __future__ import annotations

from ringserve.bindings import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ringserve.bindings import resolve_op as resolve
from ringserve.errors import InvalidArgumentError

__all__ = ["Adasum", "Average", "Max", "Min", "Product", "ReduceOp", "Sum", "core_op", "resolve"]


def core_op(op: ReduceOp, collective: str = "allreduce") -> str:
    """The core's name of an op ("average", "sum", "min", "max", "product" or "adasum").

    Raises:
        InvalidArgumentError: Adasum for a collective other than an allreduce (as in Horovod).
    """
    if op is Adasum and collective not in ("allreduce", "grouped_allreduce"):
        raise InvalidArgumentError(f"{collective} does not support Adasum (nor does Horovod's); use Sum or Average.")
    return op.value
