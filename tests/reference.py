"""numpy's answer for a reduction across ranks, written apart from ringserve's own reduce ops so
that the tests compare the ring with something that could disagree."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def numpy_reduce(xs: Sequence[np.ndarray], op: str) -> np.ndarray:
    """op over the ranks' arrays, elementwise; integer averages round toward negative infinity."""
    stack = np.stack(list(xs))
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    if op == "product":
        return stack.prod(axis=0, dtype=stack.dtype)
    total = stack.sum(axis=0, dtype=stack.dtype)
    if op == "sum":
        return total
    if total.dtype.kind == "f":
        return np.divide(total, total.dtype.type(len(xs)))
    return np.floor_divide(total, len(xs))
